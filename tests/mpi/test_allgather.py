"""TorusComm.allgather for every algorithm, grid and node layout against MPI_Allgatherv, byte for byte.

Data are random bit patterns (NaNs and all), so any arithmetic on the way would show. Budget: every dtype at
one uneven pattern with zeros, in place and out of place; the recvcounts patterns at float32 in each buffer
mode; 64-byte segments. Every check also compares the result bytes across ranks.
"""
from __future__ import annotations

import numpy as np
import pytest

import torus
from oracle import BLOCK_FORM, CASES, DTYPES, PATTERNS, WORLD, assert_same_on_all_ranks, sentinel, torus_comm, unchanged

RANK = WORLD.Get_rank()


def random_bits(rng, dtype, count):
    dt = np.dtype(dtype)
    return rng.integers(0, 256, count * dt.itemsize, dtype=np.uint8).view(dt)


def gathered(block: np.ndarray, counts) -> np.ndarray:
    """The oracle: MPI_Allgatherv of every rank's block, as bytes."""
    isz = block.itemsize
    out = np.empty(sum(counts) * isz, np.uint8)
    displs = np.cumsum([0] + [c * isz for c in counts[:-1]]).tolist()
    WORLD.Allgatherv(block.view(np.uint8), [out, ([c * isz for c in counts], displs)])
    return out


def check(tc, algo, counts, block, mode, block_form=False):
    recvcounts = None if block_form else counts
    what = f"allgather({algo}, dtype={block.dtype}, recvcounts={counts}, {mode})"
    want = gathered(block, counts)
    if mode == "in":
        lo = sum(counts[:RANK])
        out = sentinel(sum(counts), block.dtype)
        out[lo:lo + block.size] = block
        assert tc.allgather(torus.IN_PLACE, out, recvcounts=recvcounts, algorithm=algo) is out
    else:
        sendbuf = block.copy()
        sendbuf.flags.writeable = False  # a read-only sendbuf is fine
        recvbuf = sentinel(sum(counts), block.dtype) if mode == "out" else None
        out = tc.allgather(sendbuf, recvbuf, recvcounts=recvcounts, algorithm=algo)
        assert recvbuf is None or out is recvbuf
        unchanged(block, sendbuf, what)
    assert out.dtype == block.dtype and out.size == sum(counts)
    got = out.view(np.uint8)
    if not np.array_equal(got, want):
        i = int(np.argmax(got != want)) // block.itemsize
        raise AssertionError(f"{what} on rank {RANK}: element {i} differs from MPI_Allgatherv's")
    assert_same_on_all_ranks(out, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_every_dtype(case, dtype, rng):
    tc, algo = torus_comm(case)
    counts = PATTERNS["zeros"]
    for mode in ("in", "out"):
        check(tc, algo, counts, random_bits(rng, dtype, counts[RANK]), mode)


@pytest.mark.parametrize("mode", ["in", "out", "alloc"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("case", CASES)
def test_recvcounts(case, pattern, mode, rng):
    tc, algo = torus_comm(case)
    counts = PATTERNS[pattern]
    check(tc, algo, counts, random_bits(rng, np.float32, counts[RANK]), mode,
          block_form=pattern in BLOCK_FORM)


@pytest.mark.parametrize("pattern", ["block1", "uneven", "zeros"])
@pytest.mark.parametrize("case", CASES)
def test_tiny_segments(case, pattern, rng):
    tc, algo = torus_comm(case, segment_bytes=64)
    counts = [37 * c for c in PATTERNS[pattern]]
    check(tc, algo, counts, random_bits(rng, np.float64, counts[RANK]), "out")
