"""TorusComm.reduce_scatter for every algorithm, grid and node layout against MPI_Allreduce (see oracle.py).

Budget: the op x dtype matrix at uneven recvcounts (2r+1 elements on rank r), exact data, in place and out of
place; random floats (sum, avg) with the rounding bounds of oracle.py; the recvcounts patterns (zeros
included, up to 131,073 elements per rank) at float32 in each buffer mode; 64-byte segments.
"""
from __future__ import annotations

import numpy as np
import pytest

import torus
from oracle import (
    BLOCK_FORM,
    CASES,
    DTYPES,
    FLOATS,
    OPS,
    PATTERNS,
    SIZE,
    WORLD,
    assert_matches,
    expected,
    make,
    sentinel,
    torus_comm,
    unchanged,
)

RANK = WORLD.Get_rank()


def reduce_scatter(tc, algo, x, counts, op, mode, block_form=False):
    """One reduce-scatter of ``x`` (every rank's full input) in buffer ``mode`` ("in", "out", "alloc");
    checks that sendbuf, or in place every element outside this rank's block, is untouched."""
    recvcounts = None if block_form else counts
    lo = sum(counts[:RANK])
    hi = lo + counts[RANK]
    what = f"reduce_scatter({algo}, {mode})"
    if mode == "in":
        buf = x.copy()
        out = tc.reduce_scatter(torus.IN_PLACE, buf, recvcounts=recvcounts, op=op, algorithm=algo)
        assert out.size == counts[RANK] and (out.size == 0 or np.shares_memory(out, buf[lo:hi]))
        assert buf[:lo].tobytes() == x[:lo].tobytes() and buf[hi:].tobytes() == x[hi:].tobytes(), \
            f"{what} on rank {RANK}: elements outside block {RANK} changed"
        return out
    sendbuf = x.copy()
    sendbuf.flags.writeable = False  # a read-only sendbuf is fine
    recvbuf = sentinel(counts[RANK], x.dtype) if mode == "out" else None
    out = tc.reduce_scatter(sendbuf, recvbuf, recvcounts=recvcounts, op=op, algorithm=algo)
    assert recvbuf is None or out is recvbuf
    assert out.size == counts[RANK] and out.dtype == x.dtype
    unchanged(x, sendbuf, what)
    return out


def check(tc, algo, counts, x, op, mode, exact=True, block_form=False):
    ref, bound = expected(x, op, exact)
    lo = sum(counts[:RANK])
    hi = lo + counts[RANK]
    out = reduce_scatter(tc, algo, x, counts, op, mode, block_form)
    assert_matches(out, ref[lo:hi], None if bound is None else bound[lo:hi],
                   f"reduce_scatter({algo}, op={op}, dtype={x.dtype}, recvcounts={counts}, {mode})")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASES)
def test_every_op_and_dtype_exact(case, op, dtype, rng):
    if op == "avg" and dtype.kind == "i":
        pytest.skip("avg on integers raises (test_bad_input.py)")
    tc, algo = torus_comm(case)
    counts = PATTERNS["uneven"]
    for mode in ("in", "out"):
        check(tc, algo, counts, make(rng, dtype, op, sum(counts)), op, mode)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("case", CASES)
def test_random_floats_within_rounding_bound(case, op, dtype, rng):
    tc, algo = torus_comm(case)
    counts = [167] * SIZE
    check(tc, algo, counts, make(rng, dtype, op, sum(counts), exact=False), op, "out", exact=False,
          block_form=True)


@pytest.mark.parametrize("mode", ["in", "out", "alloc"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("case", CASES)
def test_recvcounts(case, pattern, mode, rng):
    tc, algo = torus_comm(case)
    counts = PATTERNS[pattern]
    check(tc, algo, counts, make(rng, np.float32, "sum", sum(counts)), "sum", mode,
          block_form=pattern in BLOCK_FORM)


@pytest.mark.parametrize("pattern", ["block1", "uneven", "zeros"])
@pytest.mark.parametrize("case", CASES)
def test_tiny_segments(case, pattern, rng):
    """64-byte segments: many messages per block, a partial last segment."""
    tc, algo = torus_comm(case, segment_bytes=64)
    counts = [37 * c for c in PATTERNS[pattern]]
    check(tc, algo, counts, make(rng, np.float32, "min", sum(counts)), "min", "out")
    check(tc, algo, counts, make(rng, np.float16, "avg", sum(counts), exact=False), "avg", "in", exact=False)
