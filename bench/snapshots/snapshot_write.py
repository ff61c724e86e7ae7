#!/usr/bin/env python
"""What a snapshot takes from the training thread, and how long its background write runs (torus/snapshot).

Usage (from the repository root; about 30 s at the defaults)::

    .venv/bin/python bench/snapshots/snapshot_write.py --mib 100 --reps 5 [--dir FOLDER]

The state: ``--mib`` MiB of float32 arrays in a ResNet-50-like mix (a few large kernels, many small ones, one
0-d counter; fixed seed). Per repetition (the median and the maximum of ``--reps`` are printed):

- ``copy``: ``{name: a.copy()}`` of the state, what the framework layer does at a step boundary before
  handing it over (not part of the store; printed for scale), and ``copy into reused buffers``
  (``np.copyto`` into arrays allocated before: no page faults of fresh memory);
- ``save_async``: the caller's time in ``SnapshotStore.save_async`` (argument checks, the JSON header; no
  array byte is touched there);
- ``write``: from ``save_async`` to ``wait()`` returning: the background thread's file write with CRC-32,
  fsync, rename, fsync of the folder, and the prune of older snapshots (the store keeps two);
- ``python loop while writing``: the rate of a pure-Python loop on the caller's thread during the write,
  against the same loop alone; and the same while a separate process (no shared GIL) writes the same file
  with ``format.write``. Equal ratios mean the loop lost only CPU time (cores, the kernel's writeback), not
  the GIL: the writer holds it only between its system calls and CRC-32 chunks;
- ``read+verify``: ``format.read`` of the file (read, CRC-32, header checks), what each rank does at resume;
- ``crc32`` and ``blake2b``: the two checksums' rates over the same bytes in memory (torus/snapshot/format.py
  says why CRC-32).

``--dir``: where the snapshots go (default: a new temporary folder, removed at the end). The file system and
the machine's load decide the write figure: say which in the results.
"""
from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import shutil
import statistics
import tempfile
import threading
import time
import zlib

import numpy as np

from torus.snapshot import SnapshotStore, format


def state(mib: int) -> dict:
    """``mib`` MiB of float32 arrays: 60 % in 16 large kernels, the rest over 300 small arrays, one counter."""
    rng = np.random.default_rng(0)
    total = mib << 18  # float32 elements
    sizes = [int(total * 0.6) // 16] * 16
    small = total - sum(sizes)
    sizes += [small // 300] * 299 + [small - 299 * (small // 300)]
    arrays = {f"layer{i}/w": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate(sizes)}
    arrays["optimizer/iterations"] = np.array(1234, np.int64)
    return arrays


def loop_rate(stop: threading.Event | None, seconds: float) -> float:
    """Iterations per second of a pure-Python loop, until ``stop`` is set (or for ``seconds``)."""
    n, start = 0, time.perf_counter()
    end = start + seconds
    while (stop is None and time.perf_counter() < end) or (stop is not None and not stop.is_set()):
        for _ in range(1000):
            n += 1
    return n / (time.perf_counter() - start)


def rate(fn, nbytes: int) -> float:
    """GiB/s of ``fn()`` over ``nbytes`` (best of 3)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="torus-snapshot-bench-")
    arrays = state(args.mib)
    nbytes = sum(a.nbytes for a in arrays.values())
    times: dict = {"copy": [], "reused": [], "save_async": [], "write": [], "loop": [], "read": [], "process": []}
    spare = {n: np.empty_like(a) for n, a in arrays.items()}
    store = SnapshotStore(folder, "bench", "resnet50-like")
    try:
        for rep in range(args.reps):
            t0 = time.perf_counter()
            copied = {n: a.copy() for n, a in arrays.items()}
            times["copy"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for n, a in arrays.items():
                np.copyto(spare[n], a)
            times["reused"].append(time.perf_counter() - t0)
            alone = loop_rate(None, 0.5)
            done = threading.Event()
            t0 = time.perf_counter()
            store.save_async(rep, copied, {"epoch": 1, "position": rep})
            times["save_async"].append(time.perf_counter() - t0)
            del copied  # the store owns them now

            def waiter():
                store.wait()
                done.set()
            watcher = threading.Thread(target=waiter)
            watcher.start()
            during = loop_rate(done, 0)
            watcher.join()
            times["write"].append(time.perf_counter() - t0)
            times["loop"].append(during / alone)
            path = store.path(rep)
            t0 = time.perf_counter()
            format.read(path)
            times["read"].append(time.perf_counter() - t0)
            alone = loop_rate(None, 0.5)
            writer = multiprocessing.get_context("fork").Process(
                target=format.write, args=(f"{folder}/process.snap", "bench", "k", rep, arrays, {}))
            writer.start()
            done = threading.Event()
            watcher = threading.Thread(target=lambda: (writer.join(), done.set()))
            watcher.start()
            times["process"].append(loop_rate(done, 0) / alone)
            watcher.join()
        size = path.stat().st_size
        blob = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays.values()])
        crc = rate(lambda: zlib.crc32(blob.data), blob.nbytes)
        blake = rate(lambda: hashlib.blake2b(blob.data).digest(), blob.nbytes)
    finally:
        store.close()
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)

    def ms(key):
        return f"median {statistics.median(times[key]) * 1e3:9.3f} ms  max {max(times[key]) * 1e3:9.3f} ms"
    print(f"state: {len(arrays)} arrays, {nbytes / 2**20:.1f} MiB; file {size / 2**20:.1f} MiB; {args.reps} reps; "
          f"folder {folder}")
    print(f"copy (caller, before save_async)  {ms('copy')}")
    print(f"copy into reused buffers          {ms('reused')}")
    print(f"save_async (caller's thread)      {ms('save_async')}")
    print(f"write (background, incl. fsync)   {ms('write')}   "
          f"{nbytes / statistics.median(times['write']) / 2**30:.2f} GiB/s")
    print(f"read+verify (format.read)         {ms('read')}   "
          f"{nbytes / statistics.median(times['read']) / 2**30:.2f} GiB/s")
    for key, who in (("loop", "this thread's writer"), ("process", "a separate process")):
        print(f"python loop while {who} writes / alone: median {statistics.median(times[key]):.2f}  "
              f"min {min(times[key]):.2f}")
    print(f"checksum in memory: crc32 {crc:.2f} GiB/s, blake2b {blake:.2f} GiB/s")


if __name__ == "__main__":
    main()
