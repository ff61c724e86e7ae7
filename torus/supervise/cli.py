"""torus-run: launch an MPI job and relaunch it, on the hosts still usable, after a lost rank or host.

    torus-run --hostfile hosts -n 8 --min-np 4 -- python train.py --epochs 90
    torus-run -n 4 -- python train.py                  (this host alone)

Each launch goes through MPICH's mpiexec (or srun inside a Slurm allocation) with TORUS_JOB_ID (one id for
the whole run) and TORUS_RESTART (0, 1, ...) set on every rank. A rank killed by a signal, a host the
launcher can no longer reach, or the ranks' stall timeout after a peer vanished (exit status 75) relaunches the
job; a bad argument (status 2) or an error on the ranks ends it with that status. A host that cannot be reached
is left out of the next launch, one whose ranks failed in two launches in a row is left out for --cooldown
seconds, and the rank count becomes min(-n, the slots left) as long as that is at least --min-np. One line on
stderr per restart, a summary at the end; the exit status is the job's (0 on success) or the last failure's.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

from torus import cli, knobs
from torus.supervise import hosts as hostlist
from torus.supervise import launch, report
from torus.supervise.hosts import Health, Host, HostError

PROG = "torus-run"
# Arguments of the launcher that torus-run sets itself for every launch: not allowed in --mpiexec-args.
_OWN = {"mpiexec": {"-n", "-np", "-hosts", "-host", "-f", "-hostfile", "-machinefile", "-configfile", "-ppn", ":"},
        "srun": {"-n", "--ntasks", "-N", "--nodes", "-w", "--nodelist", "-x", "--exclude", "--export"}}
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DISCOVERY_TIMEOUT_S = 60.0  # the discovery script's time limit at each launch


def parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(prog=PROG, description=__doc__, usage=f"{PROG} [options] -- COMMAND [ARGS...]")
    ap.add_argument("--hostfile", metavar="FILE",
                    help="host[:slots] lines as hydra reads them; without it (and without a discovery script) the "
                         "job runs on this host with -n slots")
    ap.add_argument("--host-discovery-script", metavar="S",
                    help="command run before every launch that prints host[:slots] lines (Horovod's convention; "
                         f"at most {DISCOVERY_TIMEOUT_S:g} s)")
    ap.add_argument("-n", "--np", type=int, metavar="N",
                    help="ranks to start (default: every slot of the first host list)")
    ap.add_argument("--min-np", type=int, metavar="M", default=1,
                    help="relaunch only while at least M slots remain on usable hosts")
    ap.add_argument("--max-restarts", type=int, metavar="K", default=3, help="relaunch at most K times")
    ap.add_argument("--cooldown", type=float, metavar="SECONDS", default=300.0,
                    help="how long a host whose ranks failed in two launches in a row is left out")
    ap.add_argument("--probe-timeout", type=float, metavar="SECONDS", default=10.0,
                    help="how long the reachability probe of a host (one 'true' through the launcher) may take")
    ap.add_argument("--mpiexec-args", metavar="ARGS",
                    help="arguments for the launcher, passed to every launch and probe (one string, split as a "
                         "shell would; srun's inside Slurm), e.g. \"-launcher ssh -iface eth0\"")
    ap.add_argument("--launcher", choices=("auto", "mpiexec", "srun"), default="auto",
                    help="auto: srun inside a Slurm allocation (SLURM_JOB_ID and SLURM_JOB_NODELIST set), else "
                         "the mpiexec beside this Python (or on PATH)")
    ap.add_argument("--job-id", metavar="ID", help="TORUS_JOB_ID for the ranks (default: a new random id)")
    return ap


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torus-run's options, the command after ``--``). ``--mpiexec-args VALUE`` becomes
    ``--mpiexec-args=VALUE``: its value starts with a dash, which argparse would take for an option."""
    options, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    joined, i = [], 0
    while i < len(options):
        if options[i] == "--mpiexec-args" and i + 1 < len(options):
            joined.append(f"--mpiexec-args={options[i + 1]}")
            i += 2
        else:
            joined.append(options[i])
            i += 1
    return joined, command


