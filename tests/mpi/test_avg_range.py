"""op="avg" never overflows where the mean fits: float16/bfloat16 inputs so large that every partial sum of
two or more ranks leaves the type's range (the bug: ring, native and auto returned inf at 3-4 ranks), for
every algorithm, grid and node layout, all-reduce and reduce-scatter, in place and out of place.

Oracle: the exact mean of every rank's input in float64 (numpy on the all-gathered inputs). Bound, from
torus.ops.avg_factors: the inputs are scaled by a power of two (exact), ``p - 1`` pairwise sums each round
once in float32 and once to 16 bits (``u + u32`` times the partial, at most ``mean(|x|)`` after the final
factor), and the final factor ``2**k / p`` costs one float32 rounding and at most two 16-bit ones
(fused into the last reduction, or a separate pass for native); times 1.05 for second-order terms.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import torus
from oracle import BF16, CASES, SIZE, WORLD, assert_matches, assert_same_on_all_ranks, torus_comm

RANK = WORLD.Get_rank()
HALVES = [np.dtype(np.float16), BF16]
_U = {np.dtype(np.float16): 2.0 ** -11, BF16: 2.0 ** -8}
COUNT = 1003  # no grid divides it


def big_inputs(rng, dtype, count: int = COUNT) -> np.ndarray:
    """Magnitudes in [0.5, 0.95] of the type's maximum with one sign per element shared by all ranks (so
    partial sums of two ranks already overflow), and a tail of ordinary values that must stay accurate."""
    top = float(ml_dtypes.finfo(dtype).max)
    sign = np.random.default_rng(count).choice([-1.0, 1.0], count)  # the same on every rank
    x = sign * rng.uniform(0.5, 0.95, count) * top
    x[-(count // 10):] = rng.standard_normal(count // 10)
    return x.astype(dtype)


def exact_mean(x: np.ndarray):
    """(mean over ranks in float64, bound) for this rank's ``x`` (see the module docstring)."""
    every = np.array(WORLD.allgather(x.astype(np.float64)))
    ref = every.mean(axis=0)
    mean_abs = np.abs(every).mean(axis=0)
    u, u32 = _U[x.dtype], 2.0 ** -24
    sub = float(ml_dtypes.finfo(x.dtype).smallest_subnormal)
    bound = 1.05 * ((SIZE - 1) * (u + u32) * mean_abs + 2 * (u + u32) * np.abs(ref)) + SIZE * sub
    return ref, bound


def assert_finite_mean(out: np.ndarray, ref, bound, what: str) -> None:
    got = out.astype(np.float64)
    assert np.isfinite(got).all(), f"{what} on rank {RANK}: {int((~np.isfinite(got)).sum())} elements not " \
                                   f"finite, first at {int(np.argmax(~np.isfinite(got)))}"
    assert_matches(out, ref, bound, what)


@pytest.mark.parametrize("mode", ["in", "out"])
@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_allreduce_avg_does_not_overflow(case, dtype, mode, rng):
    tc, algo = torus_comm(case)
    x = big_inputs(rng, dtype)
    ref, bound = exact_mean(x)
    buf = x.copy()
    out = tc.allreduce(torus.IN_PLACE if mode == "in" else buf, buf if mode == "in" else None, op="avg",
                       algorithm=algo)
    what = f"allreduce({algo}, avg, {dtype}, {mode})"
    assert_finite_mean(out, ref, bound, what)
    assert_same_on_all_ranks(out, what)


@pytest.mark.parametrize("mode", ["in", "out"])
@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_reduce_scatter_avg_does_not_overflow(case, dtype, mode, rng):
    tc, algo = torus_comm(case)
    counts = [COUNT // SIZE + (r < COUNT % SIZE) for r in range(SIZE)]
    x = big_inputs(rng, dtype)
    ref, bound = exact_mean(x)
    lo, hi = sum(counts[:RANK]), sum(counts[:RANK + 1])
    buf = x.copy()
    if mode == "in":
        out = tc.reduce_scatter(torus.IN_PLACE, buf, recvcounts=counts, op="avg", algorithm=algo)
        assert buf[:lo].tobytes() == x[:lo].tobytes() and buf[hi:].tobytes() == x[hi:].tobytes()
    else:
        out = tc.reduce_scatter(buf, recvcounts=counts, op="avg", algorithm=algo)
        assert buf.tobytes() == x.tobytes(), f"reduce_scatter({algo}) on rank {RANK}: sendbuf was modified"
    assert_finite_mean(out, ref[lo:hi], bound[lo:hi], f"reduce_scatter({algo}, avg, {dtype}, {mode})")
