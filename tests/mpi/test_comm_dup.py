"""``TorusComm.Dup``: the same ranks, grid, nodes and options as the original, and collectives of its own that run
beside the original's from another thread (what ``TorusStrategy`` relies on to keep SyncBN's all-reduces off the
gradient buckets' communicator). Oracle: MPI's Allreduce of every rank's input."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from mpi4py import MPI

import torus
from oracle import SIZE, WORLD


def test_dup_keeps_the_layout_and_options():
    tc = torus.TorusComm(segment_bytes=1 << 16, check=True, timeout=30, ranks_per_node=1 if SIZE > 1 else None)
    dup = tc.Dup()
    try:
        assert (dup.rank, dup.size, dup.dims, dup.coords) == (tc.rank, tc.size, tc.dims, tc.coords)
        assert (dup.node, dup.nodes, dup.local_rank, dup.local_size) == (tc.node, tc.nodes, tc.local_rank,
                                                                         tc.local_size)
        assert (dup.segment_bytes, dup.check) == (tc.segment_bytes, tc.check)
        assert MPI.Comm.Compare(dup.comm, tc.comm) == MPI.CONGRUENT
    finally:
        dup.Free()
        tc.Free()


@pytest.mark.skipif(MPI.Query_thread() != MPI.THREAD_MULTIPLE, reason="needs MPI_THREAD_MULTIPLE")
@pytest.mark.parametrize("algorithm", ["ring", "shm", "auto"])
def test_dup_runs_beside_the_original(algorithm):
    tc = torus.TorusComm()
    dup = tc.Dup()
    rng = np.random.default_rng(100 + WORLD.Get_rank())
    # a different count on each, so that a message of one communicator landing on the other cannot go unseen
    a, b = rng.standard_normal(100_003), rng.integers(-50, 50, 7_777).astype(np.int64)
    want_a, want_b = np.empty_like(a), np.empty_like(b)
    WORLD.Allreduce(a, want_a)
    WORLD.Allreduce(b, want_b)
    got: dict = {}
    errors: list = []

    def loop(name, comm, buf):
        try:
            for _ in range(20):
                out = np.empty_like(buf)
                comm.allreduce(buf, out, algorithm=algorithm)
            got[name] = out
        except BaseException as exc:  # reported by the main thread, never lost in this one
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=("a", tc, a)), threading.Thread(target=loop, args=("b", dup, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        assert not any(t.is_alive() for t in threads), "a collective hung"
        assert not errors, errors
        np.testing.assert_allclose(got["a"], want_a, rtol=1e-12, atol=1e-12 * SIZE)
        np.testing.assert_array_equal(got["b"], want_b)
    finally:
        dup.Free()
        tc.Free()