def main(argv: list[str] | None = None) -> int:
    options, command = _split(list(sys.argv[1:] if argv is None else argv))
    ap = parser()
    args = ap.parse_args(options)
    if not command:
        ap.error("no command: put it after --, e.g. torus-run -n 4 -- python train.py")
    for flag, value, least in (("-n", args.np, 1), ("--min-np", args.min_np, 1), ("--max-restarts",
                               args.max_restarts, 0), ("--cooldown", args.cooldown, 0), ("--probe-timeout",
                               args.probe_timeout, 0.1)):
        if value is not None and value < least:
            ap.error(f"{flag} {value}: must be at least {least}")
    if args.hostfile and args.host_discovery_script:
        ap.error("--hostfile and --host-discovery-script: give one of them")
    try:
        launcher = _launcher(args)
        source = _source(args, launcher)
        first = source()
    except (HostError, ValueError) as e:
        cli.usage_error(PROG, str(e))
        return cli.USAGE  # not reached: usage_error exits
    total = sum(h.slots for h in first)
    wanted = args.np or total
    if wanted > total:
        ap.error(f"-n {wanted}: the hosts have {total} slots ({_names(first)})")
    if args.min_np > wanted:
        ap.error(f"--min-np {args.min_np} is above the {wanted} ranks asked for")
    return Supervisor(args, launcher, source, wanted, command).run(first)


def _launcher(args: argparse.Namespace) -> launch.Launcher:
    """The launcher (raises ValueError with the reason when it cannot be used)."""
    kind = args.launcher
    if kind == "auto":
        kind = "srun" if hostlist.in_slurm(os.environ) else "mpiexec"
    if kind == "srun":
        exe = shutil.which("srun")
    else:
        exe = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if exe is None:
        raise ValueError(f"no {kind} found{' beside ' + sys.executable if kind == 'mpiexec' else ''} or on PATH")
    try:
        extra = shlex.split(args.mpiexec_args or "")
    except ValueError as e:
        raise ValueError(f"--mpiexec-args {args.mpiexec_args!r}: {e}") from None
    own = [a for a in extra if a.split("=", 1)[0] in _OWN[kind]]
    if own:
        raise ValueError(f"--mpiexec-args: {own[0]} is set by {PROG} for every launch (hosts come from --hostfile, "
                         "the discovery script or the Slurm allocation; the rank count from -n)")
    local = kind == "mpiexec" and not (args.hostfile or args.host_discovery_script)
    return launch.Launcher(kind, exe, extra, local=local)


def _source(args: argparse.Namespace, launcher: launch.Launcher) -> Callable[[], list[Host]]:
    """What gives the host list before each launch."""
    if args.hostfile:
        fixed = hostlist.read_hostfile(args.hostfile)
        return lambda: fixed
    if args.host_discovery_script:
        return lambda: hostlist.discover(args.host_discovery_script, DISCOVERY_TIMEOUT_S)
    if launcher.kind == "srun":
        if not hostlist.in_slurm(os.environ):
            raise ValueError("--launcher srun outside a Slurm allocation needs --hostfile or a discovery script")
        allocation = hostlist.slurm_hosts(os.environ)
        return lambda: allocation
    if args.np is None:
        raise ValueError("-n is needed without --hostfile or --host-discovery-script (the ranks on this host)")
    here = [hostlist.this_host(args.np)]
    return lambda: here


def _names(hosts: list[Host]) -> str:
    return ",".join(f"{h.name}:{h.slots}" for h in hosts)


