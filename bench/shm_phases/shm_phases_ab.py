"""The node-level phases over shared memory or over MPI, A/B on the emulated cluster: hierarchical and torus2d
all-reduce across 2 hosts x 2 ranks, the runs alternating ``TORUS_SHM_PHASES=1`` and ``=0``.

    python bench/shm_phases/shm_phases_ab.py       # as root; 1 and 64 MiB at 4 Gbit/s, 3 rounds (about 2 minutes)
    python bench/shm_phases/shm_phases_ab.py --rounds 5 --rate 1gbit --out /tmp/ab

Brings up its own cluster (tests/cluster, name ``torusp``, hosts 10.231.16.1-2, ranks in blocks, TCP between
hosts), always torn down; each round runs ``torus-bench allreduce -b 1M -e 64M -f 64 --algo ALGOS`` once with the
phases on and once off (in alternating order), each under a wall-clock limit. Prints, per algorithm, size and
placement, the median over the rounds of torus-bench's median time with the phases on and off and their
ratio, with the load average before and after each run; writes each run's JSON (its ``environment`` says
whether the phases ran: ``shm_phases``) and the text to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.cluster import Cluster, child_env, unavailable  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/shm_phases/shm_phases_ab.py", description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="4gbit", help="tc rate per host link (default 4gbit)")
    ap.add_argument("--rounds", type=int, default=3, help="on/off pairs of runs (default 3)")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per size (torus-bench -n)")
    ap.add_argument("--algo", default="hierarchical,torus2d", help="torus-bench --algo")
    ap.add_argument("--out", default="/tmp/torus-shm-phases-ab", help="folder for the JSON and the text")
    ap.add_argument("--limit", type=int, default=120, help="seconds each torus-bench run may take")
    args = ap.parse_args(argv)
    why = unavailable()
    if why:
        print(f"skipped: {why}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = str(Path(sys.executable).parent / "torus-bench")
    times: dict = {}  # (algorithm, size, placement, on) -> [median time of each run, us]
    lines, failed = [], 0
    with Cluster(2, args.rate, "torusp", 16) as cluster:
        for r in range(args.rounds):
            for on in ((1, 0) if r % 2 == 0 else (0, 1)):
                path = out / f"round{r}_phases{on}.json"
                cmd = cluster.mpiexec(2) + ["-genv", "TORUS_SHM_PHASES", str(on), "-n", "4", bench, "allreduce",
                                            "-b", "1M", "-e", "64M", "-f", "64", "-n", str(args.iters), "-w", "2",
                                            "--algo", args.algo, "--json", str(path)]
                load = os.getloadavg()[0]
                t0 = time.monotonic()
                try:
                    rc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                                        timeout=args.limit, check=False).returncode
                except subprocess.TimeoutExpired:
                    rc = 124
                lines.append(f"# round {r}, TORUS_SHM_PHASES={on}: exit status {rc}, {time.monotonic() - t0:.0f} s, "
                             f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
                print(lines[-1], flush=True)
                if rc != 0 or not path.exists():
                    failed += 1
                    continue
                report = json.loads(path.read_text())
                if report["environment"]["shm_phases"] != bool(on):
                    lines.append(f"#   the phases {'did not run' if on else 'ran'}: not counted")
                    failed += 1
                    continue
                for row in report["results"]:
                    for placement in ("out_of_place", "in_place"):
                        key = (row["algorithm"], row["size"], placement, on)
                        times.setdefault(key, []).append(row[placement]["time_us"])
    lines.append(f"# 2 hosts x 2 ranks, links {args.rate}, float32 sum; median over {args.rounds} rounds of each "
                 "run's median (ms)")
    lines.append(f"{'algorithm':>13} {'size':>9} {'placement':>13} {'shm phases':>11} {'MPI':>9} {'ratio':>6}")
    for algo, size, placement in sorted({k[:3] for k in times}):
        on, off = (times.get((algo, size, placement, v), []) for v in (1, 0))
        if on and off:
            a, b = statistics.median(on) / 1e3, statistics.median(off) / 1e3
            lines.append(f"{algo:>13} {size >> 20:>7}Mi {placement:>13} {a:>11.2f} {b:>9.2f} {a / b:>6.2f}")
    text = "\n".join(lines) + "\n"
    (out / "shm_phases_ab.txt").write_text(text)
    print(text + f"# wrote {out / 'shm_phases_ab.txt'}; {failed} run(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
