"""Fault injection: a plain Keras ``fit`` job (bench/fault_injection/fault_job.py) or torus-train
(``--job train``: bench/fault_injection/fault_train_job.py) under torus-run across emulated hosts, one fault per
trial, and what the recovery costs (issue 42, "Done when").

    nice -n 5 .venv/bin/python bench/fault_injection/fault_injection.py --hosts 3 --ppn 1 --trials 10    # as root

Makes its own cluster (tests/cluster: ``--hosts`` network namespaces named ``torusfi1..K``, 10.231.21.0/24,
``--rate`` per link, TCP between hosts), torn down at the end, on an error and on SIGTERM/SIGHUP. Each launch
runs ``bench/fault_injection/fault_rank.sh``, which points ``TORUS_SNAPSHOT_DIR`` at a folder of the rank's own host
(``/tmp/torus-fi/<trial>/snap/<host address>``: the namespaces share the machine's host name, so the host is
hydra's ``PMI_HOSTNAME``): node-local storage, no folder shared between hosts.

First the references, uninterrupted under torus-run with the same settings: at every slot (``ref``), again
(``ref_repeat``: run-to-run determinism) and on one host fewer (``ref_fewer``: the float spread between rank
counts, which a run that lost a host cannot beat). Then ``--trials`` rounds of the fault kinds in turn:

- ``kill``: ``kill -9`` of one random rank's process;
- ``link``: one random host's link set down (``ip -n <ns> link set eth0 down``);
- ``host``: every rank of one random host killed (``kill -9``, all at once).

Each at a random step (seeded), after the first snapshot: drawn from ``[3 * snapshot steps, total - 40]``; the
bench watches the job's per-step log (rank 0 appends ``time restart step ranks``). Per trial, one JSON line:
the fault, the step it hit, the torus-run lines (restart, summary), whether training finished (exit 0, every
step trained, final weights saved), the ranks after the restart, the steps redone (from the job's log: the last
step before the fault less the step resumed at; and torus-run's own count) against the snapshot interval, the
time from the fault to the first step trained after the restart (and to torus-run's restart line), the snapshot
files each host held at the fault, the processes left in the namespaces when torus-run ended, and max |w -
w_ref| of the final weights against ``ref``. ``--summary`` rewrites the table
(bench/fault_injection/results/fault_injection.txt) from the JSON lines alone.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "bench" / "fault_injection"
sys.path.insert(0, str(ROOT))
from tests.cluster import Cluster, child_env, unavailable  # noqa: E402

# the job, its steps an epoch, and its environment
JOBS = {"fit": (HERE / "fault_job.py", 29, {}),  # 1,740 rows, global batch 60
        "train": (HERE / "fault_train_job.py", 23, {}),  # torus-train, 1,437 digits, global batch 60
        "resnet50": (HERE / "fault_train_job.py", 20, {"FI_MODEL": "resnet50"})}  # synthetic data
WRAPPER = HERE / "fault_rank.sh"
RESULTS = HERE / "results"
WORK = Path("/tmp/torus-fi")
KINDS = ("kill", "link", "host")
RUN_LIMIT_S = 900  # one torus-run, references and trials alike
QUIET_S = 150  # no output from torus-run and no step logged for this long: a hang (a relaunch's start-up: < 60 s)
REL_TOL = 1e-5


class Output:
    """torus-run's merged stdout/stderr, each line with the wall time it arrived (a reader thread)."""

    def __init__(self, proc: subprocess.Popen, path: Path):
        self.lines: list[tuple[float, str]] = []
        self.file = open(path, "w")  # noqa: SIM115 (closed by the thread)
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc):
        for line in proc.stdout:
            now = time.time()
            self.lines.append((now, line.rstrip("\n")))
            self.file.write(f"{now:.3f} {line}")
            self.file.flush()
        self.file.close()

    def first(self, pattern: str) -> tuple[float, re.Match] | None:
        for t, line in list(self.lines):
            found = re.search(pattern, line)
            if found:
                return t, found
        return None

    def all(self, pattern: str) -> list[str]:
        return [line for _, line in list(self.lines) if re.search(pattern, line)]


