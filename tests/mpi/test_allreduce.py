"""TorusComm.allreduce for every algorithm, grid and node layout against MPI_Allreduce (see oracle.py).

Budget: the op x dtype matrix runs at one count that no grid divides (37, exact data) and on random data
(1001 elements, float types, with the rounding bounds of oracle.py); the count list (0 to 786,433 elements,
3 MiB) runs at float32 in each buffer mode; segmentation with 64-byte segments at small counts. Every
check also compares the result bytes across ranks.
"""
from __future__ import annotations

import numpy as np
import pytest

import torus
from oracle import (
    CASES,
    DTYPES,
    FLOATS,
    OPS,
    SIZE,
    assert_matches,
    assert_same_on_all_ranks,
    expected,
    make,
    sentinel,
    torus_comm,
    unchanged,
)

COUNTS = sorted({0, 1, max(SIZE - 1, 0), 7, 1003, 786_433})  # SIZE - 1: fewer elements than ranks


def allreduce(tc, algo, x, op, mode):
    """Run one all-reduce in buffer ``mode``: "in" (IN_PLACE), "out" (NaN/sentinel-filled recvbuf) or
    "alloc" (recvbuf=None); check sendbuf is untouched; return the result."""
    sendbuf = x.copy()
    if mode == "in":
        out = tc.allreduce(torus.IN_PLACE, sendbuf, op=op, algorithm=algo)
        assert out is sendbuf
        return out
    sendbuf.flags.writeable = False  # a read-only sendbuf is fine
    recvbuf = sentinel(x.size, x.dtype) if mode == "out" else None
    out = tc.allreduce(sendbuf, recvbuf, op=op, algorithm=algo)
    assert recvbuf is None or out is recvbuf
    assert out.shape == x.shape and out.dtype == x.dtype
    unchanged(x, sendbuf, f"allreduce({algo}, {mode})")
    return out


def check(tc, algo, x, op, mode, exact=True):
    what = f"allreduce({algo}, op={op}, dtype={x.dtype}, count={x.size}, {mode})"
    ref, bound = expected(x, op, exact)
    out = allreduce(tc, algo, x, op, mode)
    assert_matches(out, ref, bound, what)
    assert_same_on_all_ranks(out, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASES)
def test_every_op_and_dtype_exact(case, op, dtype, rng):
    if op == "avg" and dtype.kind == "i":
        pytest.skip("avg on integers raises (test_bad_input.py)")
    tc, algo = torus_comm(case)
    for mode in ("in", "out"):
        check(tc, algo, make(rng, dtype, op, 37), op, mode)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
@pytest.mark.parametrize("case", CASES)
def test_random_floats_within_rounding_bound(case, op, dtype, rng):
    tc, algo = torus_comm(case)
    check(tc, algo, make(rng, dtype, op, 1001, exact=False), op, "out", exact=False)


@pytest.mark.parametrize("mode", ["in", "out", "alloc"])
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("case", CASES)
def test_counts(case, count, mode, rng):
    tc, algo = torus_comm(case)
    check(tc, algo, make(rng, np.float32, "sum", count), "sum", mode)


@pytest.mark.parametrize("count", [1, 5, 37, 1003])
@pytest.mark.parametrize("case", CASES)
def test_tiny_segments(case, count, rng):
    """64-byte segments: many messages per chunk at small counts (and a partial last segment)."""
    tc, algo = torus_comm(case, segment_bytes=64)
    check(tc, algo, make(rng, np.float64, "max", count), "max", "out")
    check(tc, algo, make(rng, np.float16, "avg", count, exact=False), "avg", "in", exact=False)


def test_multidimensional_and_0d_buffers_keep_their_shape(rng):
    tc, algo = torus_comm("ring")
    x = make(rng, np.int64, "sum", 60).reshape(3, 4, 5)
    ref, _ = expected(x, "sum")
    out = tc.allreduce(x, np.empty(60, np.int64), op="sum", algorithm=algo)  # recvbuf: any shape, same count
    assert out.shape == (60,)
    assert_matches(out, ref, None, "allreduce(ring) of a 3x4x5 buffer")
    assert_matches(allreduce(tc, algo, x, "sum", "alloc"), ref, None, "allreduce(ring) of a 3x4x5 buffer")
    scalar = make(rng, np.float64, "sum", 1).reshape(())
    ref, _ = expected(scalar, "sum")
    out = allreduce(tc, algo, scalar, "sum", "alloc")
    assert out.shape == ()
    assert_matches(out, ref, None, "allreduce(ring) of a 0-d array")


@pytest.mark.parametrize("count", [7, 786_433])
def test_auto_picks_a_correct_algorithm(count, rng):
    """algorithm="auto" (small and large messages take different rows of select.py's table)."""
    tc, _ = torus_comm("ring")
    check(tc, "auto", make(rng, np.float32, "sum", count), "sum", "out")


def test_sendbuf_is_recvbuf_means_in_place(rng):
    tc, algo = torus_comm("torus2d-1xN")
    x = make(rng, np.int32, "max", 50)
    ref, _ = expected(x, "max")
    buf = x.copy()
    assert tc.allreduce(buf, buf, op="max", algorithm=algo) is buf
    assert_matches(buf, ref, None, "allreduce(torus2d, sendbuf is recvbuf)")
