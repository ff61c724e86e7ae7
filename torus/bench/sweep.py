"""The sweep behind torus-bench: sizes, closed-form inputs, the correctness check and the timing loop.

Vocabulary follows nccl-tests (doc/PERFORMANCE.md): *size* is the bytes of the full buffer (all-reduce: the
buffer; reduce-scatter: the input of all ranks' blocks; all-gather: the output), *count* is ``size`` in
elements; *algbw* = size / time and *busbw* = algbw times the factor that makes it comparable with the
hardware's bandwidth: 2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter and all-gather (n ranks).
Bandwidths are in GB/s (10**9 bytes per second), times in microseconds.
"""
from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np
from mpi4py import MPI

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")
PLACEMENTS = ("out_of_place", "in_place")
# Rank r's input element i is a small integer of period PERIOD in i, so sums over any number of ranks up
# to 1024 are exact even in float16 and bfloat16, and the expected result has a closed form.
PERIOD = 5
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def bus_factor(collective: str, ranks: int) -> float:
    """busbw / algbw (nccl-tests, doc/PERFORMANCE.md): 2(n-1)/n for all-reduce, (n-1)/n otherwise."""
    return (2.0 if collective == "allreduce" else 1.0) * (ranks - 1) / ranks


def parse_size(text: str) -> int:
    """Bytes from ``"4"``, ``"64K"``, ``"256M"``, ``"1G"`` (binary units, optional trailing B).

    Raises ``ValueError`` for anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r}: expected an integer with an optional K, M or G suffix")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def format_size(nbytes: int) -> str:
    """``1024 -> "1K"``, ``3 << 20 -> "3M"``; sizes that are no whole K/M/G stay plain bytes."""
    for suffix in ("G", "M", "K"):
        if nbytes and nbytes % _UNITS[suffix] == 0:
            return f"{nbytes // _UNITS[suffix]}{suffix}"
    return str(nbytes)


def size_steps(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min, min*factor, ... up to max inclusive (nccl-tests' -b/-e/-f)."""
    if min_bytes < 0 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"sizes: need 0 <= min <= max and factor >= 2, got {min_bytes}, {max_bytes}, {factor}")
    steps, size = [], min_bytes
    while size <= max_bytes:
        steps.append(size)
        if size == 0:
            break
        size *= factor
    return steps


