"""Causal replay of plans under the α-β-γ model: every rank's steps, exactly (``full``), and the same
recurrence vectorized over ranks for step-aligned plans (``lockstep``).

Per-rank clocks. A rank starts step ``s`` when it finished step ``s-1``; it posts every receive and send of the
step then. A message leaves when both ends have posted it (``max`` of the sender's and the receiver's step
start) and after the sender's earlier sends of the same step have been injected (one send port: ``β·b`` each);
it arrives ``k·α + β·b`` later (``k`` segments), and a receiver's messages of one step arrive no faster than its
receive port takes them (one ``β·b`` after another). A reducing receive then costs the exposed reduction time
(see model.py), reductions of one step in arrival order. A step ends when its receives are reduced and its
sends have arrived (the executor waits for its sends). Steps on the critical path: the longest chain of
messages, each one step deeper than the later of its two ends. Messages are matched per (communicator,
sender, receiver) in posting order, as MPI would with one tag per channel; the executor's own tag is the
step index, so a pair whose steps differ is counted in ``tag_mismatches`` (the executor would hang there).
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from torus.runtime.compile import TAG_MOD
from torus.sim.model import Cost, Layout, SimulationError


def _stats(n):
    return {k: np.zeros(n) for k in ("msgs", "sent", "reduced", "inter")}


def match(plans: dict, layout: Layout):
    """Pair every send of ``plans`` ({world rank: [Step]}) with its receive.

    Returns ``(steps, sends, recvs, tag_mismatches)``: ``steps[r][s] = (sends, recvs)`` as ``(channel, k)``
    keys into ``sends[channel][k] = (step, count)`` and ``recvs[channel][k] = (step, count, reduce)``.
    Raises SimulationError when a channel's sends and receives differ in number or size.
    """
    sends: defaultdict = defaultdict(list)
    recvs: defaultdict = defaultdict(list)
    steps = {}
    for r in sorted(plans):
        mine = []
        for s, step in enumerate(plans[r]):
            out, inc = [], []
            for m in step.sends:
                if m.count:
                    key = (m.comm, r, layout.world(r, m.comm, m.peer))
                    out.append((key, len(sends[key])))
                    sends[key].append((s, m.count))
            for m in step.recvs:
                if m.count:
                    key = (m.comm, layout.world(r, m.comm, m.peer), r)
                    inc.append((key, len(recvs[key])))
                    recvs[key].append((s, m.count, m.reduce))
            mine.append((out, inc))
        steps[r] = mine
    mismatches = 0
    for key in set(sends) | set(recvs):
        a, b = sends.get(key, []), recvs.get(key, [])
        comm, src, dst = key
        if len(a) != len(b) or any(x[1] != y[1] for x, y in zip(a, b)):
            raise SimulationError(f"torus-sim on rank {dst}: the {len(b)} receives from rank {src} on the "
                                  f"{comm} communicator do not match its {len(a)} sends in number or size")
        mismatches += sum(x[0] % TAG_MOD != y[0] % TAG_MOD for x, y in zip(a, b))
    return steps, sends, recvs, mismatches


def full(plans: dict, layout: Layout, cost: Cost, itemsize: int, start=None):
    """Replay ``plans`` ({world rank: [Step]}); ``start`` {rank: (time, depth)} (default 0, 0).

    Returns ``(end, stats, tag_mismatches)``: ``end`` {rank: (time, depth)}, ``stats`` per-rank arrays in the
    order of ``sorted(plans)``: messages and bytes sent, bytes reduced, bytes sent to other nodes.
    Raises SimulationError on unmatched or mis-sized messages and on deadlock.
    """
    ranks = sorted(plans)
    pos = {r: i for i, r in enumerate(ranks)}
    steps, sends, recvs, mismatches = match(plans, layout)
    st = _stats(len(ranks))
    for (_, src, dst), lst in sends.items():
        if dst not in pos:
            raise SimulationError(f"torus-sim on rank {src}: sends to rank {dst}, which is not simulated")
        nbytes = sum(c for _, c in lst) * itemsize
        st["msgs"][pos[src]] += len(lst)
        st["sent"][pos[src]] += nbytes
        if layout.node(src) != layout.node(dst):
            st["inter"][pos[src]] += nbytes
    for (_, _, dst), lst in recvs.items():
        st["reduced"][pos[dst]] += sum(c for _, c, red in lst if red) * itemsize

    start = start or {}
    clock = {r: [start.get(r, (0.0, 0))] for r in ranks}  # (time, depth) at the start of each step
    posted = {}  # (key, k) -> (arrival time, depth) of that message, before the receive port
    def send_side(q, sq):
        """Price every send of rank q's step sq; False while one receiver has not reached its step."""
        tq, dq = clock[q][sq]
        free, done = tq, []
        for key, k in steps[q][sq][0]:
            dst = key[2]
            ds = recvs[key][k][0]
            if len(clock[dst]) <= ds:
                return False
            tr, dr = clock[dst][ds]
            nbytes = sends[key][k][1] * itemsize
            alpha, beta = cost.link(layout.node(q) != layout.node(dst))
            begin = max(tq, tr, free)
            free = begin + beta * nbytes
            done.append(((key, k), (begin + cost.transfer(nbytes, alpha, beta), max(dq, dr) + 1)))
        posted.update(done)
        return True

    def advance(r) -> bool:
        s = len(clock[r]) - 1
        if s == len(steps[r]):
            return False
        out, inc = steps[r][s]
        t0, d0 = clock[r][s]
        if out and (out[0] not in posted) and not send_side(r, s):
            return False
        for key, k in inc:
            if (key, k) not in posted:
                src = key[1]
                ss = sends[key][k][0]
                if len(clock[src]) <= ss or not send_side(src, ss):
                    return False
        t_end, d_end, port, red = t0, d0, t0, t0
        for key, k in inc:
            arrive, depth = posted[(key, k)]
            _, count, reduce = recvs[key][k]
            nbytes = count * itemsize
            alpha, beta = cost.link(layout.node(key[1]) != layout.node(r))
            port = max(arrive, port + beta * nbytes)
            end = port
            if reduce:
                red = max(red, port) + float(cost.reduce_exposed(nbytes, alpha, beta))
                end = red
            t_end, d_end = max(t_end, end), max(d_end, depth)
        for msg in out:
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
        pending = [r for r in pending if len(clock[r]) <= len(steps[r])]
        if pending and not moved:
            r = pending[0]
            raise SimulationError(f"torus-sim: deadlock, rank {r} cannot finish step {len(clock[r])} "
                                  f"of {len(steps[r])} ({len(pending)} ranks stuck)")
    return {r: clock[r][-1] for r in ranks}, st, mismatches


