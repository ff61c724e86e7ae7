#!/usr/bin/env python
"""What one core of each rank can move on this host, both ranks at once: the floor under an in-place
all-reduce over shared memory (bench/shared_memory/README.md, "where the time goes").

Usage (from the repository root; about 20 s)::

    .venv/bin/mpiexec -n 2 .venv/bin/python bench/shared_memory/shm_floor.py --mib 64,256

Every rank runs each pattern over its own buffer of MIB MiB at the same time (a barrier before each run;
median of 7 of the slowest rank), in 128 KiB pieces as the transport's steps do:

- ``read -> slot (memcpy)``: ``np.copyto`` of the buffer into one small buffer (glibc's memcpy, which is
  ``rep movsb`` at these sizes on current x86): what the transport's copy in does;
- ``read+write (add)``: ``np.add`` of a small buffer into the buffer in place: one read and one write of every
  line, the least an in-place all-reduce must do to its own buffer;
- ``pull peer -> slot (CMA)``: ``process_vm_readv`` of the next rank's buffer into a small buffer, the
  single-copy path of Open MPI's ``smsc/cma`` (skipped where the kernel or a seccomp profile refuses it).

Prints GiB/s per rank. A rank's own buffer of an in-place all-reduce is read and written once, and half of
it travels to the peer and back (2 ranks): compare the all-reduce's time with ``MIB / add-rate`` plus
``MIB / cross-core rate`` (bench/shared_memory/README.md).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics

import numpy as np
from mpi4py import MPI

PIECE = 128 << 10


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _timed(comm, fn, reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = MPI.Wtime()
        fn()
        times.append(comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="64,256", help="buffer sizes per rank, MiB, comma-separated")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    libc = ctypes.CDLL(None, use_errno=True)
    for mib in (int(m) for m in args.mib.split(",")):
        buf = np.random.default_rng(comm.rank).random((mib << 20) // 4, dtype=np.float32)
        small = np.zeros(PIECE // 4, np.float32)
        step = small.size
        peer_pid, peer_addr = comm.allgather((os.getpid(), buf.ctypes.data))[(comm.rank + 1) % comm.size]
        local, remote = _Iovec(small.ctypes.data, PIECE), _Iovec(0, PIECE)

        def pull() -> None:
            for off in range(0, buf.nbytes, PIECE):
                remote.base = peer_addr + off
                if libc.process_vm_readv(peer_pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != PIECE:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

        patterns = {
            "read -> slot (memcpy)": lambda: [np.copyto(small, buf[i:i + step]) for i in range(0, buf.size, step)],
            "read+write (add)": lambda: [np.add(buf[i:i + step], small, out=buf[i:i + step])
                                         for i in range(0, buf.size, step)],
        }
        try:
            pull()
            ok = True
        except OSError as e:
            ok = False
            why = str(e)
        if all(comm.allgather(ok)):
            patterns["pull peer -> slot (CMA)"] = pull
        elif comm.rank == 0:
            print(f"{mib} MiB: process_vm_readv refused here ({why if not ok else 'on another rank'}); skipped")
        for name, fn in patterns.items():
            seconds = _timed(comm, fn)
            if comm.rank == 0:
                print(f"{comm.size} ranks, {mib:4d} MiB each, {name:24s} {seconds * 1e3:8.2f} ms "
                      f"{mib / 1024 / seconds:6.1f} GiB/s per rank", flush=True)
        comm.Barrier()  # no rank frees its buffer while a peer may still pull from it


if __name__ == "__main__":
    main()
