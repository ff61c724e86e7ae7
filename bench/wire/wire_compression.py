"""The Keras gradient all-reduce's host side with and without compression, in alternating rounds.

    python -m tests.cluster --name fp16 run -- -n 2 .venv/bin/python bench/wire/wire_compression.py \
        --algo auto,native --rounds 3 --json bench/wire/results/wire_compression_2x1.jsonl

``HostAllreduce`` (integrations/keras/collectives/host.py, what ``TorusStrategy(compression=...)`` calls every step)
on one flat float32 buffer of ``--count`` elements (default: ResNet-50's gradient count), op avg: ``none``
all-reduces it as float32, ``fp16``/``bf16`` narrow it, all-reduce the 16-bit copy in place and widen it back. Each
round runs every (algorithm, compression) once, ``--iters`` timed calls after one untimed, the order flipping every
round. Rank 0 prints per algorithm the median of the slowest rank's per-round medians and each compression's time
over ``none``'s; ``--json`` appends one line per (round, algorithm, compression) and a summary line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import torus  # noqa: E402
from torus.integrations.keras import HostAllreduce  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=25_557_032)
    ap.add_argument("--algo", default="auto,native")
    ap.add_argument("--compression", default="none,fp16,bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    tc = torus.TorusComm()
    algos, kinds = args.algo.split(","), args.compression.split(",")
    hosts = {(a, k): HostAllreduce(tc, a, k, window=False) for a in algos for k in kinds}
    x = np.random.default_rng(tc.rank).standard_normal(args.count).astype(np.float32)
    times: dict = {}
    out = open(args.json, "a") if args.json and tc.rank == 0 else None
    for rnd in range(args.rounds):
        for algo in algos:
            for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
                host = hosts[(algo, kind)]
                host("avg", x)
                ts = []
                for _ in range(args.iters):
                    tc.comm.Barrier()
                    t0 = time.perf_counter()
                    host("avg", x)
                    ts.append(time.perf_counter() - t0)
                slowest = np.array(ts)
                tc.comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
                med = statistics.median(slowest.tolist())
                times.setdefault((algo, kind), []).append(med)
                if out:
                    out.write(json.dumps({"round": rnd, "algorithm": algo, "compression": kind,
                                          "count": args.count, "times_s": slowest.tolist(), "median_s": med,
                                          "ranks": tc.size, "nodes": tc.nodes}) + "\n")
    if tc.rank == 0:
        lines = [f"# {' '.join(sys.argv)}  ranks {tc.size}, nodes {tc.nodes}, count {args.count}, "
                 f"load {os.getloadavg()[0]:.2f}"]
        for algo in algos:
            ref = statistics.median(times[(algo, kinds[0])])
            for kind in kinds:
                m = statistics.median(times[(algo, kind)])
                lines.append(f"{algo:>12} {kind:>5}: median {m * 1e3:8.1f} ms (rounds "
                             f"{' '.join(f'{v * 1e3:.0f}' for v in times[(algo, kind)])})  / {kinds[0]} {m / ref:.2f}")
        print("\n".join(lines), flush=True)
        if out:
            out.write(json.dumps({"summary": lines}) + "\n")
            out.close()
    tc.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
