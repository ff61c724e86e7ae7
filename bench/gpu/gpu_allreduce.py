#!/usr/bin/env python
"""All-reduce of GPU buffers through TorusComm, both ways (whole buffer reduced in pinned host memory, and
``gpu_reduce``: reduced on the GPU, messages staged per segment), timed against the same all-reduce of host
buffers and against MPI_Allreduce of host buffers.

Run under mpiexec on a machine with a GPU (several ranks may share one GPU), e.g. from bench/gpu/gpu_run.sh:
``mpiexec -n 2 python bench/gpu/gpu_allreduce.py``. float32, in place, sizes ``--sizes-mib``; per size and
algorithm the median over ``--iters`` calls (after 2 warm-up calls) of the slowest rank's time, with a barrier
before each call. Every result is checked against ``comm.Allreduce`` of the host copies (#wrong). Prints a
table; writes ``gpu_allreduce.json`` to ``$OUT`` when set. Not a test: CI has no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI
from numba import cuda

import torus

try:
    import cupy as cp
except ImportError:
    cp = None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,4,16,64,256")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--algos", default="ring,torus2d,native")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    tc = torus.TorusComm(comm)
    rank = comm.Get_rank()
    rows = []

    def timed(fn, reset):
        times = []
        for i in range(args.iters + 2):
            reset()
            comm.Barrier()
            t = time.perf_counter()
            fn()
            dt = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
            if i >= 2:
                times.append(dt)
        return float(np.median(times))

    for mib in [float(s) for s in args.sizes_mib.split(",")]:
        n = int(mib * (1 << 20)) // 4
        rng = np.random.default_rng(rank)
        x = rng.integers(-8, 9, n).astype(np.float32)  # exact in any order
        want = np.empty_like(x)
        comm.Allreduce(x, want)
        host = x.copy()
        t_mpi = timed(lambda: comm.Allreduce(MPI.IN_PLACE, host), lambda: host.__setitem__(slice(None), x))
        for algo in args.algos.split(","):
            d = cp.asarray(x) if cp is not None else cuda.to_device(x)
            d0 = cp.asarray(x) if cp is not None else cuda.to_device(x)

            def reset():
                if cp is not None:
                    cp.copyto(d, d0)
                    cp.cuda.Device().synchronize()
                else:
                    d.copy_to_device(d0)
            t_dev, wrong = {}, 0
            for staging in ("host", "gpu"):
                tc.gpu_reduce = staging == "gpu"
                t_dev[staging] = timed(lambda: tc.allreduce(torus.IN_PLACE, d, algorithm=algo), reset)
                got = cp.asnumpy(d) if cp is not None else d.copy_to_host()
                wrong += comm.allreduce(int((got != want).sum()))
            t_host = timed(lambda: tc.allreduce(torus.IN_PLACE, host, algorithm=algo),
                           lambda: host.__setitem__(slice(None), x))
            rows.append({"MiB": mib, "algorithm": algo, "gpu_s": t_dev["host"], "gpu_reduce_s": t_dev["gpu"],
                         "host_s": t_host, "mpi_host_s": t_mpi,
                         "wrong": wrong, "ranks": comm.Get_size(), "arrays": "cupy" if cp is not None else "numba"})
    if rank == 0:
        print("gpu: GPU buffers staged whole through the host (gpu_reduce=False); gpu_reduce: reduced on the "
              "GPU, messages staged (gpu_reduce=True); host: the same call on numpy buffers; MPI: MPI_Allreduce "
              "on numpy buffers. The default (gpu_reduce=None) is gpu_reduce from 16 MiB, gpu below")
        print(f"{'MiB':>6s} {'algorithm':>10s} {'gpu ms':>9s} {'gpu_reduce':>11s} {'host ms':>9s} "
              f"{'MPI ms':>9s} {'gpu/host':>9s} {'gpu/MPI':>8s} {'gpu_reduce/MPI':>15s} {'#wrong':>7s}")
        for r in rows:
            print(f"{r['MiB']:6g} {r['algorithm']:>10s} {r['gpu_s'] * 1e3:9.2f} {r['gpu_reduce_s'] * 1e3:11.2f} "
                  f"{r['host_s'] * 1e3:9.2f} {r['mpi_host_s'] * 1e3:9.2f} {r['gpu_s'] / r['host_s']:9.2f} "
                  f"{r['gpu_s'] / r['mpi_host_s']:8.2f} {r['gpu_reduce_s'] / r['mpi_host_s']:15.2f} "
                  f"{r['wrong']:7d}")
        if os.environ.get("OUT"):
            path = Path(os.environ["OUT"]) / f"gpu_allreduce_p{comm.Get_size()}.json"
            path.write_text(json.dumps(rows, indent=1))
            print(f"wrote {path}")
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