def read_log(path: Path) -> list[tuple[float, int, int, int]]:
    """(time, restart, step, ranks) lines of the job's step log (a partial last line skipped)."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            try:
                rows.append((float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3])))
            except ValueError:
                pass
    return rows


def snapshots_held(folder: Path) -> dict[str, list[int]]:
    """{host: sorted snapshot steps} in the trial's snapshot folders."""
    held = {}
    if folder.is_dir():
        for host in sorted(folder.iterdir()):
            held[host.name] = sorted(int(m[1]) for p in host.rglob("step-*.snap")
                                     if (m := re.match(r"step-(\d+)-", p.name)))
    return held


def ref_path(config: str, kind: str) -> Path:
    """Where a reference run's final weights are kept (across invocations: --no-references reuses them)."""
    return WORK / f"weights-{config}-{kind}.npz"


def weights(path: Path) -> list[np.ndarray] | None:
    if not path.exists():
        return None
    with np.load(path) as z:
        return [z[f"w{k}"] for k in range(len(z.files))]


def compare(got: list[np.ndarray] | None, ref: list[np.ndarray] | None) -> dict:
    if got is None or ref is None or len(got) != len(ref):
        return {"max_abs_diff": None, "max_rel_diff": None, "bitwise_equal": None}
    diff = max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(got, ref))
    scale = max(float(np.max(np.abs(b))) for b in ref)
    return {"max_abs_diff": diff, "max_rel_diff": diff / scale,
            "bitwise_equal": all(np.array_equal(a, b) for a, b in zip(got, ref))}


