"""One launch of the job through the existing launcher, what its end means, and the reachability probe.

- :class:`Launcher` builds the command lines: the job (hydra's ``mpiexec -hosts h1:2,h2:2 -n 4 -genv ...``, or
  ``srun --nodelist ... --ntasks ... --export=ALL,...`` inside a Slurm allocation) and the probe (one process
  running ``true`` on one host, through the same launcher and its arguments).
- :func:`run` starts a launch in a session of its own, passes its stdout and stderr through as they come (bytes,
  unchanged) while :class:`Scan` reads them line by line, and after the launcher's exit ends what is left of
  that session. hydra starts every proxy and rank in a session of their own (measured), so a rank on a host
  that the launcher lost outlives ``mpiexec`` until its own watchdog ends it (torus.faults); nothing here can
  reach it.
- :func:`probe` asks every host at once, each bounded by a timeout.
- :func:`classify` decides from the exit status, what :class:`Scan` read and the probe whether a relaunch may
  cure the end: only a lost process or host does.

What hydra (MPICH 5.0) prints, measured here (tests/test_supervise_classify.py holds the samples): a rank killed
by a signal gives the banner ``BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES`` on stdout, whose ``PID ...
RUNNING AT <host>`` names a process of the host that reported first (across hosts, the dead rank's host; never
reliably the dead rank: hydra kills the others with SIGKILL and names the first it lists); on one host it adds
``EXIT STRING: Killed (signal 9)`` and exits with the signal number, across hosts it exits 255. A rank that
exits with a status (``os._exit(3)``, ``MPI_Abort(1)``) gives no banner and that status. A rank killed by
SIGKILL cannot be told from the others hydra killed, so which rank died is known only from srun.
"""
from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from torus.supervise.hosts import Host

USAGE = 2  # a bad argument (argparse's status, and torus' CLIs'): never relaunched
# torus.faults.PEER_LOST_EXIT, repeated here: importing torus.faults would start MPI in the supervisor.
PEER_LOST_EXIT = 75
# After the launcher's exit, read what is left in its pipes for at most this long: a helper of a lost host
# (the emulated cluster's ``ip netns exec`` shell) may hold them open for as long as that host's proxy lives.
DRAIN_S = 1.0
# A rank aborted for a lost peer (``[rank R] calling MPI_Abort(75)``) and the launcher has not ended this long
# after: it waits on a host it lost (hydra's proxy behind a cut link). torus-run ends its session itself and
# takes the launch as ended by a lost peer. Longer than MPI_Abort needs on reachable hosts.
LAUNCHER_GRACE_S = 30.0

_PEER_LOST = re.compile(rf"\[rank \d+\] calling MPI_Abort\({PEER_LOST_EXIT}\)")

