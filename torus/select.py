"""Which algorithm ``algorithm="auto"`` picks: one ordered table, by message size, rank count and placement.

The rule: MPI's own all-reduce while latency dominates (our schedules take more steps than MPI's recursive
doubling); our schedules once bandwidth dominates, out of place sooner than in place (they read sendbuf
directly while MPI first copies it into recvbuf); the 2D torus above 2 ranks (at scale it takes
2(X-1)+2(Y-1) steps against the ring's 2(N-1)), except where the ring measured faster. The crossovers are
the ones measured with ``torus-bench allreduce`` (float32, 4 B .. 256 MiB, the C step loop) on 2 cores with
MPICH over shared memory: bench/torus_bench/results/allreduce_float32_p{2,4}.txt, tabulated in
bench/shared_memory/README.md ("Summary against native all-reduces"). Rows for more than 4 ranks were not measured with
the C step loop and keep the Python loop's crossover. Rerun the sweep on your cluster and set ``TORUS_ALGO`` (or pass
``algorithm=``) to override the table.
"""
from __future__ import annotations

from dataclasses import dataclass

from torus import knobs
from torus.schedules import registry

# The built-in algorithms, in the agreement signature's order (torus.ALGORITHMS); what a call may name is the
# registry's (torus/schedules/registry.py), read when it is made.
ALGORITHMS = registry.BUILTIN

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
    # (bench/torus_bench/results/allreduce_float32_p4.txt); above 4 ranks the torus' fewer steps are what the
    # table is for.
    (4, 1 << 20, None, "torus2d"),
    (4, 128 << 20, None, "ring"),
    (None, 512 * 1024, None, "native"),
    (None, None, None, "torus2d"),
)


# Where every rank is on one node, these rows come first (same columns): the shared-memory transport
# (torus/runtime/shm.py) against the rows below and the best native all-reduces, measured with
# bench/shared_memory/native_peers.py on 2 cores: shm led at every size measured at 2 to 8 ranks
# (bench/shared_memory/results/native_peers.txt, bench/shared_memory/results/shm_p8.txt; docs/performance.md,
# "What auto picks"). More than 8 ranks, and ranks with a core each beyond 2, were not measured. Never across
# nodes.
ONE_NODE_TABLE = (
    (8, None, None, "shm"),
)


def choose(collective: str, nbytes: int, size: int, dims, in_place: bool = False,
           across: Nodes | None = None, one_node: bool = False) -> str:
    """The algorithm for one call of ``collective`` on ``nbytes`` bytes over ``size`` ranks in grid ``dims``,
    in place (``sendbuf=MPI.IN_PLACE``) or not; ``across``: the nodes when there are several (then
    ``across_nodes`` decides, not the table); ``one_node``: every rank on one node (ONE_NODE_TABLE first).

    ``TORUS_ALGO`` (a registered algorithm, ``registry.names()``) overrides both; the table's rows that name an
    algorithm the registry does not let ``auto`` pick are passed over. Raises ValueError for an unknown
    TORUS_ALGO."""
    forced = knobs.read("TORUS_ALGO")
    if forced and forced != "auto":
        if forced not in registry.names():
            raise ValueError(f"{collective}: TORUS_ALGO={forced!r}; expected auto or one of "
                             f"{', '.join(registry.names())}")
        return forced
    if size == 1:
        return "native"
    if across is not None:
        return across_nodes(collective, nbytes, dims, across)
    placement = "in_place" if in_place else "out_of_place"
    for max_size, max_nbytes, where, algo in (ONE_NODE_TABLE + TABLE if one_node else TABLE):
        if (registry.get(algo).auto and (max_size is None or size <= max_size)
                and (max_nbytes is None or nbytes <= max_nbytes) and where in (None, placement)):
            # A 1 x N or N x 1 grid is a ring: say so rather than pay for the grid bookkeeping.
            return "ring" if algo == "torus2d" and 1 in dims else algo
    raise AssertionError("the table's last row matches every call")


# ---------------------------------------------------------------------------------------------- across nodes

