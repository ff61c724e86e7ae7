#!/usr/bin/env python
"""A/B of two source trees (or two venvs): one command run from each side in alternating rounds, and the
median-of-rounds table. The one A/B harness of bench/ (bench/harness/README.md).

    python bench/harness/ab.py --a /tmp/wt-old --b . --ranks 2,4 --rounds 3 --out /tmp/ab.json -- \\
        torus-bench allreduce -b 64K -e 64M -f 4 -n 20 -w 5 --algo ring,torus2d,native,auto
    python bench/harness/ab.py --a /tmp/wt-old --b . --ranks 2 --rounds 4 -- \\
        bench/overlap/one_host_step.py --model mlp --steps 60 >> results.jsonl
    python bench/harness/ab.py --a /tmp/wt-old --b . --labels old,new --ranks 8 --keep OUT --tag rr4x2 \\
        --launch "python -m tests.cluster --name nf run --ppn 2 --round-robin -- -n {ranks}" -- torus-bench ...

A side is a source tree (a checkout with its extensions built in place or copied in; ``.`` is this one), run
through bench/harness/tree.py, or a venv (a folder with ``bin/python``), run with its own installed torus. The
command is a console script (``torus-bench``, ``torus-sim``, ...) or a ``.py`` file; ``--launch`` puts a launcher
before it (default ``mpiexec -n {ranks}``, ``{ranks}`` from ``--ranks``; ``""``: none, one process).

Round i runs A then B at every rank count, the order flipping every round, so drift on a loaded machine hits
both. With ``torus-bench`` each run gets ``--json``, and the table gives, per (ranks, algorithm, size,
placement), the median over rounds of each side's median time, B / A, and the spread of A's own per-round
medians (max/min): the run-to-run noise a change must exceed. ``--out`` writes every round's figures as JSON.
Any other command: each line of its output that is a JSON object is printed with ``side``, ``round`` and
``ranks`` added (JSON lines for a results file); other lines go to stderr. ``--keep DIR`` keeps every run's
output (``[TAG_]LABEL_pRANKS_rROUND.txt``, and ``.json`` for torus-bench).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TREE = HERE / "tree.py"


def is_venv(side: Path) -> bool:
    return (side / "bin" / "python").exists()


def side_command(side: Path, command: list[str]) -> list[str]:
    """The command line that runs ``command`` from ``side``."""
    name, args = command[0], command[1:]
    script = str(Path(name).resolve()) if name.endswith(".py") else name
    if is_venv(side):
        return [str(side / "bin" / "python"), script, *args] if name.endswith(".py") \
            else [str(side / "bin" / name), *args]
    return [sys.executable, str(TREE), str(side), script, *args]


def launcher(template: str, ranks: int, side: Path) -> list[str]:
    """The launcher's words: ``mpiexec`` is the venv's (or this Python's), ``python`` this Python."""
    words = shlex.split(template.format(ranks=ranks))
    if words and words[0] == "mpiexec":
        ours = side / "bin" / "mpiexec" if is_venv(side) else Path(sys.executable).parent / "mpiexec"
        words[0] = str(ours) if ours.exists() else "mpiexec"
    elif words and words[0] == "python":
        words[0] = sys.executable
    return words


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/harness/ab.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--a", type=Path, required=True, help="the baseline: a source tree or a venv")
    ap.add_argument("--b", type=Path, required=True, help="the change: a source tree or a venv")
    ap.add_argument("--labels", default="a,b", help="names of the two sides in the output (default: a,b)")
    ap.add_argument("--ranks", default="2,4", help="comma-separated rank counts, {ranks} in --launch (default: 2,4)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    ap.add_argument("--launch", default="mpiexec -n {ranks}", help="launcher before the command ('': none)")
    ap.add_argument("--limit", type=float, help="seconds each run may take (default: no limit)")
    ap.add_argument("--out", type=Path, help="torus-bench: write every round's figures and the table as JSON")
    ap.add_argument("--keep", type=Path, help="keep every run's output in this folder")
    ap.add_argument("--tag", default="", help="prefix of the kept files' names")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    args = ap.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        ap.error("no command (put it after --)")
    args.a, args.b = args.a.resolve(), args.b.resolve()
    args.labels = args.labels.split(",")
    if len(args.labels) != 2:
        ap.error("--labels takes two names")
    return args


def run(args: argparse.Namespace, side: Path, label: str, ranks: int, rnd: int, folder: Path) -> dict | None:
    """One run; torus-bench's JSON report, ``{}`` for another command, None when it failed."""
    stem = folder / f"{args.tag + '_' if args.tag else ''}{label}_p{ranks}_r{rnd + 1}"
    bench = Path(args.command[0]).name == "torus-bench"
    cmd = (launcher(args.launch, ranks, side) if args.launch else []) + side_command(side, args.command)
    if bench:
        cmd += ["--json", str(stem.with_suffix(".json"))]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.limit, check=False)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, output = 124, f"{e.stdout or ''}{e.stderr or ''}\n# ran past --limit {args.limit} s"
    stem.with_suffix(".txt").write_text(f"$ {shlex.join(cmd)}\n{output}")
    if rc != 0 or (bench and not stem.with_suffix(".json").exists()):
        print(f"{label} p{ranks} round {rnd + 1}: exit status {rc} ({stem.with_suffix('.txt')})", file=sys.stderr)
        return None
    if bench:
        return json.loads(stem.with_suffix(".json").read_text())
    for line in output.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            print(json.dumps({**row, "side": label, "round": rnd + 1, "ranks": ranks}), flush=True)
        else:
            print(line, file=sys.stderr)
    return {}


def table(args: argparse.Namespace, times: dict) -> list[dict]:
    print(f"# A = {args.labels[0]} ({args.a}), B = {args.labels[1]} ({args.b}); median over {args.rounds} rounds "
          "of each run's median; A spread = max/min of A's per-round medians")
    print(f"{'ranks':>5} {'algorithm':>12} {'bytes':>10} {'placement':>12} {'A us':>10} {'B us':>10} "
          f"{'B/A':>6} {'A spread':>9}")
    rows = []
    for (p, algo, size, placement), t in sorted(times.items()):
        if not (t["a"] and t["b"]):
            continue
        a, b = statistics.median(t["a"]), statistics.median(t["b"])
        spread = max(t["a"]) / min(t["a"])
        rows.append({"ranks": p, "algorithm": algo, "size": size, "placement": placement, "a_us": t["a"],
                     "b_us": t["b"], "ratio": b / a, "a_spread": spread})
        print(f"{p:>5} {algo:>12} {size:>10} {placement:>12} {a:>10.1f} {b:>10.1f} {b / a:>6.2f} {spread:>9.2f}")
    return rows


def main(argv=None) -> int:
    args = parse(argv)
    ranks = [int(r) for r in args.ranks.split(",")] if args.launch else [1]
    sides = (("a", args.a, args.labels[0]), ("b", args.b, args.labels[1]))
    times: dict = {}  # (ranks, algorithm, size, placement) -> {"a": [...], "b": [...]}
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(args.rounds):
            for p in ranks:
                for key, side, label in (sides if i % 2 == 0 else sides[::-1]):
                    report = run(args, side, label, p, i, folder)
                    failed += report is None
                    for row in (report or {}).get("results", []):
                        for placement in ("out_of_place", "in_place"):
                            cell = times.setdefault((p, row["algorithm"], row["size"], placement), {"a": [], "b": []})
                            cell[key].append(row[placement]["time_us"])
            print(f"round {i + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    if times:
        rows = table(args, times)
        if args.out:
            args.out.write_text(json.dumps({"a": str(args.a), "b": str(args.b), "labels": args.labels,
                                            "ranks": ranks, "rounds": args.rounds, "command": args.command,
                                            "launch": args.launch, "rows": rows}, indent=1))
    if failed:
        print(f"{failed} run(s) failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
