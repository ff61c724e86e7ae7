"""torus/schedules/phases.py without MPI: where the node-level phases lie (``node_level``) for the layouts the
suites run, and what every rank's phases cover (the shared-memory regions tile the buffer the way the plans'
chunks do; the plan phases use only the communicator across nodes)."""
from __future__ import annotations

import pytest

from torus.schedules import phases
from torus.schedules.build import build
from torus.topology import Topology


def _topologies(node_of, dims):
    return [Topology(r, len(node_of), dims, tuple(node_of)) for r in range(len(node_of))]


@pytest.mark.parametrize("node_of, dims, collective, algorithm, level", [
    ((0, 0, 0, 0), (2, 2), "allreduce", "hierarchical", None),  # one node: algorithm "shm" serves it
    ((0, 1, 2, 3), (2, 2), "allreduce", "hierarchical", None),  # one rank per node
    ((0, 0, 0, 1, 1), (1, 5), "allreduce", "hierarchical", "local"),  # 3 + 2
    ((0, 0, 0, 1, 1), (1, 5), "reduce_scatter", "hierarchical", None),  # unequal nodes: the ring runs
    ((0, 0, 1, 1), (2, 2), "reduce_scatter", "hierarchical", "local"),
    ((0, 0, 1, 1), (2, 2), "allreduce", "torus2d", "row"),
    ((0, 1, 0, 1), (2, 2), "allgather", "torus2d", "col"),  # round robin: the columns are the nodes
    ((0, 0, 0, 1, 1, 1), (2, 3), "allreduce", "torus2d", None),  # rows {2, 3} cross the nodes
    ((0, 0, 1, 1, 2), (1, 5), "allreduce", "torus2d", None),  # rows of one rank: nothing to share
    ((0, 0, 1, 1), (2, 2), "allreduce", "ring", None),
])
def test_node_level(node_of, dims, collective, algorithm, level):
    for t in _topologies(node_of, dims):
        assert phases.node_level(collective, algorithm, t) == level


def test_off_or_one_node_is_the_plan():
    t = Topology(1, 4, (2, 2), (0, 0, 1, 1))
    assert phases.build("allreduce", "torus2d", t, 10, shared=False) == (
        phases.Plan(build("allreduce", "torus2d", t, 10)),)
    rs = phases.build("reduce_scatter", "ring", t, (1, 2, 3, 4), shared=True)
    assert rs == (phases.Plan(build("reduce_scatter", "ring", t, (1, 2, 3, 4)), (1, 3)),)


@pytest.mark.parametrize("node_of, dims, algorithm", [
    ((0, 0, 0, 1, 1), (1, 5), "hierarchical"), ((0, 0, 1, 1, 2, 2), (2, 3), "torus2d"),
    ((0, 1, 0, 1, 0, 1), (2, 3), "torus2d"), ((0, 0, 0, 1, 1, 1), (3, 2), "hierarchical"),
])
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_every_rank_outputs_its_share(node_of, dims, algorithm, collective):
    """Per node-level communicator, the all-gather outputs are one region and the blocks of its members tile
    it; the plan phases message only the communicator across the nodes."""
    n = len(node_of)
    counts = 1000 if collective == "allreduce" else tuple(3 * r + 1 for r in range(n))
    tops = _topologies(node_of, dims)
    level = phases.node_level(collective, algorithm, tops[0])
    if level is None:
        pytest.skip("no node-level phase for this layout (the plan runs)")
    across = {"local": "cross", "row": "col", "col": "row"}[level]
    gathers: dict = {}
    for t in tops:
        for ph in phases.build(collective, algorithm, t, counts, shared=True):
            if isinstance(ph, phases.Plan):
                assert {m.comm for st in ph.steps for m in st.sends + st.recvs} <= {across}
            elif ph.collective == "allgather":
                gathers.setdefault((ph.comm, t.members(ph.comm), ph.out), []).append(ph.inp)
    for (_, members, (lo, hi)), blocks in gathers.items():
        assert len(blocks) == len(members)
        blocks.sort()
        assert blocks[0][0] == lo and blocks[-1][1] == hi
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
