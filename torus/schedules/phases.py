"""A call as phases: the plan of ``schedules.build``, or, across nodes, a two-level collective whose
node-level phases run over the shared-memory transport (torus/runtime/shm.py) and whose other level stays a
plan of the step loop. Pure, like the plans: ``build(collective, algorithm, topology, counts, shared)``.

Phases run in order on the call's working buffer (``count`` elements, as a plan does):

- ``Plan``: the steps of a plan (plan.py; regions in elements of the whole buffer) for the step loop;
  ``keep``: the region that later phases or the result read (None: all of it), which is what an out-of-place
  first phase copies from the input where no step writes (compile.py's ``untouched``).
- ``Shm``: one collective of the shared-memory transport of communicator ``comm`` (all its ranks on one node),
  reading elements ``inp`` of the input and writing elements ``out`` of the buffer, both ``(lo, hi)``:
  all-reduce (the same region), reduce-scatter (every block in, this rank's block out), all-gather (this
  rank's block in, every block out). ``counts``: the blocks in the communicator's rank order (None: the even
  split of an all-reduce). ``final``: this reduction completes the result (the avg scale goes into it).

Where the shared-memory phases lie (``node_level``; several nodes, node-level communicators of several ranks):

- hierarchical all-reduce (the leader form of hierarchical.py): a shared-memory all-reduce inside the node
  (every rank ends with the node's sum, which the leader needs), the leaders' ring all-reduce across nodes
  (the plan's middle phase), then a shared-memory all-gather in which the leader's block is the whole buffer
  and every other rank's is empty: a broadcast from the leader. Nodes may differ in size; a node of one rank
  has no shared-memory phase.
- torus2d all-reduce, the axis within nodes first (``Topology.node_axis``; as ``columns_first`` orders the
  plan): a shared-memory reduce-scatter along it, the ring all-reduce of this rank's chunk along the other
  axis, a shared-memory all-gather along it.
- reduce-scatter and all-gather of torus2d and of hierarchical (its grid: local x cross, nodes of equal
  size): torus2d.py's two ring phases, the one along the axis within nodes over shared memory.

Each element is still reduced once per level, by one rank, and copied to the others, so every rank's result
is bitwise identical; it need not equal the plain plan's bit for bit (the node level reduces in another order).
"""
from __future__ import annotations

from dataclasses import dataclass

from torus.partition import chunks, displacements
from torus.schedules import build as plans
from torus.schedules import ring, torus2d
from torus.topology import Topology


@dataclass(frozen=True)
class Plan:
    steps: list
    keep: tuple | None = None


@dataclass(frozen=True)
class Shm:
    comm: str
    collective: str
    inp: tuple
    out: tuple
    counts: tuple | None
    final: bool = False


def node_level(collective: str, algorithm: str, topology: Topology) -> str | None:
    """The communicator whose phases run over shared memory ("local", "row" or "col"), or None where no
    phase of ``algorithm`` (after ``schedules.build.effective``) lies within the nodes and holds several
    ranks. The same on every rank: a function of the whole node layout and grid."""
    t = topology
    if t.nodes == 1:  # one node: the whole call is algorithm "shm"'s
        return None
    if algorithm == "hierarchical":
        several = t.max_local > 1 if collective == "allreduce" else t.node_grid and t.local_size > 1
        return "local" if several else None
    if algorithm == "torus2d":
        X, Y = t.dims
        if t.node_axis == "row" and X > 1:
            return "row"
        if t.node_axis == "col" and Y > 1:
            return "col"
    return None


def build(collective: str, algorithm: str, topology: Topology, counts, shared: bool) -> tuple:
    """The phases of ``topology.rank`` for one call (``counts``: as for ``schedules.build``): with ``shared``
    and a ``node_level``, the phased form above; else the one plan of ``schedules.build``."""
    t = topology
    level = node_level(collective, algorithm, t) if shared else None
    if level is None:
        own = None
        if collective == "reduce_scatter":
            lo = displacements(counts)[t.rank]
            own = (lo, lo + counts[t.rank])
        return (Plan(plans.build(collective, algorithm, t, counts), own),)
    if algorithm == "hierarchical" and collective == "allreduce":
        return _leader_allreduce(t, counts)
    (x, y), (X, Y), row, col = t.coords, t.dims, "row", "col"
    if algorithm == "hierarchical":  # the grid of its reduce-scatter and all-gather (hierarchical.py)
        (x, y), (X, Y), row, col = (t.local_rank, t.node), (t.local_size, t.nodes), "local", "cross"
    if collective == "allreduce":  # torus2d: the axis within nodes as the row (transposed when columns)
        if level == "col":
            x, y, X, Y, row, col = y, x, Y, X, "col", "row"
        return _grid_allreduce(x, y, X, Y, counts, row, col)
    return _grid_blocks(collective, x, y, X, Y, counts, row, col, level != "col")


def _leader_allreduce(t: Topology, count: int) -> tuple:
    whole = (0, count)
    cross = (Plan(ring.allreduce("cross", t.node, t.nodes, count)),) if t.local_rank == 0 else ()
    if t.local_size == 1:
        return cross
    mine = whole if t.local_rank == 0 else (count, count)  # the broadcast: the leader's block is everything
    return (Shm("local", "allreduce", whole, whole, None), *cross,
            Shm("local", "allgather", mine, whole, (count,) + (0,) * (t.local_size - 1)))


def _grid_allreduce(x: int, y: int, X: int, Y: int, count: int, row: str, col: str) -> tuple:
    """torus2d.allreduce with its row phases over shared memory."""
    cs, ds = chunks(count, X)
    whole, own = (0, count), (ds[x], ds[x] + cs[x])
    return (Shm(row, "reduce_scatter", whole, own, tuple(cs)),
            Plan(ring.allreduce(col, y, Y, cs[x], base=ds[x]), own),
            Shm(row, "allgather", own, whole, tuple(cs)))


def _grid_blocks(collective: str, x: int, y: int, X: int, Y: int, counts, row: str, col: str,
                 rows_within: bool) -> tuple:
    """torus2d.reduce_scatter / allgather (block ``y*X + x`` on rank ``(x, y)``) with the phase along the
    rows (``rows_within``) or along the columns over shared memory."""
    displs = displacements(counts)
    sc, sd = torus2d.row_segments(X, Y, counts, displs)
    mine, me = slice(y * X, (y + 1) * X), y * X + x
    whole, seg, own = (0, sum(counts)), (sd[y], sd[y] + sc[y]), (displs[me], displs[me] + counts[me])
    if collective == "reduce_scatter":
        if rows_within:
            return (Plan(ring.reduce_scatter(col, y, Y, sc, sd, final=X == 1), seg),
                    Shm(row, "reduce_scatter", seg, own, tuple(counts[mine]), final=X > 1))
        return (Shm(col, "reduce_scatter", whole, seg, tuple(sc), final=X == 1),
                Plan(ring.reduce_scatter(row, x, X, counts[mine], displs[mine], final=X > 1), own))
    if rows_within:
        return (Shm(row, "allgather", own, seg, tuple(counts[mine])),
                Plan(ring.allgather(col, y, Y, sc, sd)))
    return (Plan(ring.allgather(row, x, X, counts[mine], displs[mine])),
            Shm(col, "allgather", seg, whole, tuple(sc)))
