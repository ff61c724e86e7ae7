"""The algorithm registry: one ``Algorithm`` entry per algorithm, read at call time by everything that names one.

An entry holds the algorithm's name, the collectives it serves, its plan builder (``schedules.build``'s per-algorithm
step; None for ``native`` and ``shm``, which run as one call on whole buffers), its two-level phases where it has
them (torus/schedules/phases.py), its closed forms (torus/sim/closed_form.py), whether ``auto``'s one-node table may
pick it (torus/select.py), how the simulator models it (torus/sim/plans.py) and a one-line description with its
source. TorusComm (its checks, the agreement signature), ``TORUS_ALGO``, torus-bench ``--algo``, torus-sim ``--algo``
and its table, torus-train ``--algorithm`` and TorusStrategy read ``names()`` when they run, so an algorithm
``register``ed later is seen by all of them.

Order is part of the wire format: an algorithm's position in ``names()`` is the number in every call's agreement
signature (torus/agreement.py), so the built-ins keep ``BUILTIN``'s order (``torus.ALGORITHMS``) and a registered
algorithm is appended; every rank must register the same algorithms in the same order.

The built-ins are registered on first use, not at import: their builders and closed forms live in modules
(schedules/build.py, schedules/phases.py, sim/) that import this one.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")
BUILTIN = ("ring", "hierarchical", "torus2d", "native", "shm", "swing", "swing_latency")


@dataclass(frozen=True)
class Algorithm:
    """One algorithm. ``build(collective, topology, counts)``: ``topology.rank``'s steps (plan.py; ``counts`` as for
    ``schedules.build.build``). ``node_level(collective, topology)`` and ``phases(collective, topology, counts,
    level)``: the communicator whose phases may run over shared memory across nodes, and the call as phases with
    that level over shared memory (phases.py); None: the algorithm is always one plan. ``steps(collective, N, X, Y,
    L)`` and ``time(collective, M, alpha, beta, gamma, N, X, Y, L, inter_alpha, inter_beta)``: its closed forms
    (sim/closed_form.py; None: none). ``auto``: the one-node table may pick it. ``simulated``: torus-sim replays its
    plans (``sim_default``: in torus-sim's default list); ``orbit(collective, layout, count)``: the simulator's
    rotation fast path (sim/plans.py; None: replayed in full at every size)."""
    name: str
    description: str
    collectives: tuple = COLLECTIVES
    build: Callable[..., list] | None = None
    node_level: Callable[..., str | None] | None = None
    phases: Callable[..., tuple] | None = None
    steps: Callable[..., int] | None = None
    time: Callable[..., float] | None = None
    auto: bool = False
    simulated: bool = True
    sim_default: bool = False
    orbit: Callable[..., Any] | None = None


_ENTRIES: dict[str, Algorithm] = {}
_LOCK = threading.RLock()  # the built-ins load once, whichever thread first asks
_loading = False


def register(entry: Algorithm) -> Algorithm:
    """Append ``entry`` (after the built-ins); returns it. Raises ValueError for a name already registered, one
    that is not a plain identifier (it is an ``--algo`` list item and a ``TORUS_ALGO`` value), an entry without a
    plan builder or with unknown collectives."""
    _load()
    if entry.name in _ENTRIES or entry.name == "auto":
        raise ValueError(f"algorithm {entry.name!r} is already registered")
    if not entry.name.isidentifier():
        raise ValueError(f"algorithm name {entry.name!r}: expected an identifier")
    if entry.build is None:  # native and shm are transports TorusComm runs itself (comm.py's _direct)
        raise ValueError(f"algorithm {entry.name!r}: a registered algorithm needs a plan builder")
    bad = [c for c in entry.collectives if c not in COLLECTIVES]
    if bad or not entry.collectives:
        raise ValueError(f"algorithm {entry.name!r}: collectives {entry.collectives!r}; expected some of "
                         f"{', '.join(COLLECTIVES)}")
    _ENTRIES[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a registered algorithm (tests); the built-ins cannot be removed (their numbers are fixed)."""
    if name in BUILTIN:
        raise ValueError(f"algorithm {name!r} is built in")
    _ENTRIES.pop(name, None)


def names() -> tuple:
    """Every registered algorithm, in registration order (the built-ins first, ``BUILTIN``)."""
    _load()
    return tuple(_ENTRIES)


def get(name: str) -> Algorithm:
    """The entry of ``name``; KeyError naming the choices for an unknown one."""
    _load()
    try:
        return _ENTRIES[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; expected one of {', '.join(_ENTRIES)}") from None


def index(name: str) -> int:
    """``name``'s number in the agreement signature: its position in ``names()``."""
    return names().index(name)


def for_collective(collective: str) -> tuple:
    """The algorithms that serve ``collective``, in registration order."""
    _load()
    return tuple(n for n, e in _ENTRIES.items() if collective in e.collectives)


def simulated() -> tuple:
    """The algorithms torus-sim replays (its ``--algo`` choices), in registration order."""
    _load()
    return tuple(n for n, e in _ENTRIES.items() if e.simulated)


def _load() -> None:
    global _loading
    if _ENTRIES:
        return
    with _LOCK:
        if _ENTRIES or _loading:  # loaded meanwhile, or asked again from the imports below
            return
        _loading = True
        try:
            _ENTRIES.update({e.name: e for e in _builtins()})  # at once: other threads read without the lock
        finally:
            _loading = False
    assert tuple(_ENTRIES) == BUILTIN, "the built-ins' order is the agreement signature's"


def _builtins() -> list:
    # Imported here: these modules import this one (see the module docstring).
    from torus.schedules import build as b
    from torus.schedules import phases as ph
    from torus.sim import closed_form as cf
    from torus.sim import plans as sp
    return [
        Algorithm("ring", "ring, node by node (Patarasuk & Yuan 2009, JPDC 69(2), section 3)",
                  build=b.ring_plan, steps=cf.ring_steps, time=cf.ring_time, auto=True, sim_default=True,
                  orbit=sp.ring_orbit_of),
        # Its reduce-scatter and all-gather need nodes of equal runs of consecutive ranks: where they are not,
        # build.effective runs the ring instead (explicit there, not here: it depends on the topology).
        Algorithm("hierarchical", "node-local, leaders' ring across nodes, node-local (Mikami et al. 2018, "
                  "arXiv:1811.05233, section 3.2)", build=b.hierarchical_plan, node_level=ph.hierarchical_level,
                  phases=ph.hierarchical_phases, steps=cf.hierarchical_steps, time=cf.hierarchical_time, auto=True,
                  sim_default=True, orbit=sp.hierarchical_orbit),
        Algorithm("torus2d", "2D torus, rows then columns (Mikami et al. 2018, arXiv:1811.05233, section 3.2)",
                  build=b.torus2d_plan, node_level=ph.torus2d_level, phases=ph.torus2d_phases, steps=cf.torus2d_steps,
                  time=cf.torus2d_time, auto=True, sim_default=True, orbit=sp.torus2d_orbit),
        Algorithm("native", "MPI's own collective (MPI 4.0, chapter 6)", auto=True, simulated=False),
        Algorithm("shm", "the shared-memory transport, every rank on one node (torus/runtime/shm.py)", auto=True),
        Algorithm("swing", "Swing, bandwidth-optimal (De Sensi et al., NSDI'24, section 3)", build=b.swing_plan,
                  steps=cf.swing_steps, time=cf.swing_time, sim_default=True),
        # Serves the all-reduce only; build.effective maps its reduce-scatter and all-gather to swing's.
        Algorithm("swing_latency", "Swing, latency-optimal all-reduce (De Sensi et al., NSDI'24, section 3.1)",
                  collectives=("allreduce",), build=b.swing_latency_plan, steps=cf.swing_latency_steps,
                  time=cf.swing_latency_time,
                  auto=True),
    ]
