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
from torus.sim import plans as P
from torus.sim import replay, shm
from torus.sim.model import Cost, Layout, SimulationError

LOCKSTEP_MIN_RANKS = 65  # a plan stage of this many ranks or more replays as one numpy pass per step


def _key(phase) -> tuple:
    return ("plan",) if isinstance(phase, phase_lists.Plan) else ("shm", phase.comm, phase.collective)


def build(algorithm: str, collective: str, layout: Layout, counts, itemsize: int,
          latency_bytes: int | None = None) -> dict | None:
    """{world rank: its phases} as TorusComm builds them with ``shm_phases`` on, or None where no rank's
    call is phased (one node, or no node-level phase of several ranks: the plain plan runs); ``latency_bytes``
    as for ``effective``."""
    t0 = layout.topology(0)  # node_level and effective are the same on every rank (whole-layout functions)
    nbytes = (counts if isinstance(counts, int) else sum(counts)) * itemsize
    if phase_lists.node_level(collective, effective(collective, algorithm, t0, nbytes, latency_bytes), t0) is None:
        return None
    out = {}
    for r in range(layout.N):
        t = layout.topology(r)
        algo = effective(collective, algorithm, t, nbytes, latency_bytes)
        out[r] = phase_lists.build(collective, algo, t, counts, True)
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
            ranks = sorted(plans)
            got = _lockstep(plans, layout, cost, itemsize, clock) if len(plans) >= LOCKSTEP_MIN_RANKS else None
            if got is None:
                end, got, mism = replay.full(plans, layout, cost, itemsize, {r: clock[r] for r in plans})
                mismatches += mism
                clock.update(end)
            for k in st:
                st[k][ranks] += got[k]
        groups: dict = {}
        seen: dict = {}
        for r, ph in stage.items():
            if isinstance(ph, phase_lists.Shm):
                groups.setdefault(layout.topology(r).members(ph.comm), []).append(r)
        for members, present in groups.items():
            if sorted(present) != sorted(members):
                missing = sorted(set(members) - set(present))
                raise SimulationError(f"torus-sim: ranks {missing} of the {stage[present[0]].comm} communicator "
                                      f"{list(members)} miss its shared-memory phase")
            ph = stage[members[0]]
            n = len(members)
            counts = tuple(ph.counts if ph.counts is not None else chunks(ph.inp[1] - ph.inp[0], n)[0])
            start = np.array([clock[m][0] for m in members])
            # shm.ranks only adds and takes maxima: nodes entering alike (up to a shift) share one replay
            key = (ph.collective, counts, tuple((start - start.min()).tolist()))
            if key not in seen:
                slot = shm.slot_bytes(cost, n, cost.shm_slot_bytes or shm.SEGMENT_BYTES)
                t, steps, _, reduced, _ = shm.ranks(ph.collective, counts, itemsize, cost, slot,
                                                    start - start.min())
                seen[key] = (t, steps, reduced)
            t, steps, reduced = seen[key]
            t = t + start.min()
            depth = max(clock[m][1] for m in members) + steps
            for i, m in enumerate(members):
                clock[m] = (float(t[i]), depth)
                st["reduced"][m] += reduced[i]
    return clock, st, mismatches


def _lockstep(plans: dict, layout: Layout, cost: Cost, itemsize: int, clock: dict):
    """A stage of step-aligned plans (at most one message each way per rank and step, received at the step
    it is sent: the rings of every phased call) by ``replay.lockstep`` over the ranks that have one, from
    each rank's real plan and its sends' deadlines; ``clock`` updated, the stage's statistics returned. None
    where the plans are not step-aligned (``replay.full`` then)."""
    ranks = sorted(plans)
    index = {r: i for i, r in enumerate(ranks)}
    S = max(len(p) for p in plans.values())
    a = P.empty(S, len(ranks), ranks)
    seg = replay.segment_bytes(cost)
    try:
        for i, r in enumerate(ranks):
            steps = plans[r]
            for s, row in enumerate(P.extract(steps, r, layout, index.__getitem__, "phased stage")):
                a.rp[s, i], a.rb[s, i], a.rr[s, i], a.sp[s, i], a.sb[s, i] = row
            due = _deadlines(steps)
            for s, u in enumerate(P.deadlines(steps, itemsize, seg) if due is None else due):
                if u is not None:
                    a.until[s, i] = S if u == len(steps) else u
        T, D, got = replay.lockstep(a, layout, cost, itemsize, [clock[r][0] for r in ranks],
                                    [clock[r][1] for r in ranks])
    except (KeyError, SimulationError):  # a peer outside the stage, several messages, or not aligned
        return None
    for i, r in enumerate(ranks):
        clock[r] = (float(T[i]), int(D[i]))
    return got


def _deadlines(steps) -> list | None:
    """compile_plan's send deadlines (as ``plans.deadlines``) for a plan whose regions are each either the
    same as or disjoint from every other (a ring's chunks), without compiling it: a send is due at the next
    later step that writes its region (its own, where it reduces into it), whatever the segment size, as
    every element of it is next written there. None where two regions overlap in part (then compile)."""
    regions = sorted({(m.offset, m.offset + m.count) for st in steps for m in (*st.sends, *st.recvs) if m.count}
                     | {(st.scale.offset, st.scale.offset + st.scale.count) for st in steps
                        if st.scale is not None and st.scale.count})
    if any(b[0] < a[1] for a, b in zip(regions, regions[1:])):
        return None
    nxt: dict = {}
    out: list = [None] * len(steps)
    for s in range(len(steps) - 1, -1, -1):
        st = steps[s]
        sends = [(m.offset, m.offset + m.count) for m in st.sends if m.count]
        if sends:
            own = {(m.offset, m.offset + m.count) for m in st.recvs if m.count and m.reduce}
            due = {s if r in own else nxt.get(r, len(steps)) for r in sends}
            if len(due) > 1:
                return None
            out[s] = due.pop()
        for m in st.recvs:
            if m.count:
                nxt[(m.offset, m.offset + m.count)] = s
        if st.scale is not None and st.scale.count:
            nxt[(st.scale.offset, st.scale.offset + st.scale.count)] = s
    return out