@dataclass(frozen=True)
class Nodes:
    """What ``across_nodes`` knows of the placement: ``nodes`` (more than one), ``ranks_per_node`` (on the
    largest node), ``node_axis`` ("row", "col" or None: the grid axis that lies within nodes,
    ``Topology.node_axis``) and ``link_gbits``, one node link's speed in Gbit/s (torus/link.py)."""
    nodes: int
    ranks_per_node: int
    node_axis: str | None
    link_gbits: float


# Across nodes MPI's own all-reduce while the buffer crosses one link in less than this (seconds at the link's
# measured speed), i.e. while latency, not the link, is what the call waits for: where the 2D torus started
# to win on the emulated cluster (bench/across_hosts/results/cluster_sweep.txt; docs/performance.md, "What auto
# picks").
NATIVE_LINK_SECONDS = 0.25e-3
# One rank per node: every message crosses a link and the ring and the torus send the same bytes; the ring
# was as fast or faster at 2 and 4 nodes once the buffer takes TORUS2D_LINK_SECONDS on the link; below that
# the torus' fewer steps (2(X-1)+2(Y-1) against 2(N-1)) won at 4 nodes
# (bench/across_hosts/results/cluster_small_sizes.txt), and are assumed to win at any size above RING_MAX_NODES
# nodes.
RING_MAX_NODES = 4
TORUS2D_LINK_SECONDS = 1e-3
# One rank per node, all-reduce: Swing's latency-optimal form (log2 p steps of the whole buffer) beat native from
# SWING_MIN_BYTES up to SWING_LINK_SECONDS on the link at 2 and 4 emulated hosts, and lost below and above it
# (bench/swing/results/swing_auto_*.json; bench/swing/README.md, "In `auto`"); the bound scales with the link as
# NATIVE_LINK_SECONDS does.
SWING_MIN_BYTES = 16
SWING_LINK_SECONDS = 33e-6


def across_nodes(collective: str, nbytes: int, dims, nodes: Nodes) -> str:
    """The multi-node rule (all three collectives): with one rank per node, all-reduces from ``SWING_MIN_BYTES`` to
    ``SWING_LINK_SECONDS`` on the link run Swing's latency-optimal form; otherwise MPI's own call while the buffer
    would cross a link in under ``NATIVE_LINK_SECONDS``; then, with several ranks per node, the 2D torus where one
    of its axes lies within the nodes (its cross-node phase moves ``2(C-1)/C`` of the buffer per node, split over
    the node's ranks) and the hierarchical all-reduce where none does or the grid is a line (only the leaders cross,
    ``2(C-1)/C`` of it, against the ring's ``2(N-1)/N``); with one rank per node, where every message crosses and
    the ring and the torus send the same bytes, the torus for its fewer steps while the buffer crosses a link in
    under ``TORUS2D_LINK_SECONDS`` or above ``RING_MAX_NODES`` nodes, else (or when the grid is a line) the ring.
    Where the table above was measured on one node, this rule's constants come from the emulated cluster (tests/cluster,
    bench/across_hosts/cluster_sweep.py; how close the pick came: bench/across_hosts/results/cluster_sweep.txt,
    docs/performance.md). The ring here visits the ranks node by node (Topology.ring_order), so what it sends
    through a node's link does not depend on how the ranks were placed."""
    link_bytes_per_s = nodes.link_gbits * 1e9 / 8
    if (collective == "allreduce" and nodes.ranks_per_node == 1
            and SWING_MIN_BYTES <= nbytes <= SWING_LINK_SECONDS * link_bytes_per_s):
        return "swing_latency"
    if nbytes <= NATIVE_LINK_SECONDS * link_bytes_per_s:
        return "native"
    if nodes.ranks_per_node > 1:
        return "torus2d" if nodes.node_axis is not None and 1 not in dims else "hierarchical"
    if 1 in dims:
        return "ring"
    latency_bound = nbytes <= TORUS2D_LINK_SECONDS * link_bytes_per_s
    return "torus2d" if latency_bound or nodes.nodes > RING_MAX_NODES else "ring"
