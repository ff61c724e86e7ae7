"""Which algorithm ``algorithm="auto"`` picks: one ordered table, by message size and grid.

The table was measured with ``torus-bench`` on the development machines (2 cores, MPICH 5, shared memory);
rerun it on your cluster and set ``TORUS_ALGO`` (or pass ``algorithm=``) to override it.
"""
from __future__ import annotations

import os

ALGORITHMS = ("ring", "hierarchical", "torus2d", "native")
# (collective, largest nbytes for which the row applies, algorithm), first match wins.
TABLE = (
    ("allreduce", 32 * 1024, "native"),
    ("allreduce", None, "torus2d"),
    ("reduce_scatter", 32 * 1024, "native"),
    ("reduce_scatter", None, "torus2d"),
    ("allgather", 32 * 1024, "native"),
    ("allgather", None, "torus2d"),
)


def choose(collective: str, nbytes: int, size: int, dims) -> str:
    """The algorithm for one call; ``TORUS_ALGO`` (one of ALGORITHMS) overrides the table."""
    forced = os.environ.get("TORUS_ALGO", "").strip()
    if forced and forced != "auto":
        if forced not in ALGORITHMS:
            raise ValueError(f"TORUS_ALGO={forced!r}: expected one of auto, {', '.join(ALGORITHMS)}")
        return forced
    if size == 1:
        return "native"
    for coll, limit, algo in TABLE:
        if coll == collective and (limit is None or nbytes <= limit):
            # A 1 x N or N x 1 grid is a ring; say so rather than pay for the grid bookkeeping.
            if algo == "torus2d" and 1 in dims:
                return "ring"
            return algo
    return "ring"
