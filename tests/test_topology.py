"""torus.topology against brute force: coordinates, nodes (equal and unequal), communicator members, the
split keys TorusComm uses, node-grid regularity and the world ring's node-major order."""
from __future__ import annotations

import numpy as np
import pytest

from torus.topology import Topology, default_dims, node_indices


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6, 8, 12])
def test_default_dims_are_the_squarest_grid(size):
    X, Y = default_dims(size)
    assert X * Y == size and X <= Y
    assert all(not (X < d <= Y and size % d == 0 and d <= size // d) for d in range(1, size + 1))


@pytest.mark.parametrize("size, rpn", [(1, 1), (4, 2), (6, 4), (6, 2), (5, 2), (8, 8), (12, 3)])
def test_emulated_nodes_and_members(size, rpn):
    X = default_dims(size)[0]
    for rank in range(size):
        t = Topology.emulated(rank, size, (X, size // X), rpn)
        assert t.coords == (rank % X, rank // X)
        assert t.node == rank // rpn and t.nodes == -(-size // rpn)
        mine = [r for r in range(size) if r // rpn == rank // rpn]
        assert t.local_rank == mine.index(rank) and t.local_size == len(mine)
        assert t.max_local == min(rpn, size)
        assert t.members("row") == tuple(r for r in range(size) if r // X == rank // X)
        assert t.members("col") == tuple(r for r in range(size) if r % X == rank % X)
        assert t.members("local") == tuple(mine)
        assert t.members("cross") == tuple(r for r in range(size) if r % rpn == rank % rpn)
        for name in ("row", "col", "local", "cross"):
            color, key = t.split(name)
            same = [r for r in range(size) if Topology.emulated(r, size, t.dims, rpn).split(name)[0] == color]
            assert tuple(same) == t.members(name) and key == rank
            assert [t.world_rank(name, i) for i in range(len(same))] == same
        assert t.node_grid == (size % rpn == 0)


def test_interleaved_nodes_are_not_a_node_grid():
    nodes = node_indices(["b", "a", "b", "a"])  # ranks 0, 2 on one host, 1, 3 on the other
    assert nodes == (0, 1, 0, 1)
    t = Topology(2, 4, (2, 2), nodes)
    assert (t.node, t.local_rank, t.local_size, t.nodes) == (0, 1, 2, 2)
    assert t.members("local") == (0, 2) and t.members("cross") == (2, 3)
    assert not t.node_grid


@pytest.mark.parametrize("size", [1, 2, 3, 4, 6, 8, 12])
def test_ring_order_is_node_major_and_crosses_each_node_once(size):
    rng = np.random.default_rng(size)
    layouts = [tuple(r // 2 for r in range(size)), tuple(r % 2 for r in range(size)), (0,) * size]
    layouts += [node_indices(rng.integers(0, 3, size).tolist()) for _ in range(20)]
    for node_of in layouts:
        orders = {Topology(r, size, (1, size), node_of).ring_order for r in range(size)}
        assert len(orders) == 1  # every rank runs the same ring
        order = orders.pop()
        assert sorted(order) == list(range(size))
        # brute force: node 0's ranks in rank order, then node 1's, ...
        assert list(order) == [r for n in range(max(node_of) + 1) for r in range(size) if node_of[r] == n]
        hops = sum(node_of[order[i]] != node_of[order[(i + 1) % size]] for i in range(size))
        nodes = max(node_of) + 1
        assert hops == (nodes if nodes > 1 else 0)
        for r in range(size):
            assert order[Topology(r, size, (1, size), node_of).ring_position] == r


@pytest.mark.parametrize("size, rpn", [(4, 2), (6, 4), (6, 3), (5, 2), (8, 1)])
def test_ring_order_on_nodes_of_consecutive_ranks_is_the_rank_order(size, rpn):
    assert Topology.emulated(0, size, (1, size), rpn).ring_order == tuple(range(size))


def test_bad_dims_raise():
    with pytest.raises(ValueError, match="do not multiply"):
        Topology(0, 6, (4, 2), (0,) * 6)
