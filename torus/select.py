"""Which algorithm ``algorithm="auto"`` picks: one ordered table, by message size and grid.

Measured with ``torus-bench allreduce`` (float32, 4 B .. 256 MiB, bench/results/allreduce_float32_p{2,4}.txt
and one earlier sweep of the same day) on the development machines: 2 cores, MPICH 5 over shared memory, the C
step loop (cloop.py). MPI's own all-reduce wins while latency dominates (our schedules take more steps than
MPI's recursive doubling); our schedules win once bandwidth dominates, out of place sooner than in place
because they read sendbuf directly while MPI first copies it into recvbuf: at 2 ranks from 64 KiB out of place
(0.89-0.92x native's time) and from 256 KiB in place (0.95-0.99x, 0.85-0.88x at 1 MiB); at 4 oversubscribed
ranks from 64 KiB out of place (0.92-0.97x) and from 1 MiB in place (0.85-0.89x; 0.96-1.01x at 256 KiB, a
tie). The 2D torus is the choice above 2 ranks (at scale it takes 2(X-1)+2(Y-1) steps against the ring's
2(N-1)), except at 3-4 ranks above 1 MiB up to 128 MiB, where the ring measured faster here (see the rows).
Rows for more than 4 ranks were not measured with the C loop and keep the Python loop's crossover (512 KiB).
Rerun the sweep on your cluster and set ``TORUS_ALGO`` (or pass ``algorithm=``) to override the table.
"""
from __future__ import annotations

import os

ALGORITHMS = ("ring", "hierarchical", "torus2d", "native")

# (largest communicator size the row applies to, largest nbytes, placement the row applies to, algorithm);
# None = no limit / both placements; first match wins. Rows apply to all three collectives (reduce-scatter
# and all-gather move half an all-reduce's bytes per step, and their crossover was not measured separately).
TABLE = (
    (2, 32 * 1024, None, "native"),
    (2, 128 * 1024, "in_place", "native"),
    (2, None, None, "ring"),
    (4, 32 * 1024, None, "native"),
    (4, 512 * 1024, "in_place", "native"),
    # 4 ranks on 2 cores (2026-11-30, C loop, two sweeps): the 2x2 torus leads to 256 KiB (0.84 against 0.92
    # of native's time out of place), they tie at 1 MiB, the ring leads from 4 to 64 MiB (in place at 4 MiB
    # 0.76-0.78 against 0.81-0.86, at 64 MiB 0.40-0.57 against 0.50-0.69) and the torus at 256 MiB out of
    # place (0.73 against 0.82-0.83). Earlier interleaved runs (Python loop) agreed: the ring 1.19-1.41x faster
    # at 64-128 MiB, the torus 1.10-1.13x at 256 MiB. Above 4 ranks the torus' fewer steps are what the table
    # is for.
    (4, 1 << 20, None, "torus2d"),
    (4, 128 << 20, None, "ring"),
    (None, 512 * 1024, None, "native"),
    (None, None, None, "torus2d"),
)


def choose(collective: str, nbytes: int, size: int, dims, in_place: bool = False) -> str:
    """The algorithm for one call of ``collective`` on ``nbytes`` bytes over ``size`` ranks in grid ``dims``,
    in place (``sendbuf=MPI.IN_PLACE``) or not.

    ``TORUS_ALGO`` (one of ALGORITHMS) overrides the table. Raises ValueError for an unknown TORUS_ALGO."""
    forced = os.environ.get("TORUS_ALGO", "")
    if forced and forced != "auto":
        if forced not in ALGORITHMS:
            raise ValueError(f"{collective}: TORUS_ALGO={forced!r}; expected auto or one of "
                             f"{', '.join(ALGORITHMS)}")
        return forced
    if size == 1:
        return "native"
    placement = "in_place" if in_place else "out_of_place"
    for max_size, max_nbytes, where, algo in TABLE:
        if ((max_size is None or size <= max_size) and (max_nbytes is None or nbytes <= max_nbytes)
                and where in (None, placement)):
            # A 1 x N or N x 1 grid is a ring: say so rather than pay for the grid bookkeeping.
            return "ring" if algo == "torus2d" and 1 in dims else algo
    raise AssertionError("the table's last row matches every call")
