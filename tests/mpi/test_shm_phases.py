"""The node-level phases of hierarchical and torus2d over shared memory across (emulated) nodes
(torus/schedules/phases.py): that they run and can be turned off, columns inside nodes (nodes dealt out round
robin, as hydra's ``-hosts h1,h2`` places ranks), back-to-back calls of changing sizes without a barrier, a
rank that never comes (TimeoutError naming it), and the argument check (a rank with another count, or with
the phases off). The shared cases (oracle.CASES: hierarchical-rpn*, torus2d-*rpn*) check every dtype, op,
count and recvcounts pattern against MPI; hierarchical-rpn2-p2p runs them with the phases off.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import torus
from oracle import SIZE, WORLD, assert_matches, assert_same_on_all_ranks, expected, make, one_node, sentinel
from torus import options
from torus.topology import Topology

RANK = WORLD.Get_rank()
pytestmark = pytest.mark.skipif(SIZE < 3, reason="several nodes, one of several ranks, need 3 ranks")


def _reference_blocks(x, counts):
    """(reduce-scatter reference of ``x`` summed over ranks, this rank's block), exact."""
    ref, _ = expected(x, "sum")
    lo = sum(counts[:RANK])
    return ref[lo:lo + counts[RANK]]


def _gathered(block, counts):
    out = np.empty(sum(counts), block.dtype)
    WORLD.Allgatherv(block, [out, (counts, np.cumsum([0, *counts[:-1]]))])
    return out


@pytest.mark.parametrize("setting", ["1", "0", None])
def test_the_phases_run_over_shared_memory_unless_turned_off(monkeypatch, setting, rng):
    """Nodes of 2 (the last one smaller at odd sizes): by default (and with ``TORUS_SHM_PHASES=1``)
    hierarchical opens the node's window on every rank of a node of two, where every node's ranks share
    memory; ``=0`` keeps every phase on MPI. Results right each way."""
    if setting is None:
        monkeypatch.delenv("TORUS_SHM_PHASES", raising=False)
    else:
        monkeypatch.setenv("TORUS_SHM_PHASES", setting)
    tc = torus.TorusComm(ranks_per_node=2, timeout=60)
    x = make(rng, np.int64, "sum", 1001)
    out = tc.allreduce(x, algorithm="hierarchical")
    assert_matches(out, *expected(x, "sum"), "allreduce(hierarchical)")
    assert_same_on_all_ranks(out, "allreduce(hierarchical)")
    node = tc.local_comm.Split_type(MPI.COMM_TYPE_SHARED)  # across hosts an emulated node may span two
    shared = WORLD.allreduce(node.Get_size() == tc.local_size, op=MPI.LAND)
    node.Free()
    on = setting != "0" and shared
    assert tc.shm_phases == on, (setting, shared)
    opened = tc.shm_phases and tc._node_shm["local"].is_open
    assert opened == (on and tc.local_size > 1), (setting, tc.local_size)
    tc.Free()


def _round_robin(nodes: int):
    """``options.discover`` with rank ``r`` on node ``r % nodes`` (columns of a ``(nodes, size/nodes)``
    grid are the nodes), as hydra deals ranks out over ``-hosts h1,h2``."""
    def discover(comm, o):
        return Topology(comm.Get_rank(), comm.Get_size(), (nodes, comm.Get_size() // nodes),
                        tuple(r % nodes for r in range(comm.Get_size())))
    return discover


@pytest.mark.skipif(SIZE % 2 or not one_node(), reason="round-robin nodes of equal size need an even rank "
                    "count, and all ranks on one machine (the nodes are made up)")
@pytest.mark.parametrize("mode", ["in", "out"])
def test_columns_inside_nodes(monkeypatch, mode, rng):
    """Two nodes dealt out round robin: the torus2d grid's columns are the nodes, so its column phases run
    over shared memory (all-reduce columns first); hierarchical's local communicator is every other rank."""
    monkeypatch.setattr(options, "discover", _round_robin(2))
    tc = torus.TorusComm(timeout=60, link_gbits=10.0, shm_phases=True)
    assert tc.topology.node_axis == "col" and tc.topology.columns_first
    counts = [2 * r + 3 if r % 3 else 0 for r in range(SIZE)]
    for algo in ("torus2d", "hierarchical"):
        for n in (0, 5, 1003, 100_003):
            x = make(rng, np.float32, "max", n)
            what = f"allreduce({algo}, round-robin nodes, {n}, {mode})"
            out = x.copy()
            if mode == "in":
                tc.allreduce(torus.IN_PLACE, out, op="max", algorithm=algo)
            else:
                out = tc.allreduce(x, sentinel(n, x.dtype), op="max", algorithm=algo)
            assert_matches(out, *expected(x, "max"), what)
            assert_same_on_all_ranks(out, what)
        x = make(rng, np.int32, "sum", sum(counts))
        if mode == "in":
            got = tc.reduce_scatter(torus.IN_PLACE, x.copy(), recvcounts=counts, algorithm=algo)
        else:
            got = tc.reduce_scatter(x, recvcounts=counts, algorithm=algo)
        assert np.array_equal(got, _reference_blocks(x, counts)), f"reduce_scatter({algo}, round-robin)"
        block = make(rng, np.float64, "sum", counts[RANK])
        got = tc.allgather(block, recvcounts=counts, algorithm=algo)
        assert got.tobytes() == _gathered(block, counts).tobytes(), f"allgather({algo}, round-robin)"
    assert tc._node_shm["col"].is_open and tc._node_shm["local"].is_open
    tc.Free()


def test_back_to_back_calls_of_changing_sizes(rng):
    """30 calls over nodes of 2, algorithms, collectives and sizes changing every call (0 and 1 element among
    them), no synchronisation between them; every result is checked only after all have run, so a stale
    segment or flag of an earlier call on a node's window would show."""
    tc = torus.TorusComm(ranks_per_node=2, timeout=60, segment_bytes=512, shm_phases=True)
    sizes = [0, 1, 300, 5, 4096, 1, 77, 10_001, 3]
    calls = []
    for i in range(30):
        n, algo = sizes[i % len(sizes)] + i, ("hierarchical", "torus2d")[i % 2]
        kind = ("allreduce", "reduce_scatter", "allgather")[i % 3]
        counts = [(n + r) % 11 for r in range(SIZE)]
        if kind == "allreduce":
            x = make(rng, np.float64, "sum", n)
            calls.append((kind, algo, x, counts, tc.allreduce(x, algorithm=algo)))
        elif kind == "reduce_scatter":
            x = make(rng, np.int64, "sum", sum(counts))
            calls.append((kind, algo, x, counts, tc.reduce_scatter(x, recvcounts=counts, algorithm=algo)))
        else:
            x = make(rng, np.float32, "max", counts[RANK])
            calls.append((kind, algo, x, counts, tc.allgather(x, recvcounts=counts, algorithm=algo)))
    for i, (kind, algo, x, counts, out) in enumerate(calls):
        what = f"call {i}: {kind}({algo}) of {x.size} elements"
        if kind == "allreduce":
            assert_matches(out, *expected(x, "sum"), what)
        elif kind == "reduce_scatter":
            assert np.array_equal(out, _reference_blocks(x, counts)), what
        else:
            assert out.tobytes() == _gathered(x, counts).tobytes(), what
    assert tc._node_shm["local"].is_open == (tc.local_size > 1)
    tc.Free()


def test_a_rank_that_never_comes_is_a_timeout_naming_it():
    """Rank 1 (on node 0 with rank 0) skips a hierarchical all-reduce, the check off: rank 0 waits for it
    in the node's shared-memory all-reduce and names it; every other rank raises TimeoutError too (a leader
    in the ring across nodes, the others waiting for their leader's broadcast), none hangs."""
    tc = torus.TorusComm(ranks_per_node=2, check=False, timeout=2, shm_phases=True)
    x = np.ones(10, np.float64)
    assert np.array_equal(tc.allreduce(x, algorithm="hierarchical"), np.full(10, float(SIZE)))  # windows set up
    if RANK != 1:
        with pytest.raises(torus.TimeoutError) as info:
            tc.allreduce(x, algorithm="hierarchical")
        msg = str(info.value)
        assert msg.startswith(f"allreduce(hierarchical) on rank {RANK}: no progress for 2 s at step "), msg
        assert "abort the job" in msg, msg
        if RANK == 0:
            assert "step 1/1 waiting on rank 1 of the shared-memory window to copy in its input" in msg, msg
    WORLD.Barrier()


def test_the_argument_check_names_the_odd_rank(rng):
    """Check on: a rank with another count, or with the phases off, is a MismatchError on every rank before
    any data moves (the all-gather of signatures runs before the first shared-memory phase)."""
    last = SIZE - 1
    tc = torus.TorusComm(ranks_per_node=2, timeout=60, shm_phases=True)
    n = 20 if RANK == last else 24
    with pytest.raises(torus.MismatchError, match=r"allreduce\(hierarchical\) on rank [0-9]+: ranks disagree "
                                                  rf"on count \(ranks 0-{last - 1} have 24; rank {last} has 20\)"):
        tc.allreduce(np.ones(n, np.float32), algorithm="hierarchical")
    odd = torus.TorusComm(ranks_per_node=2, timeout=60, shm_phases=RANK != last)
    with pytest.raises(torus.MismatchError, match=r"ranks disagree on shm phases \(ranks 0-[0-9]+ have 1; "
                                                  rf"rank {last} has 0\)"):
        odd.allreduce(np.ones(24, np.float32), algorithm="hierarchical")
    x = make(rng, np.int32, "sum", 24)  # both still work afterwards (the check moved no data)
    assert_matches(tc.allreduce(x, algorithm="hierarchical"), *expected(x, "sum"), "allreduce after a mismatch")
    tc.Free()
    odd.Free()