def lockstep(a, layout: Layout, cost: Cost, itemsize: int, t0=None, d0=None):
    """The same recurrence for step-aligned ``Arrays`` (a message sent at step ``s`` is received at step
    ``s``; at most one message each way per rank and step, so no port contention): one numpy pass per step.

    Returns ``(time, depth, stats)``: per-rank end times and depths and the per-rank statistics of ``full``.
    Raises SimulationError when a send is not received at the same step.
    """
    n = a.world.size
    idx = np.arange(n)
    T = np.zeros(n) if t0 is None else np.asarray(t0, float).copy()
    D = np.zeros(n, np.int64) if d0 is None else np.asarray(d0, np.int64).copy()
    node = layout.node(a.world)
    st = _stats(n)
    for s in range(a.nsteps):
        rp, rb, rr, sp, sb = a.row(s)
        out, has = sp >= 0, rp >= 0
        dst, src = np.where(out, sp, idx), np.where(has, rp, idx)
        if np.any(out & ((rp[dst] != idx) | (rb[dst] != sb))):
            i = np.argmax(out & ((rp[dst] != idx) | (rb[dst] != sb)))
            raise SimulationError(f"torus-sim on rank {a.world[i]}: its send at step {s} is not received at "
                                  "that step; the plan is not step-aligned")
        nbytes = rb * itemsize
        alpha, beta = cost.link(node[src] != node)
        arrive = np.maximum(T[src], T) + cost.transfer(nbytes, alpha, beta)
        done = np.where(rr, arrive + cost.reduce_exposed(nbytes, alpha, beta), arrive)
        depth = np.maximum(D[src], D) + 1
        T = np.maximum.reduce([T, np.where(has, done, T), np.where(out, arrive[dst], T)])
        D = np.maximum.reduce([D, np.where(has, depth, D), np.where(out, depth[dst], D)])
        st["msgs"] += out
        st["sent"] += sb * itemsize
        st["reduced"] += np.where(rr & has, nbytes, 0)
        st["inter"] += np.where(out & (node[dst] != node), sb * itemsize, 0)
    return T, D, st
