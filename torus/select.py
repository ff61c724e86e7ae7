"""Which algorithm ``algorithm="auto"`` picks: one ordered table, by message size, rank count and placement.

The rule: MPI's own all-reduce while latency dominates (our schedules take more steps than MPI's recursive
doubling); our schedules once bandwidth dominates, out of place sooner than in place (they read sendbuf
directly while MPI first copies it into recvbuf); the 2D torus above 2 ranks (at scale it takes
2(X-1)+2(Y-1) steps against the ring's 2(N-1)), except where the ring measured faster. The crossovers are
the ones measured with ``torus-bench allreduce`` (float32, 4 B .. 256 MiB, the C step loop) on 2 cores with
MPICH over shared memory: bench/results/allreduce_float32_p{2,4}.txt, tabulated in bench/README.md. Rows for
more than 4 ranks were not measured with the C step loop and keep the Python loop's crossover. Rerun the sweep
on your cluster and set ``TORUS_ALGO`` (or pass ``algorithm=``) to override the table.
"""
from __future__ import annotations

import os

ALGORITHMS = ("ring", "hierarchical", "torus2d", "native", "shm")

# (largest communicator size the row applies to, largest nbytes, placement the row applies to, algorithm);
# None = no limit / both placements; first match wins. Rows apply to all three collectives (reduce-scatter
# and all-gather move half an all-reduce's bytes per step, and their crossover was not measured separately).
TABLE = (
    (2, 32 * 1024, None, "native"),
    (2, 128 * 1024, "in_place", "native"),
    (2, None, None, "ring"),
    (4, 32 * 1024, None, "native"),
    (4, 512 * 1024, "in_place", "native"),
    # 4 ranks: the 2x2 torus leads to 1 MiB, the ring from 4 to 128 MiB, the torus again above
    # (bench/results/allreduce_float32_p4.txt); above 4 ranks the torus' fewer steps are what the table is for.
    (4, 1 << 20, None, "torus2d"),
    (4, 128 << 20, None, "ring"),
    (None, 512 * 1024, None, "native"),
    (None, None, None, "torus2d"),
)


# Where every rank is on one node, these rows come first (same columns): the shared-memory transport
# (torus/runtime/shm.py) against the rows below, measured with bench/native_peers.py on 2 cores under load
# (bench/README.md, "Shared memory"): at 2 ranks shm led at every size from 64 KiB to 256 MiB; at 4 ranks
# (two per core) it tied the schedules at 1 MiB and fell behind above (each step waits until every rank has
# been scheduled). More than 4 ranks, and 4 ranks with a core each, were not measured. Never across nodes.
ONE_NODE_TABLE = (
    (2, None, None, "shm"),
    (4, 1 << 20, None, "shm"),
)


def choose(collective: str, nbytes: int, size: int, dims, in_place: bool = False, one_node: bool = False) -> str:
    """The algorithm for one call of ``collective`` on ``nbytes`` bytes over ``size`` ranks in grid ``dims``,
    in place (``sendbuf=MPI.IN_PLACE``) or not, every rank on one node (``one_node``: ONE_NODE_TABLE first).

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
    for max_size, max_nbytes, where, algo in (ONE_NODE_TABLE + TABLE if one_node else TABLE):
        if ((max_size is None or size <= max_size) and (max_nbytes is None or nbytes <= max_nbytes)
                and where in (None, placement)):
            # A 1 x N or N x 1 grid is a ring: say so rather than pay for the grid bookkeeping.
            return "ring" if algo == "torus2d" and 1 in dims else algo
    raise AssertionError("the table's last row matches every call")