_BANNER = re.compile(r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES")
_RUNNING_AT = re.compile(r"^=\s+PID \d+ RUNNING AT (\S+)")
_EXIT_STRING = re.compile(r"EXIT STRING: (.*?) \(signal (\d+)\)")
_KILLED_BY = re.compile(r"KILLED BY SIGNAL: (\d+) \((.*)\)")  # hydra before MPICH 4
_SRUN_TASKS = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
_SRUN_NODE = re.compile(r"^srun: error: (?:Node failure on (\S+)|.*[Tt]ask launch .* failed on node (\S+?):)")
_SRUN_EXITED = re.compile(r"Exited with exit code (\d+)")
_HYDRA_PREFIX = re.compile(r"^\[[^\]]+\] (?:\[[^\]]+\] )?\w+ \([^)]*\): ")
RESUMED = re.compile(r"torus-run: resumed at step (\d+)")
PROGRESS = re.compile(rb"^torus-run: at step (\d+)$")  # the ranks' progress marker: read here, not shown


@dataclass
class Launcher:
    """The launcher of every launch: ``kind`` "mpiexec" (hydra) or "srun"; ``exe`` its path; ``args`` the user's
    own arguments for it (``--mpiexec-args``), passed to every launch and probe; ``local``: the job runs on this
    host alone (no hostfile), so no host list is passed."""
    kind: str
    exe: str
    args: list[str]
    local: bool = False

    def job(self, placed: list[Host], env: Mapping[str, str], command: list[str],
            excluded: Sequence[str] = ()) -> list[str]:
        """The command line that starts ``command`` on ``placed`` (each host with the ranks it holds), with
        the variables ``env`` set on every rank; srun also gets ``--exclude`` of the hosts left out."""
        ranks = sum(h.slots for h in placed)
        if self.kind == "srun":
            exports = ",".join(f"{k}={v}" for k, v in env.items())
            return [self.exe, *self.args, *self._overlap(), f"--nodes={len(placed)}",
                    f"--nodelist={','.join(h.name for h in placed)}", f"--ntasks={ranks}", "--distribution=block",
                    "--kill-on-bad-exit=1", "--quit-on-interrupt",
                    f"--export=ALL,{exports}",
                    *([f"--exclude={','.join(excluded)}"] if excluded else []), *command]
        hosts = [] if self.local else ["-hosts", ",".join(f"{h.name}:{h.slots}" for h in placed)]
        genv = [word for k, v in env.items() for word in ("-genv", k, v)]
        return [self.exe, *self.args, *hosts, "-n", str(ranks), *genv, *command]

    def _overlap(self) -> list[str]:
        """srun's ``--overlap`` (Slurm 20.11 on): the step of a lost node stays on record, holding its CPUs on
        every node it ran on, until that node's slurmd answers; without it the relaunch and the probes wait
        for those CPUs ("Requested nodes are busy") instead of starting."""
        return [] if "--overlap" in self.args else ["--overlap"]

    def probe(self, host: str) -> list[str]:
        """The command line that runs ``true`` as one process on ``host``: it fails or hangs where the
        launcher cannot reach the host."""
        if self.kind == "srun":
            return [self.exe, *self.args, *self._overlap(), "--nodes=1", f"--nodelist={host}", "--ntasks=1",
                    "true"]
        return [self.exe, *self.args, *([] if self.local else ["-hosts", host]), "-n", "1", "true"]


@dataclass
class Scan:
    """What a launch's output says about its end, fed one line at a time (:meth:`line`), stdout and stderr
    alike: the hosts where ranks failed, in the order reported (``hosts``), the signal that killed a rank
    (``signal``, ``signal_name``) where the launcher names it, srun's failed ranks per host (``ranks``) and
    whether they exited by themselves (``exited``: srun's status per host), when the first sign of a failure
    came (``first_failure``, ``time.monotonic()``), the ranks' ``torus-run: resumed at step S0`` line
    (``resumed``: S0, the first one) and the last ``torus-run: at step S`` marker (``progress``: S, the newest
    step the job reached; printed by the ranks where ``TORUS_RUN_PROGRESS`` is set, at most every 0.2 s)."""
    hosts: list[str] = field(default_factory=list)
    signal: int | None = None
    signal_name: str = ""
    banner: bool = False
    ranks: dict[str, str] = field(default_factory=dict)
    exited: dict[str, int] = field(default_factory=dict)
    lost_hosts: list[str] = field(default_factory=list)
    first_failure: float | None = None
    resumed: int | None = None
    progress: int | None = None
    peer_lost: float | None = None  # when a rank first said it aborts for a lost peer

    def line(self, text: str, now: float) -> None:
        if self.resumed is None and (found := RESUMED.search(text)):
            self.resumed = int(found.group(1))
            return
        if _PEER_LOST.search(text):
            if self.peer_lost is None:
                self.peer_lost = now
            self._failed(now)
        elif _BANNER.search(text):
            self.banner = True
            self._failed(now)
        elif found := _RUNNING_AT.match(text):
            self._host(found.group(1), now)
        elif found := _EXIT_STRING.search(text):
            self.signal, self.signal_name = int(found.group(2)), found.group(1)
        elif found := _KILLED_BY.search(text):
            self.signal, self.signal_name = int(found.group(1)), found.group(2)
        elif found := _SRUN_TASKS.match(text):
            host, ranks, what = found.groups()
            self._host(host, now)
            self.ranks.setdefault(host, ranks)
            exited = _SRUN_EXITED.search(what)
            if exited:
                self.exited.setdefault(host, int(exited.group(1)))
            elif not self.signal_name:
                self.signal_name = what.strip()
        elif found := _SRUN_NODE.match(text):
            host = found.group(1) or found.group(2)
            self._host(host, now)
            if host not in self.lost_hosts:
                self.lost_hosts.append(host)

    def _failed(self, now: float) -> None:
        if self.first_failure is None:
            self.first_failure = now

    def _host(self, host: str, now: float) -> None:
        self._failed(now)
        if host not in self.hosts:
            self.hosts.append(host)

    @property
    def killed(self) -> bool:
        """Whether a rank was killed (by a signal, or as hydra's BAD TERMINATION reports), not exited."""
        return self.signal is not None or self.banner or bool(self.signal_name)


@dataclass
class Ended:
    """A finished launch: the launcher's exit ``status`` (128 + N when the launcher itself died of signal N),
    what its output said (``scan``) and when it started and ended (``time.monotonic()``)."""
    status: int
    scan: Scan
    started: float
    ended: float

    @property
    def detected(self) -> float:
        """When the failure was first seen: the first failure line, else the launcher's exit."""
        return min(self.scan.first_failure or self.ended, self.ended)


def run(command: list[str], env: Mapping[str, str], started: Callable[[subprocess.Popen], None] = lambda p: None,
        out: BinaryIO | None = None, err: BinaryIO | None = None) -> Ended:
    """Run one launch: ``command`` in a session of its own with environment ``env``, its stdout and stderr
    passed through to ``out`` and ``err`` (default: this process's) as they come, and read line by line by a
    :class:`Scan`. ``started(proc)`` is called once it runs (the caller forwards signals to it). After the
    launcher exits, what is left of its session (its process group) is killed, and its pipes are read for at
    most :data:`DRAIN_S` more seconds. A launcher still running :data:`LAUNCHER_GRACE_S` after a rank aborted
    for a lost peer is ended the same way, and the launch counts as ended with ``PEER_LOST_EXIT``. Raises
    ``OSError`` when the launcher cannot start."""
    sinks = {1: out or sys.stdout.buffer, 2: err or sys.stderr.buffer}
    scan = Scan()
    t0 = time.monotonic()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(env), start_new_session=True)
    started(proc)
    assert proc.stdout is not None and proc.stderr is not None
    partial = {1: b"", 2: b""}
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, 1)
        sel.register(proc.stderr, selectors.EVENT_READ, 2)
        deadline, stuck = None, False
        while sel.get_map():
            if deadline is None and not stuck and scan.peer_lost is not None \
                    and time.monotonic() - scan.peer_lost > LAUNCHER_GRACE_S and proc.poll() is None:
                _end_session(proc.pid)
                stuck = True
            if deadline is None and proc.poll() is not None:
                _end_session(proc.pid)
                deadline = time.monotonic() + DRAIN_S
            if deadline is not None and time.monotonic() > deadline:
                break
            for key, _ in sel.select(timeout=0.1):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                sink = sinks[key.data]
                sink.write(_without_progress(chunk, scan))
                sink.flush()
                *lines, partial[key.data] = (partial[key.data] + chunk).split(b"\n")
                now = time.monotonic()
                for line in lines:
                    scan.line(line.decode(errors="replace"), now)
    for rest in partial.values():
        if rest:
            scan.line(rest.decode(errors="replace"), time.monotonic())
    status = proc.wait()
    _end_session(proc.pid)
    proc.stdout.close()
    proc.stderr.close()
    if stuck:
        status = PEER_LOST_EXIT
    return Ended(128 - status if status < 0 else status, scan, t0, time.monotonic())


