"""Causal replay of compiled plans under the α-β-γ model: every rank's steps, exactly (``full``), and the same
recurrence vectorized over ranks for step-aligned plans (``lockstep``).

What runs is what the executor runs: each rank's plan compiled by ``torus.runtime.compile.compile_plan`` (the
messages cut into its segments, each send given its deadline step), and the interpreter's order
(torus.runtime.interpreter): before step ``s`` a rank waits for the sends whose deadline is ``s``
(``_Step.retire``), then posts every receive and send of the step (and waits for those its reductions
overwrite: ``_Step.inner``); the step is over when its receives are in and reduced; after the last step it
waits for the remaining sends (``CompiledPlan.tail``).

Per-rank clocks. A segment leaves when both ends have posted it (``max`` of the sender's and the receiver's
step start) and its sender's port is free: each segment holds the port for ``β·b``, and a segment that
continues a message (the same channel as the segment before it in the step) also waits out that one's ``α``,
so a message of ``k`` segments arrives ``k·α + β·b`` after it started (model.py). A segment arrives
``α + β·b`` after it left; a receiver takes a step's segments in posting order, no faster than its port
(one ``β·b`` after another), and reduces each as it is waited for (``γ·b``, in that order). A send is complete
when it has arrived. Steps on the critical path: the longest chain of messages, each one step deeper than the
later of its two ends (a message's segments count once). Messages are matched per (communicator, sender,
receiver) in posting order, as MPI would with one tag per channel; the executor's own tag is the step index,
so a pair whose steps differ is counted in ``tag_mismatches`` (the executor would hang there).
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from torus.runtime.compile import TAG_MOD, CompiledPlan, compile_plan, segment_elements
from torus.sim.model import Cost, Layout, SimulationError

COMMS = dict.fromkeys(("world", "row", "col", "local", "cross"))  # the simulator's messages carry no MPI comm
UNSEGMENTED = 1 << 62  # segment_bytes when the cost model has none: every message is one segment


def _stats(n):
    return {k: np.zeros(n) for k in ("msgs", "sent", "reduced", "inter")}


def segment_bytes(cost: Cost) -> int:
    return UNSEGMENTED if cost.segment_bytes is None else cost.segment_bytes


def compile_all(plans: dict, cost: Cost, itemsize: int) -> dict:
    """{world rank: CompiledPlan} of ``plans`` ({world rank: [Step] or CompiledPlan}) at the cost model's
    segment size (a CompiledPlan is taken as it is)."""
    return {r: p if isinstance(p, CompiledPlan) else compile_plan(p, COMMS, segment_bytes(cost), itemsize)
            for r, p in plans.items()}


def match(compiled: dict, layout: Layout, window=None):
    """Pair every send segment of ``compiled`` ({world rank: CompiledPlan}) with its receive, over the steps
    ``window[rank] = (first, stop)`` of each (default all); a send whose deadline is past ``stop`` is waited
    for at the window's end.

    Returns ``(steps, sends, recvs, tag_mismatches)``: ``steps[r]`` is ``(per_step, retire)``, ``per_step[s] =
    (sends, recvs, inner)`` (inner: the sends its reductions wait for) and ``retire[s]`` the sends waited for
    before local step ``s`` (``retire[-1]``: at the end), all as ``(channel, k)`` keys into
    ``sends[channel][k] = (step, count)`` and ``recvs[channel][k] = (step, count, reduce)``.
    Raises SimulationError when a channel's sends and receives differ in number or size.
    """
    sends: defaultdict = defaultdict(list)
    recvs: defaultdict = defaultdict(list)
    steps = {}
    for r in sorted(compiled):
        plan = compiled[r]
        first, stop = (window or {}).get(r, (0, len(plan.steps)))
        mine = []
        retire: list = [[] for _ in range(stop - first + 1)]
        for s in range(first, stop):
            step = plan.steps[s]
            out, inc, inner = [], [], []
            for m in step.sends:
                key = (m.name, r, layout.world(r, m.name, m.peer))
                out.append((key, len(sends[key])))
                sends[key].append((s, m.hi - m.lo))
                if m.until == s:  # the step reduces into what it sends (compile.py: ``inner``)
                    inner.append(out[-1])
                else:
                    retire[min(m.until, stop) - first].append(out[-1])
            for m in step.recvs:
                key = (m.name, layout.world(r, m.name, m.peer), r)
                inc.append((key, len(recvs[key])))
                recvs[key].append((s, m.hi - m.lo, m.tmp_lo >= 0))
            mine.append((out, inc, inner))
        steps[r] = (mine, retire)
    mismatches = 0
    for key in set(sends) | set(recvs):
        a, b = sends.get(key, []), recvs.get(key, [])
        comm, src, dst = key
        if len(a) != len(b) or any(x[1] != y[1] for x, y in zip(a, b)):
            raise SimulationError(f"torus-sim on rank {dst}: the {len(b)} receives from rank {src} on the "
                                  f"{comm} communicator do not match its {len(a)} sends in number or size")
        mismatches += sum(x[0] % TAG_MOD != y[0] % TAG_MOD for x, y in zip(a, b))
    return steps, sends, recvs, mismatches


def full(plans: dict, layout: Layout, cost: Cost, itemsize: int, start=None, window=None):
    """Replay ``plans`` ({world rank: [Step]}, or their ``compile_all``), compiled as the executor compiles
    them; ``start`` {rank:
    (time, depth)} (default 0, 0); ``window`` {rank: (first, stop)}: replay only those steps (see ``match``).

    Returns ``(end, stats, tag_mismatches)``: ``end`` {rank: (time, depth)} once its last receive is in and
    its last send complete, ``stats`` per-rank arrays in the order of ``sorted(plans)``: messages (segments)
    and bytes sent, bytes reduced, bytes sent to other nodes.
    Raises SimulationError on unmatched or mis-sized messages and on deadlock.
    """
    ranks = sorted(plans)
    pos = {r: i for i, r in enumerate(ranks)}
    steps, sends, recvs, mismatches = match(compile_all(plans, cost, itemsize), layout, window)
    st = _stats(len(ranks))
    for (_, src, dst), lst in sends.items():
        if src not in pos or dst not in pos:
            raise SimulationError(f"torus-sim on rank {src}: sends to rank {dst}, which is not simulated")
        nbytes = sum(c for _, c in lst) * itemsize
        st["msgs"][pos[src]] += len(lst)
        st["sent"][pos[src]] += nbytes
        if layout.node(src) != layout.node(dst):
            st["inter"][pos[src]] += nbytes
    for (_, _, dst), lst in recvs.items():
        st["reduced"][pos[dst]] += sum(c for _, c, red in lst if red) * itemsize

    slow = _slowdowns(steps, layout) if cost.shared_links else {}
    start = start or {}
    clock = {r: [start.get(r, (0.0, 0))] for r in ranks}  # (time, depth) at the start of each step
    port = {r: clock[r][0][0] for r in ranks}  # when each rank's send port is free
    posted = {}  # (key, k) -> (arrival time, depth) of that segment, before the receive port

    def send_side(q, sq):
        """Price every send of rank q's step sq; False while one receiver has not reached its step."""
        tq, dq = clock[q][sq]
        done, free, prev = [], port[q], None
        for key, k in steps[q][0][sq][0]:
            dst = key[2]
            ds = recvs[key][k][0] - (window or {}).get(dst, (0, 0))[0]
            if len(clock[dst]) <= ds:
                return False
            tr, dr = clock[dst][ds]
            nbytes = sends[key][k][1] * itemsize
            crossing = layout.node(q) != layout.node(dst)
            alpha, beta = cost.link(crossing)
            if crossing:
                beta *= slow.get((key, k), 1.0)
            begin = max(tq, tr, free)
            if prev is not None and prev[0] == key:  # the next segment of the same message
                begin = max(begin, prev[1] + alpha + beta * prev[2])
            free, prev = begin + beta * nbytes, (key, begin, nbytes)
            done.append(((key, k), (begin + alpha + beta * nbytes, max(dq, dr) + 1)))
        posted.update(done)
        port[q] = free
        return True

    def advance(r) -> bool:
        per_step, retire = steps[r]
        s = len(clock[r]) - 1
        if s == len(per_step):
            return False
        out, inc, inner = per_step[s]
        t0, d0 = clock[r][s]
        if out and (out[0] not in posted) and not send_side(r, s):
            return False
        for key, k in inc:
            if (key, k) not in posted:
                src = key[1]
                ss = sends[key][k][0] - (window or {}).get(src, (0, 0))[0]
                if len(clock[src]) <= ss or not send_side(src, ss):
                    return False
        t_end, d_end, rport, red = t0, d0, t0, t0
        for msg in inner:  # waited for once posted, before any receive is reduced
            arrive, depth = posted[msg]
            t_end, d_end, red = max(t_end, arrive), max(d_end, depth), max(red, arrive)
        for key, k in inc:
            arrive, depth = posted[(key, k)]
            _, count, reduce = recvs[key][k]
            nbytes = count * itemsize
            crossing = layout.node(key[1]) != layout.node(r)
            _, beta = cost.link(crossing)
            if crossing:
                beta *= slow.get((key, k), 1.0)
            rport = max(arrive, rport + beta * nbytes)
            end = rport
            if reduce:
                red = max(red, rport) + cost.gamma * nbytes
                end = red
            t_end, d_end = max(t_end, end), max(d_end, depth)
        for msg in retire[s + 1]:  # the sends due before the next step (or at the end)
            arrive, depth = posted[msg]
            t_end, d_end = max(t_end, arrive), max(d_end, depth)
        clock[r].append((t_end, d_end))
        return True

    pending = list(ranks)
    while pending:
        moved = False
        for r in pending:
            while advance(r):
                moved = True
        pending = [r for r in pending if len(clock[r]) <= len(steps[r][0])]
        if pending and not moved:
            r = pending[0]
            raise SimulationError(f"torus-sim: deadlock, rank {r} cannot finish step {len(clock[r])} "
                                  f"of {len(steps[r][0])} ({len(pending)} ranks stuck)")
    return {r: clock[r][-1] for r in ranks}, st, mismatches


