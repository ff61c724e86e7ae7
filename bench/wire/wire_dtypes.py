"""All-reduce time per dtype at one element count, in alternating rounds: is a 16-bit wire worth it?

    python -m tests.cluster --name fp16 run -- -n 2 .venv/bin/python bench/wire/wire_dtypes.py \
        --count 25.6M --algo auto,ring,native --rounds 4 --iters 3 --json bench/wire/results/wire_dtypes_2x1.jsonl

Each round runs every (algorithm, dtype) once, ``--iters`` timed all-reduces (one untimed first), the order of
the dtypes flipping every round so that drift on a shared machine hits all of them alike. Rank 0 prints, per
algorithm, the median over rounds of each dtype's median time, what ``auto`` picked for that dtype, and each
16-bit dtype's time over float32's (the figure of merit: the same element count, half the bytes). With
``--json`` one line per (round, algorithm, dtype) is appended, and a summary line with the command.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import torus
from torus.ops import BFLOAT16

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BFLOAT16}


def _count(text: str) -> int:
    mult = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if mult != 1 else text) * mult)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=_count, default=25_557_032, help="elements (default: ResNet-50's)")
    ap.add_argument("--algo", default="auto,ring", help="comma-separated algorithms")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--op", default="sum")
    ap.add_argument("--in-place", action="store_true")
    ap.add_argument("--json", help="append results here (rank 0)")
    args = ap.parse_args(argv)
    tc = torus.TorusComm()
    algos = args.algo.split(",")
    names = args.dtypes.split(",")
    rng = np.random.default_rng(tc.rank)
    data = {n: rng.standard_normal(args.count).astype(DTYPES[n]) for n in names}
    outs = {n: np.empty_like(data[n]) for n in names}
    times: dict = {}
    out = open(args.json, "a") if args.json and tc.rank == 0 else None
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for algo in algos:
            for n in order:
                x = data[n]
                send = MPI.IN_PLACE if args.in_place else x
                recv = outs[n]
                tc.allreduce(send, recv, op=args.op, algorithm=algo)
                ts = []
                for _ in range(args.iters):
                    if args.in_place:
                        recv[...] = x
                    tc.comm.Barrier()
                    t0 = time.perf_counter()
                    tc.allreduce(send, recv, op=args.op, algorithm=algo)
                    ts.append(time.perf_counter() - t0)
                slowest = np.array(ts)
                tc.comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)  # a call ends when its last rank ends
                ts = slowest.tolist()
                med = statistics.median(ts)
                times.setdefault((algo, n), []).append(med)
                if out:
                    picked = tc.auto_choice("allreduce", x.nbytes, args.in_place)
                    out.write(json.dumps({"round": rnd, "algorithm": algo, "dtype": n, "count": args.count,
                                          "picked": picked if algo == "auto" else algo, "times_s": ts,
                                          "median_s": med, "ranks": tc.size, "nodes": tc.nodes,
                                          "in_place": args.in_place}) + "\n")
    if tc.rank == 0:
        lines = [f"# {' '.join(sys.argv)}  ranks {tc.size}, nodes {tc.nodes}, count {args.count}, "
                 f"link {tc.link_gbits} Gbit/s, load {os.getloadavg()[0]:.2f}"]
        for algo in algos:
            ref = statistics.median(times.get((algo, "float32"), [float("nan")]))
            for n in names:
                x = data[n]
                m = statistics.median(times[(algo, n)])
                picked = tc.auto_choice("allreduce", x.nbytes, args.in_place) if algo == "auto" else algo
                lines.append(f"{algo:>12} {n:>9} picks {picked:>12}: median {m * 1e3:8.1f} ms "
                             f"(rounds {' '.join(f'{v * 1e3:.0f}' for v in times[(algo, n)])})  "
                             f"/ float32 {m / ref:.2f}")
        print("\n".join(lines), flush=True)
        if out:
            out.write(json.dumps({"summary": lines}) + "\n")
            out.close()
    tc.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
