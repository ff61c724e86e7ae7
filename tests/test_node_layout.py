"""The grid follows the nodes: ``node_dims`` (TorusComm's default grid) and ``Topology.columns_first`` against
brute force, and the 2D-torus all-reduce on nodes placed in blocks and round robin, every rank's plan run by
the real Executor over the in-process transport of test_sim_replay_matches_executor: the result against
numpy, and the bytes that cross nodes against the closed form ``2(C-1)/C * M`` per node (what the
hierarchical all-reduce moves; a grid whose first phase crossed nodes would move ``L`` times that). The ring
(all three collectives) on the same layouts: node by node, one rank per node sends across (the rank order, on
round-robin nodes, crossed at every hop), and on nodes in blocks exactly the rank-order plan of before."""
from __future__ import annotations

import numpy as np
import pytest

from tests.test_sim_replay_matches_executor import _Recording, _Transport, run_ranks
from torus.partition import chunks, displacements
from torus.schedules import ring, torus2d
from torus.schedules.build import build
from torus.topology import Topology, default_dims, node_dims


def _blocks(C, L):
    return tuple(r // L for r in range(C * L))


def _round_robin(C, L):
    return tuple(r % C for r in range(C * L))


@pytest.mark.parametrize("C,L", [(2, 2), (2, 3), (3, 2), (4, 2), (2, 4), (3, 3)])
def test_node_dims_put_one_axis_along_the_nodes(C, L):
    for node_of, inside in ((_blocks(C, L), "row"), (_round_robin(C, L), "col")):
        X, Y = node_dims(node_of)
        assert X * Y == C * L
        t = Topology(0, C * L, (X, Y), node_of)
        lines = [t.members(inside, r) for r in range(C * L)]
        assert all(len({node_of[q] for q in line}) == 1 for line in lines)  # that axis lies inside nodes
        assert len(lines[0]) == L  # and is a whole node
        assert t.columns_first == (inside == "col")


@pytest.mark.parametrize("node_of", [(0,) * 4, (0, 1, 2, 3), (0, 0, 1), (0, 0, 0, 1), (0, 1, 1, 0)])
def test_node_dims_none_without_an_obvious_grid(node_of):
    assert node_dims(node_of) is None


@pytest.mark.parametrize("size", [4, 6, 8, 12])
def test_columns_first_brute_force(size):
    rng = np.random.default_rng(size)
    for _ in range(20):
        node_of = tuple(int(n) for n in rng.integers(0, 3, size))
        node_of = tuple({n: i for i, n in enumerate(dict.fromkeys(node_of))}[n] for n in node_of)
        for X in (d for d in range(1, size + 1) if size % d == 0):
            t = Topology(0, size, (X, size // X), node_of)
            rows_in = all(len({node_of[q] for q in range(y * X, y * X + X)}) == 1 for y in range(size // X))
            cols_in = all(len({node_of[q] for q in range(x, size, X)}) == 1 for x in range(X))
            assert t.columns_first == (max(node_of) > 0 and cols_in and not rows_in)


def _run_allreduce(dims, node_of, count, builder=None):
    """Every rank's torus2d all-reduce (``build``'s, or ``builder(topology, count)``'s plan) through the
    Executor; returns (buffers, inputs, bytes sent across nodes per node)."""
    builder = builder or (lambda topo, n: build("allreduce", "torus2d", topo, n))
    size = len(node_of)
    t = _Transport()
    data = [np.random.default_rng(r).standard_normal(count) for r in range(size)]
    bufs, runs = [d.copy() for d in data], []
    for r in range(size):
        topo = Topology(r, size, dims, node_of)
        ex = _Recording({n: t.comm(topo, n) for n in ("world", "row", "col", "local", "cross")}, r, 64, None)
        ex.c_loop, ex.log = False, []
        runs.append((ex, ex.compile(builder(topo, count), 8)))

    run_ranks(size, lambda r: runs[r][0].run("allreduce", runs[r][1], bufs[r], "sum", 1.0))
    crossing = [0] * (max(node_of) + 1)
    for r, events in t.log.items():
        for kind, _, peer, nbytes, _ in events:
            if kind == "send" and node_of[peer] != node_of[r]:
                crossing[node_of[r]] += nbytes
    return bufs, data, crossing


@pytest.mark.parametrize("C,L", [(2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("placement", [_blocks, _round_robin])
def test_torus2d_on_the_node_grid_moves_what_hierarchical_moves(C, L, placement):
    node_of = placement(C, L)
    count = 6 * C * L * 7 + 5  # uneven chunks
    bufs, data, crossing = _run_allreduce(node_dims(node_of), node_of, count)
    want = np.sum(data, axis=0)
    for r, b in enumerate(bufs):
        np.testing.assert_allclose(b, want, rtol=1e-12, err_msg=f"rank {r}")
    M = count * 8
    # each of the L ranks all-reduces about M/L over the C nodes: 2(C-1)/C * M/L each, up to uneven chunks
    for n, sent in enumerate(crossing):
        assert abs(sent - 2 * (C - 1) / C * M) <= 2 * (C - 1) * L * 8, (n, sent)


def test_a_square_grid_across_round_robin_nodes_moved_more():
    # the placement the issue measured (hydra -hosts h1,h2 -n 4): rows cross nodes; the columns-first order
    # keeps the result and halves the bytes across nodes against running the rows first
    node_of, count = _round_robin(2, 2), 4000
    bufs, data, crossing = _run_allreduce(default_dims(4), node_of, count)
    assert crossing == [count * 8] * 2
    rows_first = lambda topo, n: torus2d.allreduce(*topo.coords, *topo.dims, n)  # noqa: E731
    bufs_rf, _, crossing_rf = _run_allreduce(default_dims(4), node_of, count, rows_first)
    assert crossing_rf == [2 * count * 8] * 2
    for b, b_rf in zip(bufs, bufs_rf):
        np.testing.assert_allclose(b, np.sum(data, axis=0), rtol=1e-12)
        np.testing.assert_allclose(b_rf, b, rtol=1e-12)


def _run_ring(collective, node_of, data, builder=None):
    """Every rank's ring plan for ``collective`` (``build``'s, or ``builder(topology, counts)``'s) on its copy
    of ``data[r]``, through the Executor; returns (buffers, bytes sent across nodes per node)."""
    size, count = len(node_of), data.shape[1]
    counts = count if collective == "allreduce" else tuple(chunks(count, size)[0])
    builder = builder or (lambda topo, n: build(collective, "ring", topo, n))
    t = _Transport()
    bufs, runs = [d.copy() for d in data], []
    for r in range(size):
        topo = Topology(r, size, (1, size), node_of)
        ex = _Recording({n: t.comm(topo, n) for n in ("world", "row", "col", "local", "cross")}, r, 64, None)
        ex.c_loop, ex.log = False, []
        runs.append((ex, ex.compile(builder(topo, counts), 8)))
    run_ranks(size, lambda r: runs[r][0].run(collective, runs[r][1], bufs[r], "sum", 1.0))
    crossing = [0] * (max(node_of) + 1)
    for r, events in t.log.items():
        for kind, _, peer, nbytes, _ in events:
            if kind == "send" and node_of[peer] != node_of[r]:
                crossing[node_of[r]] += nbytes
    return bufs, crossing


@pytest.mark.parametrize("C,L", [(2, 2), (2, 3), (3, 2), (4, 2)])
def test_ring_allreduce_on_round_robin_nodes_crosses_once_per_node(C, L):
    node_of, N = _round_robin(C, L), C * L
    count = 6 * N * 7 + 5  # uneven chunks
    data = np.random.default_rng(N).standard_normal((N, count))
    bufs, crossing = _run_ring("allreduce", node_of, data)
    for r, b in enumerate(bufs):
        np.testing.assert_allclose(b, np.sum(data, axis=0), rtol=1e-12, err_msg=f"rank {r}")
        assert b.tobytes() == bufs[0].tobytes(), f"rank {r} differs from rank 0"
    # one rank per node sends across, 2(N-1) chunks of about M/N; the rank order sent L times that
    M, slack = count * 8, 2 * (N - 1) * 8
    assert all(abs(sent - 2 * (N - 1) / N * M) <= slack for sent in crossing), crossing
    rank_order = lambda topo, n: ring.allreduce("world", topo.rank, topo.size, n)  # noqa: E731
    bufs_ro, crossing_ro = _run_ring("allreduce", node_of, data, rank_order)
    assert all(abs(sent - L * 2 * (N - 1) / N * M) <= L * slack for sent in crossing_ro), crossing_ro
    np.testing.assert_allclose(bufs_ro[0], bufs[0], rtol=1e-12)


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather"])
@pytest.mark.parametrize("C,L", [(2, 2), (3, 2), (2, 3)])
def test_ring_blocks_land_on_their_ranks_on_round_robin_nodes(collective, C, L):
    # integer-valued floats: every order of summation is exact, so the oracle is numpy's sum to the bit
    node_of, N = _round_robin(C, L), C * L
    count = 5 * N + 3
    counts, displs = chunks(count, N)
    data = np.random.default_rng(N).integers(-50, 50, (N, count)).astype(np.float64)
    bufs, crossing = _run_ring(collective, node_of, data)
    total = np.sum(data, axis=0)
    for r, b in enumerate(bufs):
        if collective == "reduce_scatter":
            mine = slice(displs[r], displs[r] + counts[r])
            np.testing.assert_array_equal(b[mine], total[mine], err_msg=f"rank {r}")
        else:
            want = np.concatenate([data[q][displs[q]:displs[q] + counts[q]] for q in range(N)])
            np.testing.assert_array_equal(b, want, err_msg=f"rank {r}")
    assert all(abs(sent - (N - 1) / N * count * 8) <= (N - 1) * 8 for sent in crossing), crossing


@pytest.mark.parametrize("C,L", [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_ring_on_nodes_in_blocks_is_the_rank_order_plan(C, L, collective):
    N, count = C * L, 4 * C * L + 3
    counts = count if collective == "allreduce" else tuple(chunks(count, N)[0])
    for r in range(N):
        topo = Topology(r, N, (1, N), _blocks(C, L))
        if collective == "allreduce":
            before = ring.allreduce("world", r, N, count)
        else:
            before = getattr(ring, collective)("world", r, N, counts, displacements(counts))
        assert build(collective, "ring", topo, counts) == before