def _end_session(pid: int) -> None:
    """SIGKILL what is left of the launcher's session (its process group: the launcher was its leader)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def probe(launcher: Launcher, hosts: list[str], timeout_s: float, env: Mapping[str, str]) -> dict[str, str]:
    """Run :meth:`Launcher.probe` on every host at once; returns ``{host: why}`` for the hosts it could not
    reach (the probe's exit status and last line of output, or that it did not answer within ``timeout_s``
    seconds; a probe past its time is killed with its session)."""
    procs, unreachable = {}, {}
    for host in hosts:
        try:
            procs[host] = subprocess.Popen(launcher.probe(host), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
        except OSError as e:
            unreachable[host] = f"the probe cannot start: {e.strerror}"
    deadline = time.monotonic() + timeout_s
    for host, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _end_session(proc.pid)
            proc.communicate()
            unreachable[host] = f"no answer to the probe within {timeout_s:g} s"
            continue
        _end_session(proc.pid)
        if proc.returncode != 0:
            unreachable[host] = f"the probe failed with exit status {proc.returncode}: {_cause(output)}"
    return unreachable


def _cause(output: bytes) -> str:
    """The first line of a failed probe's output, where hydra and ssh put the cause, without hydra's
    ``[proxy:0@vm] function (file:line): `` prefix."""
    for line in output.decode(errors="replace").splitlines():
        if line.strip():
            return _HYDRA_PREFIX.sub("", line.strip())
    return "no output"


@dataclass
class Verdict:
    """Whether a failed launch is relaunched (``restart``), and why, in words for the restart line."""
    restart: bool
    reason: str


def classify(status: int, scan: Scan, unreachable: Mapping[str, str], probed: int,
             ranks_on: Mapping[str, str] | None = None) -> Verdict:
    """Decide on a launch that ended with ``status`` != 0, from what its output said (``scan``) and the probe
    of the ``probed`` hosts that held its ranks, of which ``unreachable`` (``{host: why}``) failed. ``ranks_on``
    names the ranks each host held (``{"h3": "ranks 4-5"}``) for the message. In this order:

    - a rank killed by a signal, or reported by the launcher as terminated badly, or a node srun lost:
      relaunch;
    - status 2, a bad argument: not relaunched;
    - every host of the launch unreachable: the launcher itself fails (a bad ``--mpiexec-args``?): not
      relaunched;
    - some host of the launch unreachable: relaunch (the host is left out);
    - status :data:`PEER_LOST_EXIT` (75), the ranks' stall timeout after a peer vanished: relaunch;
    - any other status (an exception on the ranks, the program's own exit status): not relaunched.
    """
    ranks_on = ranks_on or {}
    lost = "; ".join(f"{h} unreachable ({why})" for h, why in unreachable.items())
    if scan.killed:
        where = _where(scan, ranks_on)
        how = f"killed by signal {scan.signal} ({scan.signal_name})" if scan.signal is not None else \
            f"ended: {scan.signal_name}" if scan.signal_name else "terminated badly (the launcher gives no signal)"
        return Verdict(True, f"{where} {how}" + (f"; {lost}" if lost else ""))
    if scan.lost_hosts:
        return Verdict(True, f"srun lost {', '.join(scan.lost_hosts)}" + (f"; {lost}" if lost else ""))
    if status == USAGE:
        return Verdict(False, "exit status 2 (a bad argument)")
    if unreachable and len(unreachable) == probed:
        return Verdict(False, f"exit status {status}, and the probe fails on every host: {lost}")
    if unreachable:
        return Verdict(True, f"exit status {status}; {lost}")
    if status == PEER_LOST_EXIT:
        return Verdict(True, f"exit status {status} (the ranks lost a peer: a stall timeout)")
    exited = "".join(f"; {scan.ranks[h]} on {h} exited with status {c}" for h, c in scan.exited.items())
    return Verdict(False, f"exit status {status} (an error on the ranks or the program's own status){exited}")


def _where(scan: Scan, ranks_on: Mapping[str, str]) -> str:
    if not scan.hosts:
        return "a rank"
    host = scan.hosts[0]
    if host in scan.ranks:  # srun names them
        many = any(c in scan.ranks[host] for c in ",-")
        return f"{'ranks' if many else 'rank'} {scan.ranks[host]} on {host}"
    held = f" ({ranks_on[host]})" if host in ranks_on else ""
    return f"a rank on {host}{held}"


def _without_progress(chunk: bytes, scan: Scan) -> bytes:
    """``chunk`` less its whole ``torus-run: at step S`` lines, whose S goes to ``scan.progress`` (the ranks
    print each marker in one write, so it arrives whole in one chunk)."""
    if b"torus-run: at step " not in chunk:
        return chunk
    kept = []
    for line in chunk.split(b"\n"):
        found = PROGRESS.match(line)
        if found:
            scan.progress = int(found.group(1))
        else:
            kept.append(line)
    return b"\n".join(kept)
