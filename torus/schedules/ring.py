"""Ring reduce-scatter, all-gather and all-reduce (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 69(2); the schedule NCCL and Gloo call "ring").

On a communicator of ``p`` ranks the buffer region is cut into ``p`` chunks; rank ``r`` sends to ``r+1`` and
receives from ``r-1``. Reduce-scatter takes ``p-1`` steps and leaves chunk ``r`` fully reduced on rank ``r``;
all-gather takes ``p-1`` steps; all-reduce is the two in sequence: ``2(p-1)`` steps, each rank sending
``2(p-1)/p`` of the region.

``rank`` is the position in the ring and ``order`` (default: the communicator's rank order) the
communicator ranks at each position, so a ring may visit its ranks in any order (TorusComm's world ring runs
node by node, ``Topology.ring_order``); ``counts``/``displs`` are indexed by position.
"""
from __future__ import annotations

from torus.partition import chunks
from torus.schedules.plan import Recv, Scale, Send, Step


def _neighbours(rank: int, size: int, order) -> tuple[int, int]:
    """(right, left): the communicator ranks after and before position ``rank``."""
    right, left = (rank + 1) % size, (rank - 1) % size
    return (right, left) if order is None else (order[right], order[left])


def reduce_scatter(comm: str, rank: int, size: int, counts, displs, base: int = 0,
                   final: bool = True, order=None) -> list[Step]:
    """Steps after which chunk ``rank`` (``counts[rank]`` elements at ``base + displs[rank]``) holds the
    reduction over all ranks. ``final`` marks that reduction as complete (the avg scale is fused into it)."""
    if size == 1:
        return [Step(scale=Scale(base + displs[0], counts[0]))] if final else []
    right, left = _neighbours(rank, size, order)
    steps = []
    for s in range(size - 1):
        send_chunk = (rank - s - 1) % size  # the chunk reduced in the previous step (own data at s = 0)
        recv_chunk = (rank - s - 2) % size
        steps.append(Step(
            sends=(Send(comm, right, base + displs[send_chunk], counts[send_chunk]),),
            recvs=(Recv(comm, left, base + displs[recv_chunk], counts[recv_chunk], reduce=True,
                        final=final and s == size - 2),)))
    return steps


def allgather(comm: str, rank: int, size: int, counts, displs, base: int = 0, order=None) -> list[Step]:
    """Steps after which every rank holds every chunk, given that position ``r`` holds chunk ``r``."""
    right, left = _neighbours(rank, size, order)
    steps = []
    for s in range(size - 1):
        send_chunk = (rank - s) % size
        recv_chunk = (rank - s - 1) % size
        steps.append(Step(
            sends=(Send(comm, right, base + displs[send_chunk], counts[send_chunk]),),
            recvs=(Recv(comm, left, base + displs[recv_chunk], counts[recv_chunk], reduce=False),)))
    return steps


def allreduce(comm: str, rank: int, size: int, count: int, base: int = 0, final: bool = True,
              order=None) -> list[Step]:
    """Reduce-scatter then all-gather over ``count`` elements at ``base``: ``2(size-1)`` steps."""
    counts, displs = chunks(count, size)
    return (reduce_scatter(comm, rank, size, counts, displs, base, final, order)
            + allgather(comm, rank, size, counts, displs, base, order))