class Bench:
    def __init__(self, args, cluster: Cluster, command: str):
        self.args, self.cluster, self.command = args, cluster, command
        self.rng = random.Random(args.seed)
        self.job, steps_per_epoch, self.job_env = JOBS[args.job]
        self.total = args.epochs * steps_per_epoch
        self.config = f"{args.hosts}x{args.ppn}" + ("" if args.job == "fit" else f"-{args.job}")
        self.running: subprocess.Popen | None = None
        line = cluster.mpiexec(ppn=args.ppn)
        at = line.index("-hosts")
        self.launcher_args = " ".join(shlex.quote(a) for a in line[1:at] + line[at + 2:])

    # -- one torus-run ---------------------------------------------------------------------------------------

    def start(self, name: str, hosts: int) -> tuple[subprocess.Popen, Output, Path]:
        folder = WORK / name
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "pids").mkdir(parents=True)
        hostfile = folder / "hosts"
        hostfile.write_text("".join(f"{a}:{self.args.ppn}\n" for a in self.cluster.addresses[:hosts]))
        cmd = [sys.executable, "-m", "torus.supervise.cli", "--hostfile", str(hostfile), "--mpiexec-args",
               self.launcher_args, "--job-id", name, "--max-restarts", "3", "--", str(WRAPPER), sys.executable,
               str(self.job)]
        env = child_env(TORUS_TIMEOUT=str(self.args.timeout), TORUS_SNAPSHOT_STEPS=str(self.args.snapshot_steps),
                        TORUS_SNAPSHOT_SECONDS=str(self.args.snapshot_seconds), FI_EPOCHS=str(self.args.epochs),
                        FI_LOG=str(folder / "steps.log"), FI_PIDS=str(folder / "pids"),
                        FI_SNAP_ROOT=str(folder / "snap"), FI_OUT=str(folder / "weights.npz"), **self.job_env)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=ROOT, start_new_session=True)
        self.running = proc
        return proc, Output(proc, folder / "torus-run.out"), folder

    def finish(self, proc: subprocess.Popen, out: Output, log: Path | None = None,
               rec: dict | None = None) -> tuple[int | None, float]:
        """Wait for torus-run: at most RUN_LIMIT_S from now, or until neither its output nor the job's step log
        has moved for QUIET_S (a hang: what runs where then goes to ``rec["hang"]``). None when it had to be
        stopped."""
        t0 = time.time()
        seen, active = -1, t0
        status = None
        while True:
            try:
                status = proc.wait(timeout=2)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.time()
            moved = len(out.lines) + (log.stat().st_mtime if log is not None and log.exists() else 0)
            if moved != seen:
                seen, active = moved, now
            if now - t0 > RUN_LIMIT_S or now - active > QUIET_S:
                if rec is not None:
                    rec["hang"] = {"quiet_s": round(now - active, 1), "processes": self.snapshot_processes()}
                self.stop(proc)
                break
        ended = time.time()
        out.thread.join(timeout=5)
        self.running = None
        return status, ended

    def snapshot_processes(self) -> dict:
        """What runs where during a hang: the launchers (root namespace) and each namespace's processes, with
        their state and kernel wait channel, and the TCP sockets of each namespace."""
        def ps(pid: int) -> str:
            return subprocess.run(["ps", "-o", "pid=,ppid=,stat=,wchan:24=,etimes=,args=", "-p", str(pid)],
                                  capture_output=True, text=True, check=False).stdout.strip()[:200]
        found = {"launchers": [ps(p) for p in self.launchers()]}
        for h in range(1, self.cluster.hosts + 1):
            ns = self.cluster.namespace(h)
            found[ns] = [ps(p) for p in self.cluster.pids(ns)]
            found[ns + " sockets"] = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tn"], capture_output=True,
                                                    text=True, check=False).stdout.splitlines()[1:]
        return found

    def stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM torus-run (it passes it to mpiexec), then SIGKILL its session and any mpiexec of this cluster
        left over (torus-run starts each launch in a session of its own)."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in self.launchers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def launchers(self) -> list[int]:
        """Pids of the mpiexec processes (root namespace) that launch through this cluster's ssh stand-in."""
        found = []
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    cmd = (p / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if cmd and cmd[0].endswith(b"mpiexec") and str(self.cluster.nslaunch).encode() in cmd:
                    found.append(int(p.name))
        return found

    def leftovers(self) -> dict[str, list[str]]:
        """What still runs in the namespaces, then killed: {namespace: [command lines]}."""
        left = {ns: [cmd[:120] for _, cmd in procs] for ns, procs in self.cluster.processes().items() if procs}
        for h in range(1, self.cluster.hosts + 1):
            self.cluster.kill_all(self.cluster.namespace(h))
        return left

    # -- references ------------------------------------------------------------------------------------------

    def reference(self, kind: str, hosts: int) -> dict:
        name = f"fi-{self.config}-{kind}"
        t0 = time.time()
        proc, out, folder = self.start(name, hosts)
        hang: dict = {}
        status, ended = self.finish(proc, out, folder / "steps.log", hang)
        log = read_log(folder / "steps.log")
        rec = {**hang, "config": self.config, "kind": kind, "ranks": hosts * self.args.ppn, "exit_status": status,
               "final_step": log[-1][2] if log else None, "seconds": round(ended - t0, 1),
               "train_seconds": round(log[-1][0] - log[0][0], 1) if log else None,
               "summary": (out.all(r"^torus-run: summary") or [None])[-1],
               "leftover_processes": self.leftovers()}
        keep = ref_path(self.config, kind)
        if status == 0 and (folder / "weights.npz").exists():
            shutil.copy(folder / "weights.npz", keep)
        return rec

    # -- one trial -------------------------------------------------------------------------------------------

    def trial(self, index: int, kind: str, ref: list[np.ndarray] | None) -> dict:
        args, cluster = self.args, self.cluster
        name = f"fi-{self.config}-{index:02d}-{kind}"
        target = self.rng.randint(3 * args.snapshot_steps, self.total - 40)
        victim_host = self.rng.randint(1, args.hosts)
        victim_rank = self.rng.randrange(args.hosts * args.ppn)
        rec = {"config": self.config, "kind": "trial", "trial": index, "fault": kind, "job_id": name,
               "target_step": target, "timeout_s": args.timeout, "snapshot_steps": args.snapshot_steps,
               "snapshot_seconds": args.snapshot_seconds, "total_steps": self.total, "command": self.command}
        proc, out, folder = self.start(name, args.hosts)
        log_path = folder / "steps.log"
        fault_t = None
        try:
            while proc.poll() is None:
                log = read_log(log_path)
                if log and log[-1][1] == 0 and log[-1][2] >= target:
                    fault_t = self.inject(kind, folder, victim_rank, victim_host, rec)
                    rec["fault_step"] = read_log(log_path)[-1][2]
                    rec["snapshots_at_fault"] = snapshots_held(folder / "snap")
                    break
                time.sleep(0.02)
            status, ended = self.finish(proc, out, log_path, rec)
        finally:
            if kind == "link":
                cluster.restore(victim_host)
        rec["leftover_processes"] = self.leftovers()
        rec["exit_status"] = status
        rec["hung"] = status is None
        rec["fault_injected"] = fault_t is not None
        rec["restart_lines"] = out.all(r"^torus-run: (restart|giving up|not relaunching)")
        summary = (out.all(r"^torus-run: summary") or [None])[-1]
        rec["summary"] = summary
        found = re.search(r"(\d+) steps redone", summary or "")
        rec["redone_torus_run"] = int(found.group(1)) if found else None
        rec["restarts"] = len(out.all(r"^torus-run: restart \d+/"))
        log = read_log(log_path)
        final_step = log[-1][2] if log else None
        got = weights(folder / "weights.npz")
        rec["final_step"] = final_step
        rec["finished"] = status == 0 and final_step == self.total and got is not None
        rec.update(compare(got, ref))
        if fault_t is None:
            return rec
        rec["resumed_lines"] = out.all(r"torus-run: resumed at step")
        resumed = out.first(r"torus-run: resumed at step (\d+)")
        s0 = int(resumed[1].group(1)) if resumed else None
        rec["resumed_step"] = s0
        before = [s for t, r, s, _ in log if r == 0]
        rec["last_step_before_restart"] = max(before) if before else None
        if s0 is not None and before:
            rec["redone"] = max(before) - s0
        after = [(t, r, s, n) for t, r, s, n in log if r >= 1 and (s0 is None or s > s0)]
        restart_line = out.first(r"^torus-run: restart \d+/")
        if restart_line:
            rec["fault_to_restart_line_s"] = round(restart_line[0] - fault_t, 2)
            found = re.search(r"relaunching (\d+) ranks? on (\S+)", restart_line[1].string)
            if found:
                rec["ranks_after"], rec["hosts_after"] = int(found.group(1)), found.group(2)
        if resumed:
            rec["fault_to_resumed_line_s"] = round(resumed[0] - fault_t, 2)
        if after:
            rec["fault_to_first_step_s"] = round(after[0][0] - fault_t, 2)
            rec["ranks_logged_after"] = after[-1][3]
        return rec

    def inject(self, kind: str, folder: Path, rank: int, host: int, rec: dict) -> float:
        """Inject the fault; returns its wall time."""
        pids = {}
        for f in (folder / "pids").glob("0-*"):
            pid, where = f.read_text().split()
            pids[int(f.name.split("-")[1])] = (int(pid), where)
        if kind == "kill":
            pid, where = pids[rank]
            rec.update(victim=f"rank {rank} (pid {pid}) on {where}")
            t = time.time()
            os.kill(pid, signal.SIGKILL)
        elif kind == "link":
            rec.update(victim=f"host {self.cluster.address(host)} ({self.cluster.namespace(host)})")
            t = time.time()
            self.cluster.cut(host)
        else:
            address = self.cluster.address(host)
            doomed = sorted((r, pid) for r, (pid, where) in pids.items() if where == address)
            rec.update(victim=f"ranks {[r for r, _ in doomed]} (pids {[p for _, p in doomed]}) on {address}")
            t = time.time()
            for _, pid in doomed:
                os.kill(pid, signal.SIGKILL)
        return t


# -- the summary -----------------------------------------------------------------------------------------------

def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def summarize(jsonl: Path, txt: Path) -> str:
    recs = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    commands = []
    for r in recs:
        if r.get("command") and r["command"] not in commands:
            commands.append(r["command"])
    out = ["# " + c for c in commands]
    out.append("")
    out.append("References (uninterrupted, under torus-run with the same settings):")
    refs = {(r["config"], r["kind"]): r for r in recs if r["kind"].startswith("ref")}
    for (config, kind), r in sorted(refs.items()):
        extra = ""
        if kind != "ref" and r.get("max_abs_diff") is not None:
            extra = (f"; against ref: max |dw| {r['max_abs_diff']:.2e} (relative {r['max_rel_diff']:.2e})"
                     f"{', bitwise equal' if r.get('bitwise_equal') else ''}")
        out.append(f"  {config} {kind:10s} {r['ranks']} ranks, exit {r['exit_status']}, {r['final_step']} steps, "
                   f"{r['train_seconds']} s training, {r['seconds']} s in all{extra}")
    out.append("")
    head = ("config", "fault", "trials", "finished", "hung", "fault->first step s (median/max)",
            "fault->restart line s (med/max)", "relaunch->resumed s (med)", "ranks after",
            "redone max (log / torus-run)", "interval", "max |w-w_ref|", "max rel", "bitwise = ref")
    rows = []
    trials = [r for r in recs if r["kind"] == "trial"]
    for config in sorted({r["config"] for r in trials}):
        for fault in KINDS:
            group = [r for r in trials if r["config"] == config and r["fault"] == fault]
            if not group:
                continue
            first = [r["fault_to_first_step_s"] for r in group if r.get("fault_to_first_step_s") is not None]
            line_s = [r["fault_to_restart_line_s"] for r in group if r.get("fault_to_restart_line_s") is not None]
            redone = [r["redone"] for r in group if r.get("redone") is not None]
            redone_tr = [r["redone_torus_run"] for r in group if r.get("redone_torus_run") is not None]
            diffs = [r["max_abs_diff"] for r in group if r.get("max_abs_diff") is not None]
            rels = [r["max_rel_diff"] for r in group if r.get("max_rel_diff") is not None]
            ranks = sorted({r.get("ranks_after") for r in group if r.get("ranks_after") is not None})
            startup = [r["fault_to_resumed_line_s"] - r["fault_to_restart_line_s"] for r in group
                       if r.get("fault_to_resumed_line_s") is not None and r.get("fault_to_restart_line_s") is not None]
            rows.append((config, fault, str(len(group)), str(sum(bool(r["finished"]) for r in group)),
                         str(sum(bool(r.get("hung")) for r in group)),
                         f"{_fmt(statistics.median(first) if first else None)} / {_fmt(max(first, default=None))}",
                         f"{_fmt(statistics.median(line_s) if line_s else None)} / "
                         f"{_fmt(max(line_s, default=None))}",
                         _fmt(statistics.median(startup) if startup else None),
                         ",".join(map(str, ranks)) or "-",
                         f"{_fmt(max(redone, default=None), 'd')} / {_fmt(max(redone_tr, default=None), 'd')}",
                         f"{group[0]['snapshot_steps']} steps / {group[0]['snapshot_seconds']} s",
                         _fmt(max(diffs, default=None), ".2e"), _fmt(max(rels, default=None), ".2e"),
                         f"{sum(bool(r.get('bitwise_equal')) for r in group)}/{len(group)}"))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out.append(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    out.append("-+-".join("-" * w for w in widths))
    out += [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    out += ["", "fault->first step: from the fault to the first step trained after the restart (the job's step log); "
            "fault->restart line: to torus-run's", "restart line (the launch ended, the probe answered); "
            "relaunch->resumed: from that line to the relaunch's 'resumed at step' line (start-up);",
            "redone: the last step logged before the fault less the step resumed at (torus-run's own count reads "
            "its 0.2 s progress", "marker); max |w-w_ref|: final weights against the uninterrupted run at every "
            "slot ('ref' above); tolerance 1e-5 relative."]
    bad = [r for r in trials if not r["finished"] or r.get("hung") or r.get("restarts") != 1]
    if bad:
        out.append("")
        out.append("Trials that did not finish, hung, or restarted other than once:")
        out += [f"  {r['job_id']}: {r.get('victim')} at step {r.get('fault_step')}: exit {r['exit_status']}"
                f"{' (hung: stopped by the bench)' if r.get('hung') else ''}, restarts {r.get('restarts')}, final "
                f"step {r.get('final_step')}; {r.get('summary')}" for r in bad]
    text = "\n".join(out) + "\n"
    txt.write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--ppn", type=int, default=1, help="ranks per host")
    ap.add_argument("--rate", default="1gbit", help="tc rate per host link")
    ap.add_argument("--trials", type=int, default=10, help="trials of each fault kind")
    ap.add_argument("--kinds", default=",".join(KINDS), help="fault kinds, in turn: kill,link,host")
    ap.add_argument("--job", default="fit", choices=sorted(JOBS), help="fit: bench/fault_injection/fault_job.py (a "
                    "plain Keras fit script); train: bench/fault_injection/fault_train_job.py (torus-train --model "
                    "tiny-nobn); resnet50: the "
                    "same with torus-train's ResNet-50 on synthetic 32x32 images (per-rank random data: its "
                    "weights are not compared)")
    ap.add_argument("--epochs", type=int, default=12, help="the job's epochs (fit: 29 steps each, train: 23, "
                    "resnet50: 20)")
    ap.add_argument("--timeout", type=float, default=20.0, help="TORUS_TIMEOUT (s)")
    ap.add_argument("--snapshot-steps", type=int, default=20)
    ap.add_argument("--snapshot-seconds", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--first-trial", type=int, default=0,
                    help="number of the first trial (to append trials to an earlier run's --jsonl with another --seed)")
    ap.add_argument("--no-references", action="store_true", help="reuse the saved reference weights")
    ap.add_argument("--jsonl", type=Path, default=RESULTS / "fault_injection.jsonl", help="appended to")
    ap.add_argument("--txt", type=Path, default=RESULTS / "fault_injection.txt")
    ap.add_argument("--summary", action="store_true", help="only rewrite --txt from --jsonl")
    args = ap.parse_args(argv)
    if args.summary:
        print(summarize(args.jsonl, args.txt), end="")
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    if any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: each of {','.join(KINDS)}")
    why = unavailable()
    if why:
        print(f"fault_injection: cannot make a cluster here: {why}", file=sys.stderr)
        return 1
    command = "nice -n 5 .venv/bin/python bench/fault_injection/fault_injection.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    RESULTS.mkdir(exist_ok=True)
    WORK.mkdir(exist_ok=True)

    def record(rec: dict) -> None:
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(rec) + "\n")
        brief = {k: rec.get(k) for k in ("config", "kind", "fault", "trial", "target_step", "fault_step", "victim",
                                         "exit_status", "finished", "ranks_after", "resumed_step", "redone",
                                         "redone_torus_run", "fault_to_first_step_s", "max_abs_diff",
                                         "bitwise_equal") if rec.get(k) is not None}
        print(json.dumps(brief), flush=True)

    cluster = Cluster(args.hosts, args.rate, name="torusfi", subnet=21)
    bench = None
    with cluster:  # down at exit, on an exception and on SIGTERM/SIGHUP (tests/cluster)
        try:
            bench = Bench(args, cluster, command)
            ref_file = ref_path(bench.config, "ref")
            if not args.no_references:
                ref_rec = bench.reference("ref", args.hosts)
                ref_rec["command"] = command
                record(ref_rec)
                ref = weights(ref_file)
                for kind, hosts in (("ref_repeat", args.hosts), ("ref_fewer", args.hosts - 1)):
                    rec = bench.reference(kind, hosts)
                    rec.update(compare(weights(ref_path(bench.config, kind)), ref), command=command)
                    record(rec)
            ref = weights(ref_file)
            if ref is None:
                print(f"fault_injection: no reference weights at {ref_file}", file=sys.stderr)
                return 1
            for i in range(args.first_trial, args.first_trial + args.trials):
                for kind in kinds:
                    record(bench.trial(i, kind, ref))
        finally:
            if bench is not None and bench.running is not None:
                bench.stop(bench.running)
            if bench is not None:
                for pid in bench.launchers():
                    os.kill(pid, signal.SIGKILL)
    print(summarize(args.jsonl, args.txt), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
