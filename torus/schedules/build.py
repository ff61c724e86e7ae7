"""One plan builder for TorusComm and the simulator: ``build(collective, algorithm, topology, counts)``.

``counts``: the element count (all-reduce) or the per-rank block counts (reduce-scatter, all-gather).
``algorithm`` names an entry of the registry (torus/schedules/registry.py) with a plan; among the built-ins the ring
visits the ranks node by node (``Topology.ring_order``), the 2D-torus all-reduce runs its node-local axis first
(``Topology.columns_first``); swing runs on the grid (``Topology.dims``, a line when a side is 1) in rank
order, its node-local axis' steps first where one axis lies within the nodes. Pass the algorithm through ``effective``
first, which is where the hierarchical reduce-scatter and all-gather fall back to the ring on nodes that are
not equal runs of consecutive ranks (their blocks follow the rank order).
"""
from __future__ import annotations

from torus import knobs
from torus.partition import displacements
from torus.schedules import hierarchical, registry, ring, swing, torus2d
from torus.topology import Topology

SWING_LATENCY_BYTES = 8 << 10  # without a link figure (one node, emulated nodes): the limit measured first
# Across nodes the crossover of the two forms moved with the link's speed on the emulated hosts, so it is given
# as time on the link, set between the last size the latency form won and the first it lost at each speed
# measured (bench/swing/results/swing_latency_*.json; bench/swing/README.md, "The latency-optimal form").
SWING_LATENCY_LINK_SECONDS = 96e-6


def swing_latency_bytes(link_gbits: float | None = None) -> int:
    """The largest ``swing`` all-reduce, in bytes, that runs the latency-optimal form: ``TORUS_SWING_LATENCY_BYTES``
    when set (negative: none), else ``SWING_LATENCY_LINK_SECONDS`` on a link of ``link_gbits`` Gbit/s (the link
    between nodes: told or measured, ``TorusComm.link_gbits``), else ``SWING_LATENCY_BYTES``."""
    told = knobs.read("TORUS_SWING_LATENCY_BYTES")
    if told:
        return told
    if link_gbits is None:
        return SWING_LATENCY_BYTES
    return int(SWING_LATENCY_LINK_SECONDS * link_gbits * 1e9 / 8)


def effective(collective: str, algorithm: str, topology: Topology, nbytes: int,
              latency_bytes: int | None = None) -> str:
    """The algorithm that runs a call of ``nbytes``: ``algorithm``, or the ring where hierarchical cannot
    serve ``collective``; ``swing`` all-reduces of at most ``latency_bytes`` (None: ``swing_latency_bytes()``)
    run the latency-optimal form (``swing_latency``), and ``swing_latency`` serves only the all-reduce
    (``swing`` otherwise: its reduce-scatter and all-gather are already the ``log2 p`` steps of the paper)."""
    if algorithm == "hierarchical" and collective != "allreduce" and not topology.node_grid:
        return "ring"
    if algorithm == "swing" and collective == "allreduce":
        limit = swing_latency_bytes() if latency_bytes is None else latency_bytes
        if nbytes <= limit:
            return "swing_latency"
    if algorithm == "swing_latency" and collective != "allreduce":
        return "swing"
    if collective not in registry.get(algorithm).collectives:
        raise ValueError(f"algorithm {algorithm!r} does not serve {collective}")
    return algorithm


def grid_phases(collective: str, algorithm: str, topology: Topology, counts) -> tuple:
    """The ring phases (torus2d.Phase) of a torus2d call, and of a hierarchical reduce-scatter or all-gather
    (the 2D torus on the local x cross grid), as ``build`` runs them: what phases.py lowers level by level."""
    t = topology
    if algorithm == "hierarchical":
        (x, y), (X, Y), row, col = (t.local_rank, t.node), (t.local_size, t.nodes), "local", "cross"
    else:
        (x, y), (X, Y), row, col = t.coords, t.dims, "row", "col"
    if collective == "allreduce":
        if t.columns_first:  # the same schedule on the transposed grid: its rows are our columns
            return torus2d.allreduce_phases(y, x, Y, X, counts, row="col", col="row")
        return torus2d.allreduce_phases(x, y, X, Y, counts, row, col)
    return torus2d.block_phases(collective, x, y, X, Y, counts, displacements(counts), row, col)


def build(collective: str, algorithm: str, topology: Topology, counts) -> list:
    """The steps of ``topology.rank`` for one call (see plan.py): the registry entry's builder
    (torus/schedules/registry.py). Raises ValueError for an algorithm without a plan (native, shm)."""
    entry = registry.get(algorithm)
    if entry.build is None:
        raise ValueError(f"algorithm {algorithm!r} has no plan: it runs as one call on the whole buffers")
    return entry.build(collective, topology, counts)


def torus2d_plan(collective: str, t: Topology, counts) -> list:
    """The 2D torus (Mikami et al. 2018, arXiv:1811.05233, section 3.2): ``grid_phases`` lowered to ring steps."""
    return torus2d.lower(grid_phases(collective, "torus2d", t, counts))


def hierarchical_plan(collective: str, t: Topology, counts) -> list:
    """The hierarchical all-reduce (ibid.); its reduce-scatter and all-gather are the 2D torus on the local x
    cross grid (``grid_phases``)."""
    if collective != "allreduce":
        return torus2d.lower(grid_phases(collective, "hierarchical", t, counts))
    return hierarchical.allreduce(*t.hierarchical_args(), counts, t.max_local)


def ring_plan(collective: str, t: Topology, counts) -> list:
    """The ring (Patarasuk & Yuan 2009, JPDC 69(2), section 3), visiting the ranks node by node."""
    if collective == "allreduce":
        return ring.allreduce("world", t.ring_position, t.size, counts, order=t.ring_order)
    displs = displacements(counts)
    order = t.ring_order  # block r belongs to world rank r: index the blocks by ring position
    return (ring.reduce_scatter if collective == "reduce_scatter" else ring.allgather)(
        "world", t.ring_position, t.size, [counts[r] for r in order], [displs[r] for r in order], order=order)


def swing_plan(collective: str, t: Topology, counts) -> list:
    """Swing's bandwidth-optimal form (De Sensi et al., NSDI'24, section 3) on the grid."""
    (x, y), (X, Y) = t.coords, t.dims
    if collective == "allreduce":
        return swing.allreduce(x, y, X, Y, counts, local=_local_axis(t))
    return (swing.reduce_scatter if collective == "reduce_scatter" else swing.allgather)(
        x, y, X, Y, counts, displacements(counts), local=_local_axis(t))


def swing_latency_plan(collective: str, t: Topology, counts) -> list:
    """Swing's latency-optimal all-reduce (ibid., section 3.1); ``effective`` sends its other collectives to
    ``swing_plan``."""
    if collective != "allreduce":
        raise ValueError(f"swing_latency serves the all-reduce, not {collective} (see effective)")
    (x, y), (X, Y) = t.coords, t.dims
    return swing.allreduce_latency(x, y, X, Y, counts, local=_local_axis(t))


def _local_axis(t: Topology) -> int | None:
    """The grid axis (0: row, 1: column) inside the nodes, whose Swing steps run first; None on one node."""
    return {"row": 0, "col": 1}.get(t.node_axis or "")
