"""Counts beyond the 32-bit ``int`` of the classic MPI interface (the issue: "counts above 2**31-1 elements
per MPI call are split transparently").

The schedules send segments of at most ``segment_bytes`` (< 2**31, checked by TorusComm) as MPI.BYTE, so no
message of theirs can overflow; ``native.allreduce`` cuts the buffer into pieces of ``_MAX_PIECE`` (2**30)
elements. Always run: the piece logic with the piece size patched down to a few elements, the MPI calls
recorded through a proxy communicator, and the segment bound of every schedule. Opt-in
(``TORUS_LARGE_COUNT=1``, 2 ranks, up to 6 GiB a rank, about 5 minutes a test): float16 buffers of
2**31 + 5 elements (4 GiB) through the ring and the 2D torus (all-reduce) and the ring and MPI (all-gather).
"""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import torus
from oracle import BF16, SIZE, WORLD, assert_matches, assert_same_on_all_ranks, expected, make, torus_comm
from torus.runtime import native


class _Recording:
    """Forwards ``Allreduce`` to a real communicator and records each call's element count."""

    def __init__(self, comm):
        self.comm, self.counts = comm, []

    def Allreduce(self, sendbuf, recvbuf, op):  # noqa: N802 (mpi4py's name)
        self.counts.append(len(recvbuf[0]) if isinstance(recvbuf, list) else recvbuf.size)
        return self.comm.Allreduce(sendbuf, recvbuf, op=op)


@pytest.mark.parametrize("piece", [1, 5, 7])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.int64], ids=str)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_native_allreduce_splits_into_pieces(monkeypatch, piece, dtype, op, rng):
    if op == "avg" and np.dtype(dtype).kind == "i":
        pytest.skip("avg on integers raises")
    monkeypatch.setattr(native, "_MAX_PIECE", piece)
    for count in sorted({0, 1, piece - 1, piece, piece + 1, 3 * piece + 2, 37}):
        x = make(rng, dtype, op, count)
        ref, bound = expected(x, op)
        buf = x.copy()
        proxy = _Recording(WORLD)
        native.allreduce(proxy, buf, op, 1.0 / SIZE if op == "avg" else 1.0)
        what = f"native allreduce in pieces of {piece}, {op}, {np.dtype(dtype)}, count {count}"
        assert proxy.counts == [min(piece, count - lo) for lo in range(0, count, piece)], what
        assert_matches(buf, ref, bound, what)
        assert_same_on_all_ranks(buf, what)


@pytest.mark.parametrize("case", ["ring", "torus2d-1xN", "torus2d-2x2", "hierarchical-rpn2"])
def test_no_message_reaches_the_int_limit(case):
    """With the largest segment TorusComm accepts (2**31 - 1 bytes), every message of the schedules for a
    2**33 + 5 element float32 buffer (32 GiB, more than 2**31 elements per chunk) stays under 2**31 bytes,
    and the messages of each step cover whole chunks (nothing is dropped by the cut)."""
    tc, algo = torus_comm(case, segment_bytes=2**31 - 1)
    count = 2**33 + 5
    plan = tc._executor.plan("allreduce", algo, tc.topology, count, 4)
    sizes = [(m.hi - m.lo) * 4 for st in plan.steps for m in st.sends + st.recvs]
    if SIZE > 1:
        assert max(sizes) <= 2**31 - 1 and max(sizes) > 2**30
        total = sum((m.hi - m.lo) for st in plan.steps for m in st.sends)
        assert total >= count * (SIZE - 1) // SIZE  # at least the reduce-scatter's share leaves each rank


@pytest.mark.parametrize("case", ["ring", "torus2d-2x2", "torus2d-1xN"])
def test_free_buffers(case, rng):
    """The kept buffers have the sizes the TorusComm docstring states; free_buffers drops them; the next
    call is still right."""
    if case == "torus2d-2x2" and SIZE != 4:
        pytest.skip("a 2x2 grid needs 4 ranks")
    tc = torus.TorusComm(dims=(2, 2) if case == "torus2d-2x2" else (1, SIZE) if case == "torus2d-1xN" else None,
                         segment_bytes=1 << 30, timeout=120)
    algo = case.split("-")[0]
    count = 60 * 211  # divisible by every size up to 6
    x = make(rng, np.float32, "sum", count)
    ref, _ = expected(x, "sum")
    assert_matches(tc.allreduce(x, algorithm=algo), ref, np.zeros(count), "allreduce")
    X = tc.dims[0]
    chunk = count // SIZE if algo == "ring" or SIZE == 1 else count // (X if X > 1 else SIZE)
    assert tc._executor._buffers["scratch"].nbytes == 4 * chunk if SIZE > 1 else "scratch" not in tc._executor._buffers
    blocks = make(rng, np.float32, "sum", count)
    tc.reduce_scatter(blocks, algorithm=algo)
    assert tc._executor._buffers["work"].nbytes == 4 * count
    tc.free_buffers()
    assert not tc._executor._buffers
    assert_matches(tc.allreduce(x, algorithm=algo), ref, np.zeros(count), "allreduce after free_buffers")


