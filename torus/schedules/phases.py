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
- torus2d's calls, and hierarchical's reduce-scatter and all-gather (its grid: local x cross, nodes of equal
  size): the schedules' own ring phases (``build.grid_phases``, torus2d.Phase: the all-reduce transposed
  where ``columns_first``, as the plain plan), the one on the node-level communicator over shared memory,
  every other lowered to its ring steps as ``build`` lowers them all. Only the leader form above is written
  here: it is not hierarchical.py's plan (a shared-memory all-reduce and broadcast replace the node's
  reduce-scatter, gather, scatter and all-gather).

Each element is still reduced once per level, by one rank, and copied to the others, so every rank's result
is bitwise identical; it need not equal the plain plan's bit for bit (the node level reduces in another order).
"""
from __future__ import annotations

from dataclasses import dataclass

from torus.partition import displacements
from torus.schedules import build as plans
from torus.schedules import registry, ring, torus2d
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
    ranks: the registry entry's ``node_level`` (torus/schedules/registry.py). The same on every rank: a
    function of the whole node layout and grid."""
    if topology.nodes == 1:  # one node: the whole call is algorithm "shm"'s
        return None
    level = registry.get(algorithm).node_level
    return None if level is None else level(collective, topology)


def build(collective: str, algorithm: str, topology: Topology, counts, shared: bool) -> tuple:
    """The phases of ``topology.rank`` for one call (``counts``: as for ``schedules.build``): with ``shared``
    and a ``node_level``, the entry's phased form (above); else the one plan of ``schedules.build``."""
    t = topology
    level = node_level(collective, algorithm, t) if shared else None
    if level is None:
        own = None
        if collective == "reduce_scatter":
            lo = displacements(counts)[t.rank]
            own = (lo, lo + counts[t.rank])
        return (Plan(plans.build(collective, algorithm, t, counts), own),)
    phases = registry.get(algorithm).phases
    assert phases is not None, f"{algorithm}: a node_level without phases"
    return phases(collective, t, counts, level)


def hierarchical_level(collective: str, t: Topology) -> str | None:
    """hierarchical: its node-local phases, where a node holds several ranks (reduce-scatter and all-gather:
    on the local x cross grid, nodes of equal size)."""
    several = t.max_local > 1 if collective == "allreduce" else t.node_grid and t.local_size > 1
    return "local" if several else None


def torus2d_level(collective: str, t: Topology) -> str | None:
    """torus2d: the grid axis that lies within the nodes, where it holds several ranks."""
    X, Y = t.dims
    if t.node_axis == "row" and X > 1:
        return "row"
    if t.node_axis == "col" and Y > 1:
        return "col"
    return None


def hierarchical_phases(collective: str, t: Topology, counts, level: str) -> tuple:
    """hierarchical: the leader form above for the all-reduce, the grid's ring phases otherwise."""
    if collective == "allreduce":
        return _leader_allreduce(t, counts)
    return torus2d_phases(collective, t, counts, level, "hierarchical")


def torus2d_phases(collective: str, t: Topology, counts, level: str, algorithm: str = "torus2d") -> tuple:
    """The ring phases of ``build.grid_phases``, the one on ``level`` over shared memory."""
    return tuple(_lowered(p, level) for p in plans.grid_phases(collective, algorithm, t, counts))


def _lowered(phase: torus2d.Phase, level: str):
    """``phase`` over shared memory where its communicator is ``level``, else as its ring plan (keeping what
    it leaves complete: later phases read only that)."""
    if phase.comm == level:
        counts = None if phase.collective == "allreduce" else phase.counts
        return Shm(phase.comm, phase.collective, phase.inp, phase.out, counts, phase.final)
    return Plan(phase.steps(), None if phase.collective == "allgather" else phase.out)


def _leader_allreduce(t: Topology, count: int) -> tuple:
    whole = (0, count)
    cross = (Plan(ring.allreduce("cross", t.node, t.nodes, count)),) if t.local_rank == 0 else ()
    if t.local_size == 1:
        return cross
    mine = whole if t.local_rank == 0 else (count, count)  # the broadcast: the leader's block is everything
    return (Shm("local", "allreduce", whole, whole, None), *cross,
            Shm("local", "allgather", mine, whole, (count,) + (0,) * (t.local_size - 1)))
