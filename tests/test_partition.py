"""partition.py's counts, displacements and segments, and a single-process replay of every rank's plan.

The replay runs all ranks' plans (ring, torus2d, hierarchical) in lockstep against a model of the
communicators TorusComm builds (row-major grid, nodes of ``ranks_per_node`` consecutive ranks). Each element
carries a vector of how many times each rank's input went into it, so the checks are exact: every send has a
matching receive of the same count on the peer at the same step index (the executor tags messages with the
step index), no step receives into a region it sends from, every result element holds each rank's input
exactly once, and the avg scale lands exactly once.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from torus.partition import chunks, displacements, segments
from torus.schedules import hierarchical, ring, swing, torus2d


# ---------------------------------------------------------------- chunks, displacements, segments
@pytest.mark.parametrize("count", [0, 1, 2, 5, 6, 7, 12, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 6, 8])
def test_chunks_cover_count_evenly(count, parts):
    counts, displs = chunks(count, parts)
    assert len(counts) == len(displs) == parts
    assert sum(counts) == count
    assert max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)  # the remainder goes to the first chunks
    assert displs == [sum(counts[:i]) for i in range(parts)]


def test_chunks_count_below_parts_leaves_trailing_chunks_empty():
    assert chunks(2, 4) == ([1, 1, 0, 0], [0, 1, 2, 2])
    assert chunks(0, 3) == ([0, 0, 0], [0, 0, 0])


def test_displacements_with_zero_counts():
    assert displacements([]) == []
    assert displacements([0, 3, 0, 0, 2]) == [0, 0, 3, 3, 3]


@pytest.mark.parametrize("offset,count,seg", [(0, 0, 4), (5, 0, 1), (0, 1, 4), (3, 10, 4), (3, 12, 4),
                                              (7, 10, 1), (0, 10, 100)])
def test_segments_tile_the_region(offset, count, seg):
    pieces = list(segments(offset, count, seg))
    assert len(pieces) == math.ceil(count / seg)
    assert all(1 <= n <= seg for _, n in pieces)
    covered = [i for o, n in pieces for i in range(o, o + n)]
    assert covered == list(range(offset, offset + count))


# ---------------------------------------------------------------- the communicator model
def members(comm: str, rank: int, size: int, X: int, rpn: int) -> list[int]:
    """World ranks of ``rank``'s communicator ``comm``, in the order of their rank within it."""
    if comm == "world":
        return list(range(size))
    if comm == "row":
        return [rank // X * X + i for i in range(X)]
    if comm == "col":
        return list(range(rank % X, size, X))
    if comm == "local":
        return [r for r in range(size) if r // rpn == rank // rpn]
    assert comm == "cross", comm
    return [r for r in range(size) if r % rpn == rank % rpn]


class Layout:
    """Grid and node coordinates of every rank, as TorusComm derives them."""

    def __init__(self, size: int, X: int = None, rpn: int = None):
        self.size, self.X = size, X or size
        self.Y = size // self.X
        self.rpn = min(rpn or size, size)
        self.nodes = math.ceil(size / self.rpn)

    def grid(self, r):
        return r % self.X, r // self.X

    def node(self, r):
        """(local_rank, L, node, C)."""
        return r % self.rpn, len(members("local", r, self.size, self.X, self.rpn)), r // self.rpn, self.nodes


def replay(layout: Layout, plans: list, state: list[np.ndarray], scaled: list[np.ndarray]) -> None:
    """Run every rank's plan in lockstep on ``state[r]`` (elements x ranks contribution counts) and
    ``scaled[r]`` (how many times the avg scale hit each element)."""
    size = layout.size
    for si in range(max(map(len, plans))):
        steps = [plan[si] if si < len(plan) else None for plan in plans]
        mail: dict = {}
        for r, step in enumerate(steps):
            if step is None or step.scale is not None:
                continue
            for s in step.sends:
                dst = members(s.comm, r, size, layout.X, layout.rpn)[s.peer]
                region = slice(s.offset, s.offset + s.count)
                mail.setdefault((r, dst, s.comm), []).append(
                    (s.count, state[r][region].copy(), scaled[r][region].copy()))
        for r, step in enumerate(steps):
            if step is None:
                continue
            if step.scale is not None:
                assert not step.sends and not step.recvs
                scaled[r][step.scale.offset:step.scale.offset + step.scale.count] += 1
                continue
            sent = np.zeros(len(state[r]), int)
            for s in step.sends:
                sent[s.offset:s.offset + s.count] += 1
            recv_regions = np.zeros(len(state[r]), int)
            for v in step.recvs:
                recv_regions[v.offset:v.offset + v.count] += 1
                # reducing into a region the step sends is allowed (plan.py): the send carries the old values
                assert v.reduce or not sent[v.offset:v.offset + v.count].any(), \
                    f"rank {r} step {si}: a copying receive overlaps a send"
            assert (recv_regions <= 1).all(), f"rank {r} step {si}: two receives overlap"
            for v in step.recvs:
                src = members(v.comm, r, size, layout.X, layout.rpn)[v.peer]
                queue = mail.get((src, r, v.comm))
                assert queue, f"rank {r} step {si}: receive from rank {src} on {v.comm} has no matching send"
                count, data, sc = queue.pop(0)
                assert count == v.count, f"rank {r} step {si}: receives {v.count}, rank {src} sends {count}"
                region = slice(v.offset, v.offset + v.count)
                if v.reduce:
                    assert not sc.any() and not scaled[r][region].any(), f"rank {r} step {si}: reduces " \
                                                                         "an already scaled value"
                    state[r][region] += data
                    scaled[r][region] += int(v.final)
                else:
                    assert not v.final
                    state[r][region] = data
                    scaled[r][region] = sc
        left = {k: len(q) for k, q in mail.items() if q}
        assert not left, f"step {si}: sends without a matching receive at the same step: {left}"


def _fresh(layout, n, filled):
    state = [np.zeros((n, layout.size), int) for _ in range(layout.size)]
    for r in range(layout.size):
        filled(state[r], r)
    return state, [np.zeros(n, int) for _ in range(layout.size)]


def _swing_local(algo):
    """``swing@A`` / ``swing_latency@A``: Swing with grid axis ``A`` inside the nodes (its steps first)."""
    base, _, axis = algo.partition("@")
    return base, {"local": int(axis)} if axis else {}


def _allreduce_plans(algo, layout, count):
    algo, local = _swing_local(algo)
    if algo == "ring":
        return [ring.allreduce("world", r, layout.size, count) for r in range(layout.size)]
    if algo == "torus2d":
        return [torus2d.allreduce(*layout.grid(r), layout.X, layout.Y, count) for r in range(layout.size)]
    if algo in ("swing", "swing_latency"):
        fn = swing.allreduce if algo == "swing" else swing.allreduce_latency
        return [fn(*layout.grid(r), layout.X, layout.Y, count, **local) for r in range(layout.size)]
    return [hierarchical.allreduce(*layout.node(r), count, layout.rpn) for r in range(layout.size)]


def _block_plans(module_fn, algo, layout, counts):
    displs = displacements(counts)
    algo, local = _swing_local(algo)
    if algo == "ring":
        fn = getattr(ring, module_fn)
        return [fn("world", r, layout.size, counts, displs) for r in range(layout.size)]
    if algo in ("torus2d", "swing"):
        fn = getattr(torus2d if algo == "torus2d" else swing, module_fn)
        return [fn(*layout.grid(r), layout.X, layout.Y, counts, displs, **local) for r in range(layout.size)]
    fn = getattr(hierarchical, module_fn)
    return [fn(*layout.node(r), counts, displs) for r in range(layout.size)]


def _layouts(algo, size, regular_nodes=False):
    algo = _swing_local(algo)[0]
    if algo == "ring":
        return [Layout(size)]
    if algo in ("torus2d", "swing", "swing_latency"):
        return [Layout(size, X) for X in range(1, size + 1) if size % X == 0]
    return [Layout(size, rpn=rpn) for rpn in range(1, size + 1) if not regular_nodes or size % rpn == 0]


SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]
ALGOS = ["ring", "torus2d", "hierarchical", "swing", "swing@0", "swing@1"]
LATENCY = ["swing_latency", "swing_latency@0", "swing_latency@1"]


@pytest.mark.parametrize("algo", ALGOS + LATENCY)
@pytest.mark.parametrize("size", SIZES)
def test_allreduce_plans_reduce_every_element_once_on_every_rank(algo, size):
    for layout in _layouts(algo, size):
        for count in sorted({0, 1, size - 1, size + 1, 7, 13, 2 * size * layout.X + 3}):
            plans = _allreduce_plans(algo, layout, count)
            state, scaled = _fresh(layout, count, lambda s, r: s.__setitem__((slice(None), r), 1))
            replay(layout, plans, state, scaled)
            where = f"{algo} size {size} X {layout.X} ranks_per_node {layout.rpn} count {count}"
            for r in range(size):
                assert (state[r] == 1).all(), f"{where}: rank {r} does not hold each input exactly once"
                assert (scaled[r] == 1).all(), f"{where}: rank {r} does not scale each element exactly once"


def _recvcount_patterns(size):
    return [[0] * size, [1] * size, [3] * size, [2 * i + 1 for i in range(size)],
            [0 if i % 2 else 5 + i for i in range(size)], [0] * (size - 1) + [7]]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter_plans_reduce_each_block_on_its_owner(algo, size):
    for layout in _layouts(algo, size, regular_nodes=True):
        for counts in _recvcount_patterns(size):
            displs = displacements(counts)
            plans = _block_plans("reduce_scatter", algo, layout, counts)
            state, scaled = _fresh(layout, sum(counts), lambda s, r: s.__setitem__((slice(None), r), 1))
            replay(layout, plans, state, scaled)
            for r in range(size):
                block = slice(displs[r], displs[r] + counts[r])
                where = f"{algo} size {size} X {layout.X} ranks_per_node {layout.rpn} recvcounts {counts}"
                assert (state[r][block] == 1).all(), f"{where}: rank {r}'s block is not reduced exactly once"
                assert (scaled[r][block] == 1).all(), f"{where}: rank {r}'s block is not scaled exactly once"


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("size", SIZES)
def test_allgather_plans_deliver_every_block_to_every_rank(algo, size):
    for layout in _layouts(algo, size, regular_nodes=True):
        for counts in _recvcount_patterns(size):
            displs = displacements(counts)
            plans = _block_plans("allgather", algo, layout, counts)
            state, scaled = _fresh(layout, sum(counts), lambda s, r: s.__setitem__(
                (slice(displs[r], displs[r] + counts[r]), r), 1))
            replay(layout, plans, state, scaled)
            expected = np.zeros((sum(counts), size), int)
            for b in range(size):
                expected[displs[b]:displs[b] + counts[b], b] = 1
            for r in range(size):
                assert (state[r] == expected).all(), \
                    f"{algo} size {size} X {layout.X} ranks_per_node {layout.rpn} recvcounts {counts}: " \
                    f"rank {r} does not end with every block"


@pytest.mark.parametrize("size", [2, 3, 4, 6, 8])
def test_step_counts_match_the_papers_latency_terms(size):
    """Ring all-reduce 2(N-1) steps; 2D-torus 2(X-1)+2(Y-1) (Mikami et al. 2018, section 3.2)."""
    for r in range(size):
        assert len(ring.allreduce("world", r, size, 100)) == 2 * (size - 1)
    for layout in _layouts("torus2d", size):
        for r in range(size):
            plan = torus2d.allreduce(*layout.grid(r), layout.X, layout.Y, 100)
            assert len(plan) == 2 * (layout.X - 1) + 2 * (layout.Y - 1)


@pytest.mark.parametrize("algo", ["swing", "swing@0", "swing@1"] + LATENCY)
@pytest.mark.parametrize("size", [3, 4, 5, 6, 7, 8, 12, 16])
def test_swing_float_sums_are_bitwise_equal_on_every_rank(algo, size):
    """On random floats (where the order of additions shows in the last bits) every rank ends with the same
    bytes, within rounding of numpy's sum: every element is reduced along one tree, whatever the rank."""
    rng = np.random.default_rng(size)
    for layout in _layouts(algo, size):
        count = 2 * size + 5
        plans = _allreduce_plans(algo, layout, count)
        x = rng.standard_normal((size, count)) * 10.0 ** rng.integers(-8, 8, (size, count))
        state = [x[r].copy() for r in range(size)]
        replay(layout, plans, state, [np.zeros(count, int) for _ in range(size)])
        where = f"{algo} size {size} X {layout.X}"
        for r in range(1, size):
            assert state[r].tobytes() == state[0].tobytes(), f"{where}: rank {r} differs from rank 0"
        np.testing.assert_allclose(state[0], x.sum(axis=0), rtol=1e-12, atol=1e-12 * np.abs(x).sum(axis=0).max(),
                                   err_msg=where)
