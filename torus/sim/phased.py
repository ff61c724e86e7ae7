"""Replay of a phased call (torus/schedules/phases.py): across nodes, what ``TorusComm`` runs with its
node-level phases over shared memory, each rank's phases built by the same ``phases.build`` on the layout's
topology, after the same ``effective`` fallback.

Phases run in order on every rank. The ranks' phase lists are aligned into stages (a rank with no phase at
a stage passes it: a hierarchical all-reduce's non-leaders skip the leaders' ring, a node of one rank has no
shared-memory phase). A stage of plans is ``replay.full`` over the ranks that have one, each starting when its
previous phase ended (a send still outstanding at a plan's end is waited for there, as the executor's
``CompiledPlan.tail``); a stage of shared-memory phases is ``sim/shm.ranks`` per communicator (the ranks of one
node, row or column), each rank entering at its own time, at the node-level transport's slot.

Statistics: ``msgs`` and ``sent`` count the plans' messages only (the shared-memory phases copy, they send
nothing); ``reduced`` counts both; the depth adds each shared-memory phase's flag steps.
"""
from __future__ import annotations

import numpy as np

from torus.partition import chunks
from torus.schedules import phases as phase_lists
from torus.schedules.build import effective
from torus.sim import replay, shm
from torus.sim.model import Cost, Layout, SimulationError


def _key(phase) -> tuple:
    return ("plan",) if isinstance(phase, phase_lists.Plan) else ("shm", phase.comm, phase.collective)


def build(algorithm: str, collective: str, layout: Layout, counts) -> dict | None:
    """{world rank: its phases} as TorusComm builds them with ``shm_phases`` on, or None where no rank's
    call is phased (one node, or no node-level phase of several ranks: the plain plan runs)."""
    t0 = layout.topology(0)  # node_level and effective are the same on every rank (whole-layout functions)
    if phase_lists.node_level(collective, effective(collective, algorithm, t0), t0) is None:
        return None
    out = {}
    for r in range(layout.N):
        t = layout.topology(r)
        out[r] = phase_lists.build(collective, effective(collective, algorithm, t), t, counts, True)
    return out


def stages(per_rank: dict) -> list[dict]:
    """The phases aligned: a list of {world rank: phase} (ranks without a phase at that stage absent), in the
    order of the longest list. Raises SimulationError when a rank's phases are not in that order."""
    canon = [_key(p) for p in max(per_rank.values(), key=len)]
    out: list[dict] = [{} for _ in canon]
    for r, mine in per_rank.items():
        i = 0
        for s, key in enumerate(canon):
            if i < len(mine) and _key(mine[i]) == key:
                out[s][r] = mine[i]
                i += 1
        if i != len(mine):
            raise SimulationError(f"torus-sim on rank {r}: its phases {[_key(p) for p in mine]} do not follow "
                                  f"the stages {canon}")
    return out


def replay_phases(per_rank: dict, layout: Layout, cost: Cost, itemsize: int):
    """Replay ``per_rank`` ({world rank: phases}). Returns ``(end, stats, tag_mismatches)`` as ``replay.full``:
    ``end`` {rank: (time, depth)}, ``stats`` per-rank arrays over ``range(layout.N)``."""
    N = layout.N
    clock = {r: (0.0, 0) for r in range(N)}
    st = {k: np.zeros(N) for k in ("msgs", "sent", "reduced", "inter")}
    mismatches = 0
    for stage in stages(per_rank):
        plans = {r: ph.steps for r, ph in stage.items() if isinstance(ph, phase_lists.Plan) and ph.steps}
        if plans:
            end, got, mism = replay.full(plans, layout, cost, itemsize, {r: clock[r] for r in plans})
            mismatches += mism
            ranks = sorted(plans)
            for k in st:
                st[k][ranks] += got[k]
            clock.update(end)
        groups: dict = {}
        for r, ph in stage.items():
            if isinstance(ph, phase_lists.Shm):
                groups.setdefault(layout.topology(r).members(ph.comm), []).append(r)
        for members, present in groups.items():
            if sorted(present) != sorted(members):
                missing = sorted(set(members) - set(present))
                raise SimulationError(f"torus-sim: ranks {missing} of the {stage[present[0]].comm} communicator "
                                      f"{list(members)} miss its shared-memory phase")
            ph = stage[members[0]]
            P = len(members)
            counts = ph.counts if ph.counts is not None else chunks(ph.inp[1] - ph.inp[0], P)[0]
            start = np.array([clock[m][0] for m in members])
            slot = shm.slot_bytes(cost, P, cost.shm_slot_bytes or shm.SEGMENT_BYTES)
            t, steps, _, reduced, _ = shm.ranks(ph.collective, counts, itemsize, cost, slot, start)
            depth = max(clock[m][1] for m in members) + steps
            for i, m in enumerate(members):
                clock[m] = (float(t[i]), depth)
                st["reduced"][m] += reduced[i]
    return clock, st, mismatches
