"""Which algorithm ``algorithm="auto"`` picks: one ordered table, by message size and grid.

Measured with ``torus-bench allreduce`` (float32, 4 B .. 256 MiB, bench/results/allreduce_float32_p{2,4}.txt)
on the development machines: 2 cores, MPICH 5 over shared memory. MPI's own all-reduce wins while latency
dominates (our schedules pay ~10 us of Python per call and, with more ranks than cores, one scheduler slice
per step); the ring/2D-torus schedules win once bandwidth dominates (0.4-0.9x native's time from 4 MiB at
2 ranks, from 16 MiB at 4 oversubscribed ranks). Rerun the sweep on your cluster and set ``TORUS_ALGO``
(or pass ``algorithm=``) to override the table.
"""
from __future__ import annotations

import os

ALGORITHMS = ("ring", "hierarchical", "torus2d", "native")

# (largest communicator size the row applies to, largest nbytes, algorithm); None = no limit; first match
# wins. Rows apply to all three collectives (reduce-scatter and all-gather move half an all-reduce's bytes
# per step, and their crossover was not measured separately).
TABLE = (
    (2, 256 * 1024, "native"),
    (2, None, "ring"),
    (None, 8 * 1024 * 1024, "native"),
    (None, None, "torus2d"),
)


def choose(collective: str, nbytes: int, size: int, dims) -> str:
    """The algorithm for one call of ``collective`` on ``nbytes`` bytes over ``size`` ranks in grid ``dims``.

    ``TORUS_ALGO`` (one of ALGORITHMS) overrides the table. Raises ValueError for an unknown TORUS_ALGO."""
    forced = os.environ.get("TORUS_ALGO", "")
    if forced and forced != "auto":
        if forced not in ALGORITHMS:
            raise ValueError(f"{collective}: TORUS_ALGO={forced!r}; expected auto or one of "
                             f"{', '.join(ALGORITHMS)}")
        return forced
    if size == 1:
        return "native"
    for max_size, max_nbytes, algo in TABLE:
        if (max_size is None or size <= max_size) and (max_nbytes is None or nbytes <= max_nbytes):
            # A 1 x N or N x 1 grid is a ring: say so rather than pay for the grid bookkeeping.
            return "ring" if algo == "torus2d" and 1 in dims else algo
    raise AssertionError("the table's last row matches every call")