class Supervisor:
    """The launch loop of one torus-run: launch, and on a failure worth it, probe, choose hosts, relaunch."""

    def __init__(self, args: argparse.Namespace, launcher: launch.Launcher, source: Callable[[], list[Host]],
                 wanted: int, command: list[str]):
        self.args, self.launcher, self.source, self.wanted, self.command = args, launcher, source, wanted, command
        self.job_id = args.job_id or uuid.uuid4().hex
        self.health = Health(args.cooldown)
        self.summary = report.Summary()
        self.proc: subprocess.Popen | None = None
        self.stopped_by: int | None = None  # a signal this process received: forward it, relaunch no more

    def run(self, first: list[Host]) -> int:
        previous = {s: signal.signal(s, self._forward) for s in _FORWARDED}
        try:
            return self._loop(first)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _forward(self, signum, frame) -> None:
        self.stopped_by = signum
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signum)  # mpiexec and srun pass it on to the ranks and end the job

    def _loop(self, first: list[Host]) -> int:
        known, placed = first, hostlist.place(first, self.wanted)
        excluded: list[str] = []
        restart = 0
        reached: int | None = None  # the newest step the previous launch reported
        while True:
            env = dict([knobs.setting("TORUS_JOB_ID", self.job_id), knobs.setting("TORUS_RESTART", restart),
                        knobs.setting("TORUS_RUN_PROGRESS", 1)])
            cmd = self.launcher.job(placed, env, self.command, excluded)
            try:
                ended = launch.run(cmd, {**os.environ, **env}, started=self._started)
            except OSError as e:
                report.say(f"error: cannot start {cmd[0]}: {e.strerror}")
                return 127
            finally:
                self.proc = None
            if restart:
                self.summary.resumed(reached, ended.scan.resumed)
            reached = ended.scan.progress
            status = ended.status
            if status == 0 or self.stopped_by is not None:
                if self.stopped_by is not None:
                    report.say(f"stopped by signal {self.stopped_by}; not relaunching")
                    status = 128 + self.stopped_by if status else 0
                report.say(self.summary.line(status))
                return status

            # A failed launch: ask every host still listed whether the launcher reaches it.
            known = self._hosts(known)
            now = time.monotonic()
            cooling = self.health.cooling(now)
            asked = [h.name for h in known if h.name not in cooling]
            usage = status == launch.USAGE and not ended.scan.killed  # a bad argument: no probe needed
            unreachable = {} if usage else \
                launch.probe(self.launcher, asked, self.args.probe_timeout, os.environ)
            launched = [h.name for h in placed]
            # only the hosts of this launch explain its end; any unreachable host is left out of the next one
            verdict = launch.classify(status, ended.scan, {h: w for h, w in unreachable.items() if h in launched},
                                      len([h for h in launched if h in asked]), hostlist.ranks_on(placed))
            failed_here = set(ended.scan.hosts) | set(ended.scan.lost_hosts) | set(unreachable)
            cooled = self.health.record(launched, failed_here, time.monotonic())
            if not verdict.restart:
                report.say(f"not relaunching: {verdict.reason}")
                report.say(self.summary.line(status))
                return status
            if restart >= self.args.max_restarts:
                report.say(f"giving up: {verdict.reason}; --max-restarts {self.args.max_restarts} used up")
                report.say(self.summary.line(status))
                return status
            cooling = self.health.cooling(time.monotonic())
            usable = [h for h in known if h.name not in unreachable and h.name not in cooling]
            placed = hostlist.place(usable, self.wanted)
            slots = sum(h.slots for h in placed)
            if slots < self.args.min_np:
                left = _names(usable) or "no host"
                why = "".join(f"; {h.name} cooling down for {cooling[h.name]:.0f} s more (its ranks failed in two "
                              f"launches in a row: --cooldown)" for h in known if h.name in cooling)
                report.say(f"giving up: {verdict.reason}; {slots} slots left ({left}), fewer than --min-np "
                           f"{self.args.min_np}{why}")
                report.say(self.summary.line(status))
                return status
            if self.stopped_by is not None:  # a signal during the probe
                report.say(f"stopped by signal {self.stopped_by}; not relaunching")
                report.say(self.summary.line(status))
                return status
            restart += 1
            out = [h for h in known if h.name in unreachable or h.name in cooling]
            clauses = report.left_out([h for h in unreachable if h not in cooling],
                                      {h: s for h, s in cooling.items() if h in cooled})
            clauses += [f"{h.name} still cooling down ({cooling[h.name]:.0f} s left)" for h in out
                        if h.name in cooling and h.name not in cooled]
            report.say(report.restart_line(restart, self.args.max_restarts, verdict.reason, clauses, slots,
                                           [h.name for h in placed]))
            excluded = [h.name for h in out]
            self.summary.restarted(excluded, time.monotonic() - ended.detected)

    def _started(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        if self.stopped_by is not None:  # the signal came between two launches
            os.kill(proc.pid, self.stopped_by)

    def _hosts(self, previous: list[Host]) -> list[Host]:
        """The host list for the next launch: the discovery script's answer, or ``previous`` with a warning
        when it fails."""
        try:
            return self.source()
        except HostError as e:
            report.say(f"warning: {e}; keeping the previous host list ({_names(previous)})")
            return previous


if __name__ == "__main__":
    sys.exit(main())
