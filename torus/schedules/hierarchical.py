"""Hierarchical all-reduce: reduce inside each node, all-reduce across nodes, broadcast inside each node
(the "hierarchical all-reduce" compared in Mikami et al. 2018, arXiv:1811.05233, section 3.2; also Jia et al.
2018, arXiv:1807.11205, section 4.2).

``L`` ranks per node (the node-local communicator), ``C`` nodes (the cross communicator of local-rank-0 ranks,
the leaders). All-reduce: (1) ring reduce-scatter inside the node and a gather of the chunks to the leader,
(2) ring all-reduce of the whole buffer among the leaders, (3) a scatter from the leader and a ring
all-gather inside the node. The whole message ``M`` crosses the inter-node level in (2) (``2(C-1)/C * M``
per leader), against ``M/X`` for the 2D-torus: that is the difference the paper measures.

Reduce-scatter and all-gather have no leader form that beats a grid, so they run the 2D-torus plans with the
node-local communicator as the row and the cross communicator as the column (nodes of equal size, ranks
numbered node by node; ``TorusComm`` falls back to the ring otherwise).
"""
from __future__ import annotations

from torus.partition import chunks
from torus.schedules import ring, torus2d
from torus.schedules.plan import Recv, Send, Step, pad


def allreduce(local_rank: int, L: int, node: int, C: int, count: int, max_local: int | None = None):
    """Plan of one rank: ``L`` ranks on its node, ``C`` nodes in all, ``max_local`` ranks on the largest node
    (default ``L``: nodes of equal size). Nodes may differ in size: every phase spans the same step indices
    on every rank (empty steps pad the shorter ones), because a message's tag is its step index."""
    Lmax = L if max_local is None else max_local
    counts, displs = chunks(count, L)
    steps = pad(ring.reduce_scatter("local", local_rank, L, counts, displs, final=C == 1), Lmax - 1)
    if Lmax > 1:
        if L == 1:
            steps.append(Step())
        elif local_rank == 0:
            steps.append(Step(recvs=tuple(Recv("local", i, displs[i], counts[i], reduce=False)
                                          for i in range(1, L))))
        else:
            steps.append(Step(sends=(Send("local", 0, displs[local_rank], counts[local_rank]),)))
    cross = ring.allreduce("cross", node, C, count, final=C > 1) if local_rank == 0 else []
    steps += pad(cross, 2 * (C - 1))
    if Lmax > 1:
        if L == 1:
            steps.append(Step())
        elif local_rank == 0:
            steps.append(Step(sends=tuple(Send("local", i, displs[i], counts[i]) for i in range(1, L))))
        else:
            steps.append(Step(recvs=(Recv("local", 0, displs[local_rank], counts[local_rank], reduce=False),)))
    return steps + ring.allgather("local", local_rank, L, counts, displs)


def reduce_scatter(local_rank: int, L: int, node: int, C: int, counts, displs):
    return torus2d.reduce_scatter(local_rank, node, L, C, counts, displs, row="local", col="cross")


def allgather(local_rank: int, L: int, node: int, C: int, counts, displs):
    return torus2d.allgather(local_rank, node, L, C, counts, displs, row="local", col="cross")