LARGE = 2**31 + 5  # float16 elements: 4 GiB, over the int limit in elements, not just in bytes


def _pattern(lo: int, hi: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s elements ``[lo, hi)``: small integers (exact in float16 sums of 2 ranks) that differ
    by index and rank, computed in pieces so the reference never needs a second 4 GiB buffer."""
    i = np.arange(lo, hi, dtype=np.int64)
    return ((i * (rank + 3) + (i >> 17) + rank) % 7 - 3).astype(np.float16)


def _check_pieces(buf: np.ndarray, lo: int, hi: int, what: str, step: int = 1 << 25, scale: float = 1.0) -> None:
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        want = (sum(_pattern(a, b, r).astype(np.float32) for r in range(SIZE)) * scale).astype(np.float16)
        got = buf[a - lo:b - lo]
        bad = np.nonzero(got != want)[0]
        assert bad.size == 0, (f"{what} on rank {WORLD.rank}: {bad.size} wrong in [{a}, {b}), first at "
                               f"{a + int(bad[0])}: {got[bad[0]]} != {want[bad[0]]}")


def _fill(buf: np.ndarray, lo: int, rank: int, step: int = 1 << 25) -> None:
    for a in range(0, buf.size, step):
        buf[a:a + step] = _pattern(lo + a, lo + min(buf.size, a + step), rank)


large = pytest.mark.skipif(os.environ.get("TORUS_LARGE_COUNT") != "1" or SIZE != 2,
                           reason="opt-in: TORUS_LARGE_COUNT=1 under mpiexec -n 2 (4 GiB buffers)")


@pytest.fixture
def fresh_comm():
    """A TorusComm of its own, dropped afterwards: its grow-only scratch (here up to 2 GiB) goes with it."""
    tc = torus.TorusComm(timeout=600)
    yield tc
    del tc
    gc.collect()
    WORLD.Barrier()


@large
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("algo", ["ring", "torus2d"])
def test_four_gib_allreduce(fresh_comm, algo):
    """In place, avg (the final scaling runs too); peak per rank: the buffer and one chunk of scratch, 6 GiB.
    ``native`` is left out: MPICH's own temporaries took it past 11 GiB a rank, over this machine's memory
    with two ranks (its piece split is tested above with small pieces)."""
    buf = np.empty(LARGE, np.float16)
    _fill(buf, 0, fresh_comm.rank)
    fresh_comm.allreduce(torus.IN_PLACE, buf, op="avg", algorithm=algo)
    _check_pieces(buf, 0, LARGE, f"allreduce({algo}, avg) of {LARGE} float16", scale=0.5)
    assert_same_on_all_ranks(buf[-(1 << 20):], f"allreduce({algo}) tail")


@large
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("algo", ["ring", "native"])
def test_four_gib_allgather(fresh_comm, algo):
    """Uneven blocks (rank 0's the larger), out of place into a NaN-filled recvbuf: native's byte
    displacements pass 2**31, so mpi4py must use MPI-4's large-count call."""
    counts = [LARGE - LARGE // 2, LARGE // 2]
    lo = 0 if fresh_comm.rank == 0 else counts[0]
    mine = np.empty(counts[fresh_comm.rank], np.float16)
    _fill(mine, lo, fresh_comm.rank)
    out = np.full(LARGE, np.nan, np.float16)
    fresh_comm.allgather(mine, out, recvcounts=counts, algorithm=algo)
    for r, a in ((0, 0), (1, counts[0])):
        for b in range(a, a + counts[r], 1 << 25):
            e = min(a + counts[r], b + (1 << 25))
            assert np.array_equal(out[b:e], _pattern(b, e, r)), f"allgather({algo}): block {r} at {b}"
