"""A schedule is a plan: the ordered list of steps one rank performs. Nothing else.

Schedules (ring.py, torus2d.py, hierarchical.py) only decide *which region goes to which peer on which
communicator, in which order*; ``executor.py`` moves the bytes over MPI and calls the kernels, and
``torus.sim`` replays the very same plans against a cost model. Regions are ``(offset, count)`` in elements
of the working buffer. Communicators are named: ``"world"``, ``"row"``, ``"col"``, ``"local"``, ``"cross"``;
peers are ranks within the named communicator.

Within one step every receive is posted before any send. A step never sends from a region that it receives
into by copying; it may send from a region that it reduces into (Swing's latency-optimal all-reduce): the
send carries the region as it was before the step, and the step's reductions wait for that send
(runtime/compile.py). The executor tags every message
with its step index, so a send and the receive that matches it must sit at the same index of the two ranks'
plans: where ranks play different roles (a node leader, a node of fewer ranks) the schedule pads with empty
steps (``pad``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Send:
    comm: str
    peer: int
    offset: int
    count: int


@dataclass(frozen=True)
class Recv:
    comm: str
    peer: int
    offset: int
    count: int
    reduce: bool  # True: reduce into the region; False: overwrite it
    final: bool = False  # this reduce completes the owner's result: fuse the avg scale into it


@dataclass(frozen=True)
class Scale:
    """Apply the avg scale to a region that no reduce completed (a communicator of size 1)."""
    offset: int
    count: int


@dataclass(frozen=True)
class Step:
    sends: tuple = ()
    recvs: tuple = ()
    scale: Scale | None = None


def pad(steps: list, length: int) -> list:
    """``steps`` followed by empty steps up to ``length`` steps in all (unchanged when already as long)."""
    return steps + [Step()] * (length - len(steps))
