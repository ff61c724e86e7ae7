"""Call shapes: what TorusComm decides once per shape of call rather than on every call.

A shape is (collective, algorithm as asked, op, dtype, count, in place, per-rank counts). Its decisions: the
algorithm that runs (``auto`` through torus/select.py, the hierarchical fallback of ``schedules.build.
effective``), whether its node-level phases run over shared memory (torus/schedules/phases.py), the
signature the argument check all-gathers (torus/agreement.py) and the avg factors (torus/ops.py). Training
repeats a few shapes every step, so these cost nothing after the first call; the price is that ``TORUS_ALGO``
is read when a shape is first seen.
"""
from __future__ import annotations

from collections.abc import Callable

from torus import agreement, buffers
from torus.ops import avg_factors
from torus.schedules import registry
from torus.schedules.build import effective, swing_latency_bytes
from torus.schedules.phases import node_level
from torus.topology import Topology

MAX_SHAPES = 4096  # bounded: a sweep over many sizes must not grow without limit


class Shapes:
    """The decisions of every shape seen on one TorusComm. ``auto(collective, nbytes, in_place)``: the
    algorithm ``auto`` picks (before the fallback); ``shm_phases``: node-level phases may run over shared
    memory (TorusComm's ``shm_phases``, where every node's ranks share memory); ``link_gbits``: the link between
    nodes (None: one node, or not known), which sets where ``swing`` takes its latency-optimal form."""

    def __init__(self, topology: Topology, segment_bytes: int, auto: Callable[[str, int, bool], str],
                 shm_phases: bool = False, link_gbits: float | None = None):
        self.topology, self.segment_bytes, self.auto, self.shm_phases = topology, segment_bytes, auto, shm_phases
        self.link_gbits = link_gbits
        self._known: dict = {}

    def get(self, what: str, algorithm: str, op: str, p: buffers.Placement) -> tuple:
        """``(algorithm, phased, signature, pre, post)`` for call ``p`` (resolved by buffers.resolve). Raises
        ValueError naming the rank for an unknown algorithm, or ``shm`` across nodes."""
        key = (what, algorithm, op, p.dtype, p.count, p.in_place, p.counts and tuple(p.counts))
        shape = self._known.get(key)
        if shape is None:
            if len(self._known) >= MAX_SHAPES:
                self._known.clear()
            shape = self._known[key] = self._decide(what, algorithm, op, p)
        return shape

    def _decide(self, what: str, algorithm: str, op: str, p: buffers.Placement) -> tuple:
        t = self.topology
        if algorithm == "auto":
            algo = self.auto(what, p.count * p.dtype.itemsize, p.in_place)
        elif algorithm not in registry.names():
            buffers.fail(what, t.rank, ValueError, f"unknown algorithm {algorithm!r}; expected auto or one of "
                                                   f"{', '.join(registry.names())}")
        else:
            algo = algorithm
        if algo == "shm" and t.nodes > 1:
            buffers.fail(what, t.rank, ValueError, f"algorithm 'shm' needs every rank on one node; these "
                                                   f"{t.size} ranks are on {t.nodes} nodes (use ring, "
                                                   "hierarchical or torus2d)")
        try:
            algo = effective(what, algo, t, p.count * p.dtype.itemsize, swing_latency_bytes(self.link_gbits))
        except ValueError as e:  # a registered algorithm that does not serve this collective
            buffers.fail(what, t.rank, ValueError, str(e))
        phased = self.shm_phases and node_level(what, algo, t) is not None
        mine = agreement.signature(what, algo, op, p.dtype, p.count, p.counts, self.segment_bytes, t.dims[0],
                                   phased)
        pre, post = avg_factors(p.dtype, t.size) if op == "avg" else (1.0, 1.0)
        return algo, phased, mine, pre, post
