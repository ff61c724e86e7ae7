#!/usr/bin/env python
"""A/B: the same ``torus-bench`` sweep from two environments (two checkouts' venvs), in alternating rounds.

Usage::

    python bench/harness/ab.py --a /path/to/old/.venv --b /path/to/new/.venv --ranks 2,4 --rounds 3 \
        --out /tmp/ab.json -- allreduce -b 64K -e 64M -f 4 -n 20 -w 5 --algo ring,torus2d,native,auto

Each round runs A then B (the order flips every round, so drift on a loaded machine hits both) at every rank
count. For every (ranks, algorithm, size, placement) it prints the median over rounds of each side's median
time, B / A, and the spread of A's own per-round medians (max/min), the run-to-run noise a change must exceed
to count. The JSON holds every round's figures and both sides' command lines.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _run(venv: Path, ranks: int, bench_args: list[str], out: Path) -> list[dict]:
    cmd = [str(venv / "bin" / "mpiexec"), "-n", str(ranks), str(venv / "bin" / "torus-bench"), *bench_args,
           "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    return json.loads(out.read_text())["results"]


def _key(row: dict, placement: str) -> tuple:
    return row["algorithm"], row["size"], placement


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="venv of the baseline")
    parser.add_argument("--b", type=Path, required=True, help="venv of the change")
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default: 2,4)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    parser.add_argument("--out", type=Path, help="write every round's figures as JSON")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then torus-bench's arguments")
    args = parser.parse_args(argv)
    args.a, args.b = args.a.resolve(), args.b.resolve()
    bench_args = [a for a in args.bench_args if a != "--"]
    ranks = [int(r) for r in args.ranks.split(",")]
    rounds: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = (("a", args.a), ("b", args.b)) if i % 2 == 0 else (("b", args.b), ("a", args.a))
            for p in ranks:
                for side, venv in order:
                    rows = _run(venv, p, bench_args, Path(tmp) / f"{side}{p}.json")
                    for row in rows:
                        for placement in ("out_of_place", "in_place"):
                            rounds.setdefault((p, *_key(row, placement)), {"a": [], "b": []})[side].append(
                                row[placement]["time_us"])
            print(f"round {i + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    print(f"{'ranks':>5} {'algorithm':>12} {'bytes':>10} {'placement':>12} {'A us':>10} {'B us':>10} "
          f"{'B/A':>6} {'A spread':>9}")
    table = []
    for (p, algo, size, placement), t in sorted(rounds.items()):
        a, b = statistics.median(t["a"]), statistics.median(t["b"])
        spread = max(t["a"]) / min(t["a"])
        table.append({"ranks": p, "algorithm": algo, "size": size, "placement": placement, "a_us": t["a"],
                      "b_us": t["b"], "ratio": b / a, "a_spread": spread})
        print(f"{p:>5} {algo:>12} {size:>10} {placement:>12} {a:>10.1f} {b:>10.1f} {b / a:>6.2f} {spread:>9.2f}")
    if args.out:
        args.out.write_text(json.dumps({"a": str(args.a), "b": str(args.b), "ranks": ranks,
                                        "rounds": args.rounds, "torus_bench": bench_args, "rows": table},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
