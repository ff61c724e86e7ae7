"""A toy algorithm that exists in the registry alone (torus/schedules/registry.py): the ring visiting the ranks in
reverse order, built from ring.py's builders (Patarasuk & Yuan 2009, JPDC 69(2), section 3). Registered by
tests/test_registry.py and tests/mpi/test_registry_toy.py to show that every place naming algorithms sees it."""
from __future__ import annotations

from torus.partition import displacements
from torus.schedules import registry, ring

NAME = "reverse_ring"


def build(collective: str, t, counts) -> list:
    """``t.rank``'s steps: a world ring in the order size-1, ..., 1, 0 (counts as for schedules.build)."""
    order = list(range(t.size))[::-1]
    position = order.index(t.rank)
    if collective == "allreduce":
        return ring.allreduce("world", position, t.size, counts, order=order)
    displs = displacements(counts)
    builder = ring.reduce_scatter if collective == "reduce_scatter" else ring.allgather
    return builder("world", position, t.size, [counts[r] for r in order], [displs[r] for r in order], order=order)


def register() -> registry.Algorithm:
    """Register the toy once (every rank, in the same order: its number is in the agreement signature)."""
    if NAME in registry.names():
        return registry.get(NAME)
    return registry.register(registry.Algorithm(NAME, "the ring in reverse rank order (a test's toy)", build=build))