def _message(cost: Cost, count, itemsize: int, alpha, beta):
    """For messages of ``count`` elements (arrays) cut as compile_plan cuts them, sent on a free port to a
    posted receive: ``(segments, arrival, port_busy, exposed)``: seconds from the first segment leaving to
    the last arriving, until the sender's port is free, and of reduction after the last arrived (the
    closed form of ``full``'s per-segment recurrence)."""
    nbytes = count * itemsize
    if cost.segment_bytes is None:
        return np.ones_like(count), alpha + beta * nbytes, beta * nbytes, cost.gamma * nbytes
    seg = segment_elements(cost.segment_bytes, itemsize)
    k = np.maximum(1, -(-count // seg))
    S = seg * itemsize
    last = (count - (k - 1) * seg) * itemsize
    lead = (k - 1) * (alpha + beta * S)  # when the last segment leaves
    g = cost.gamma * S
    backlog = g + np.maximum(k - 2, 0) * np.maximum(0.0, g - (alpha + beta * S))  # reduction left at k-1
    exposed = np.where(k >= 2, cost.gamma * last + np.maximum(0.0, backlog - alpha - beta * last),
                       cost.gamma * nbytes)
    return k, lead + alpha + beta * last, lead + beta * last, exposed


def _slowdowns(steps, layout: Layout) -> dict:
    """{(channel, k): the factor on that segment's β} for the segments between nodes, over ``match``'s steps
    (each rank's local step indices, as the old per-node counts): the layout's network prices each
    (sim/network.py), the ranks crossing a link at one step sharing it."""
    send_at, recv_at = {}, {}
    for per_step, _ in steps.values():
        for s, (sent, received, _) in enumerate(per_step):
            for msg in sent:
                send_at[msg] = s
            for msg in received:
                recv_at[msg] = s
    msgs = [m for m in send_at if layout.node(m[0][1]) != layout.node(m[0][2])]
    if not msgs:
        return {}
    sender = np.array([m[0][1] for m in msgs], np.int64)
    receiver = np.array([m[0][2] for m in msgs], np.int64)
    factor = layout.network.slowdown(layout.nodes, layout.node(sender), layout.node(receiver), sender, receiver,
                                     [send_at[m] for m in msgs], [recv_at[m] for m in msgs])
    return dict(zip(msgs, factor.tolist()))


def _sharing(layout: Layout, node, src, crossing):
    """Per receiver: the factor on its message's β, 1 within a node; between nodes the ranks crossing a link
    at this step share it (sim/network.py: on a star, the busier of the sender's node link out and the
    receiver's in). On the emulated cluster two ranks of a host sending across at once each moved at half the
    rate (bench/across_hosts/README.md)."""
    out = np.ones(node.size)
    if crossing.any():
        dst = np.flatnonzero(crossing)
        zero = np.zeros(dst.size, np.int64)
        out[dst] = layout.network.slowdown(layout.nodes, node[src][dst], node[dst], src[dst], dst, zero, zero)
    return out


def lockstep(a, layout: Layout, cost: Cost, itemsize: int, t0=None, d0=None):
    """The same recurrence for step-aligned ``Arrays`` (a message sent at step ``s`` is received at step
    ``s``; at most one message each way per rank and step, so no port contention within a step; ``a.until``
    the deadline step of each send, as compile_plan sets it): one numpy pass per step. With ``cost.shared_links``
    the step's messages between nodes share the links they cross (``_sharing``), as in ``full``.

    Returns ``(time, depth, stats)``: per-rank end times and depths and the per-rank statistics of ``full``.
    Raises SimulationError when a send is not received at the same step.
    """
    n = a.world.size
    idx = np.arange(n)
    T = np.zeros(n) if t0 is None else np.asarray(t0, float).copy()
    D = np.zeros(n, np.int64) if d0 is None else np.asarray(d0, np.int64).copy()
    free = T.copy()  # each rank's send port
    due: dict = {}  # step -> (time, depth) per rank: completion of the sends due before that step
    node = layout.node(a.world)
    st = _stats(n)
    for s in range(a.nsteps):
        if s in due:
            t, d = due.pop(s)
            T, D = np.maximum(T, t), np.maximum(D, d)
        rp, rb, rr, sp, sb = a.row(s)
        out, has = sp >= 0, rp >= 0
        dst, src = np.where(out, sp, idx), np.where(has, rp, idx)
        if np.any(out & ((rp[dst] != idx) | (rb[dst] != sb))):
            i = np.argmax(out & ((rp[dst] != idx) | (rb[dst] != sb)))
            raise SimulationError(f"torus-sim on rank {a.world[i]}: its send at step {s} is not received at "
                                  "that step; the plan is not step-aligned")
        nbytes = rb * itemsize
        crossing = has & (node[src] != node)
        alpha, beta = cost.link(crossing)
        if cost.shared_links:
            beta = beta * _sharing(layout, node, src, crossing)
        k, transfer, busy, exposed = _message(cost, rb, itemsize, alpha, beta)
        begin = np.maximum.reduce([T[src], T, free[src]])  # per receiver: its message's first segment leaves
        arrive = begin + transfer
        done = np.where(rr, arrive + exposed, arrive)
        depth = np.maximum(D[src], D) + 1
        free = np.where(out, (begin + busy)[dst], free)
        until = a.deadline(s)
        if np.any(out & (until == s)):
            raise SimulationError(f"torus-sim on rank {a.world[np.argmax(out & (until == s))]}: step {s} reduces "
                                  "into what it sends; only the per-rank replay (full) orders that")
        for u in np.unique(until[out]):
            t, d = due.setdefault(int(u), (np.full(n, -np.inf), np.zeros(n, np.int64)))
            mine = out & (until == u)
            t[mine] = np.maximum(t[mine], arrive[dst][mine])
            d[mine] = np.maximum(d[mine], depth[dst][mine])
        T = np.where(has, np.maximum(T, done), T)
        D = np.where(has, np.maximum(D, depth), D)
        st["msgs"] += np.where(out, k[dst], 0)
        st["sent"] += sb * itemsize
        st["reduced"] += np.where(rr & has, nbytes, 0)
        st["inter"] += np.where(out & (node[dst] != node), sb * itemsize, 0)
    t, d = due.pop(a.nsteps, (T, D))
    return np.maximum(T, t), np.maximum(D, d), st