def moved_sizes(collective: str, sizes, itemsize: int, ranks: int) -> list[int]:
    """Round each size down to what the collective really moves: a whole number of elements, and for
    reduce-scatter and all-gather a whole number of equal blocks (a multiple of itemsize * ranks).
    Sizes that round to the same value appear once."""
    unit = itemsize * (1 if collective == "allreduce" else ranks)
    return list(dict.fromkeys(s // unit * unit for s in sizes))


# ---------------------------------------------------------------------------------------------- inputs

def _period_values(op: str, rank: int) -> np.ndarray:
    """One period of rank ``rank``'s input, as float64: element i is ``values[i % PERIOD]``.

    prod uses +-1 (products stay exact); every other op uses -2..2, shifted by 3 * rank."""
    residue = (np.arange(PERIOD) + 3 * rank) % PERIOD
    if op == "prod":
        return np.where(residue == 0, -1.0, 1.0)
    return residue - 2.0


def _expected_period(op: str, ranks: int, dtype: np.dtype) -> np.ndarray:
    """One period of the reduction over ``ranks`` ranks, computed on the calling rank alone."""
    table = np.stack([_period_values(op, r) for r in range(ranks)])
    reduce: Any = {"sum": np.sum, "avg": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op]
    out = reduce(table, axis=0)
    if op == "avg":
        out = out / ranks
    return out.astype(dtype)


def fill(buf: np.ndarray, values: np.ndarray, start: int) -> None:
    """``buf[k] = values[(start + k) % PERIOD]`` for every k, touching every page of ``buf`` once."""
    n = buf.size
    head = min(PERIOD, n)
    buf[:head] = np.roll(values, -(start % PERIOD))[:head].astype(buf.dtype)
    done = head  # a multiple of PERIOD whenever the loop runs, so buf[done:] repeats buf[:...]
    while done < n:
        k = min(done, n - done)
        buf[done:done + k] = buf[:k]
        done += k


def count_wrong(got: np.ndarray, values: np.ndarray, start: int, tolerance: float = 0.0) -> int:
    """Elements of ``got`` that differ from ``values[(start + k) % PERIOD]`` (by more than ``tolerance``
    times the expected magnitude when ``tolerance`` > 0; NaN always counts as wrong)."""
    got = got.reshape(-1)
    n = got.size
    expected = np.roll(values, -(start % PERIOD)).astype(got.dtype)
    body = n - n % PERIOD
    parts = ((got[:body].reshape(-1, PERIOD), expected), (got[body:], expected[:n - body]))
    if tolerance == 0:
        return int(sum(np.count_nonzero(g != e) for g, e in parts))
    return int(sum(np.count_nonzero(~(np.abs(g - e) <= tolerance * np.abs(e))) for g, e in parts))


# ---------------------------------------------------------------------------------------------- one size

class _Case:
    """The buffers of one collective at one size, allocated once and reused by every algorithm.

    ``full`` holds all ``count`` elements (the all-reduce input, the reduce-scatter input, the all-gather
    output); ``work`` is the second buffer of the same size (all-reduce output; the in-place buffer of
    reduce-scatter); ``block`` is this rank's ``count / ranks`` elements (reduce-scatter output, all-gather
    input). ``alloc``: ``work`` comes from ``TorusComm.alloc`` (an all-reduce's output, in place its buffer:
    the Keras path's fused gradient buffer); :meth:`close` frees it (collective)."""

    def __init__(self, tc, collective: str, count: int, dtype: np.dtype, op: str, alloc: bool = False):
        self.tc, self.collective, self.op = tc, collective, op
        self.count, self.ranks, self.rank = count, tc.size, tc.rank
        self.block_count = count // tc.size
        self.lo = self.rank * self.block_count
        self.mine = _period_values(op, self.rank)
        self.reduced = _expected_period(op, self.ranks, dtype)
        self.tolerance = 2 * float(ml_dtypes.finfo(dtype).eps) if op == "avg" else 0.0
        self.full = np.empty(count, dtype)
        self.alloc = alloc and collective == "allreduce"
        self.work = tc.alloc(count, dtype) if self.alloc else np.empty(count, dtype)
        self.block = np.empty(self.block_count if collective != "allreduce" else 0, dtype)
        self.reset()

    def reset(self) -> None:
        """Fill every input with this rank's values (in place: the buffer the call reads)."""
        if self.collective == "allreduce":
            fill(self.full, self.mine, 0)
            fill(self.work, self.mine, 0)
        elif self.collective == "reduce_scatter":
            fill(self.full, self.mine, 0)
            fill(self.work, self.mine, 0)
            self.block.fill(0)
        else:
            fill(self.block, self.mine, self.lo)
            self.work.fill(0)
            fill(self.work[self.lo:self.lo + self.block_count], self.mine, self.lo)
            self.full.fill(0)

    def close(self) -> None:
        if self.alloc:
            self.tc.free_alloc(self.work)

    def call(self, placement: str, algorithm: str):
        """Run the collective once; returns the result array to check."""
        tc, inplace = self.tc, placement == "in_place"
        if self.collective == "allreduce":
            if inplace:
                return tc.allreduce(MPI.IN_PLACE, self.work, op=self.op, algorithm=algorithm)
            return tc.allreduce(self.full, self.work, op=self.op, algorithm=algorithm)
        if self.collective == "reduce_scatter":
            if inplace:
                return tc.reduce_scatter(MPI.IN_PLACE, self.work, op=self.op, algorithm=algorithm)
            return tc.reduce_scatter(self.full, self.block, op=self.op, algorithm=algorithm)
        if inplace:
            return tc.allgather(MPI.IN_PLACE, self.work, algorithm=algorithm)
        return tc.allgather(self.block, self.full, algorithm=algorithm)

    def wrong(self, result: np.ndarray) -> int:
        """Wrong elements on this rank, against the closed form."""
        if self.collective == "allreduce":
            return count_wrong(result, self.reduced, 0, self.tolerance)
        if self.collective == "reduce_scatter":
            return count_wrong(result, self.reduced, self.lo, self.tolerance)
        b = self.block_count
        return sum(count_wrong(result[r * b:(r + 1) * b], _period_values(self.op, r), r * b)
                   for r in range(self.ranks))


def time_iterations(comm: MPI.Comm, calls: list, iters: int, warmup: int) -> np.ndarray:
    """Seconds per iteration of each of ``calls``, shape ``(len(calls), iters)``, each the maximum over ranks
    (ranks start each call together after a barrier).

    The calls take turns within every iteration, in an order shuffled anew each iteration (the same on every
    rank: a fixed seed), rather than one call's iterations back to back: a disturbance on a shared machine
    (another tenant, a daemon) then lands on every algorithm of the comparison alike instead of on whichever
    was running, and no call always follows the same other call (in a fixed order, ``auto``, always right
    after MPI's own all-reduce, came out slower than the very schedule it had picked; bench/torus_bench/README.md
    has the figures, and those of two back-to-back runs of one schedule)."""
    for call in calls:
        for _ in range(warmup):
            call()
    local = np.empty((len(calls), iters))
    order = np.random.default_rng(12345)
    for i in range(iters):
        for k in order.permutation(len(calls)):
            call = calls[k]
            comm.Barrier()
            t0 = MPI.Wtime()
            call()
            local[k, i] = MPI.Wtime() - t0
    slowest = np.empty_like(local)
    comm.Allreduce(local, slowest, op=MPI.MAX)
    return slowest


def _stats(seconds: np.ndarray, size: int, factor: float, wrong) -> dict:
    us = seconds * 1e6
    median = float(np.median(us))
    algbw = size / (median * 1e3) if median > 0 else 0.0  # bytes/us / 1e3 = GB/s
    p25, p75 = np.percentile(us, [25, 75])
    return {"time_us": median, "min_us": float(us.min()), "max_us": float(us.max()), "p25_us": float(p25),
            "p75_us": float(p75), "algbw": algbw, "busbw": algbw * factor, "wrong": wrong,
            "times_us": [float(t) for t in us]}


def sweep(tc, collective: str, sizes, algorithms, *, dtype, op: str = "sum", iters: int = 20,
          warmup: int = 5, check: bool = True, alloc: bool = False):
    """Benchmark ``collective`` on TorusComm ``tc`` for each size and algorithm; collective over ``tc``.

    sizes: bytes, already rounded with ``moved_sizes``. Yields one dict per (size, algorithm), the same on
    every rank: size, count, dtype, op, algorithm, resolved (what ``auto`` picked; ``out/in`` when the two
    placements differ), and per placement
    (``out_of_place``, ``in_place``) the median/min/max/quartile times (us) of ``iters`` iterations, each the
    slowest rank's, after ``warmup`` untimed ones, with algbw/busbw (GB/s) from the median and ``wrong``:
    elements that differ from the closed-form result, summed over ranks, from one untimed call on freshly
    filled inputs (None when ``check`` is off). Buffers are allocated and filled once per size. The timed
    iterations of all (algorithm, placement) pairs of one size are interleaved (see ``time_iterations``).
    ``alloc``: the all-reduce output (in place: its buffer) comes from ``TorusComm.alloc`` (every rank on
    one node; ValueError otherwise), freed after each size.
    """
    dtype = np.dtype(dtype)
    factor = bus_factor(collective, tc.size)
    for size in sizes:
        count = size // dtype.itemsize
        case = _Case(tc, collective, count, dtype, op, alloc)
        pairs = [(algorithm, placement) for algorithm in algorithms for placement in PLACEMENTS]
        wrong: dict = {}
        for algorithm, placement in pairs:
            wrong[algorithm, placement] = None
            if check:
                case.reset()
                wrong[algorithm, placement] = tc.comm.allreduce(
                    case.wrong(case.call(placement, algorithm)), op=MPI.SUM)
        seconds = time_iterations(tc.comm, [lambda a=a, p=p: case.call(p, a) for a, p in pairs], iters, warmup)
        case.close()
        for algorithm in algorithms:
            resolved = algorithm
            if algorithm == "auto":  # the pick may differ by placement: "out-of-place/in-place" then
                picks = [tc.auto_choice(collective, size, p == "in_place") for p in PLACEMENTS]
                resolved = picks[0] if picks[0] == picks[1] else "/".join(picks)
            row = {"collective": collective, "size": size, "count": count, "dtype": str(dtype),
                   "op": op if collective != "allgather" else "none", "algorithm": algorithm,
                   "resolved": resolved}
            for placement in PLACEMENTS:
                row[placement] = _stats(seconds[pairs.index((algorithm, placement))], size, factor,
                                        wrong[algorithm, placement])
            yield row
