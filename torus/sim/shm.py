"""The shared-memory transport (``algorithm="shm"``, torus/runtime/shm.py) in the cost model: ranks on one node,
no messages, copies and flags.

What is priced is what ``src/_shm.pyx``'s ``run`` does on ``P`` ranks, step by step. A rank's window slot holds
``slot`` bytes (``Cost.segment_bytes`` rounded up to a multiple of ``64·P`` as the transport does; None: the
transport's default, ``SEGMENT_BYTES``); a reduction's step moves ``s = slot/P`` bytes of every chunk
(``partition.chunks``), an all-gather's ``slot`` bytes of this rank's block. Per step ``i``, on rank ``r`` with
``n_q`` bytes of chunk ``q`` in the step:

1. copy in: the peers' pieces (all-reduce, reduce-scatter: ``Σ_{q≠r} n_q``; all-gather: ``n_r``) at
   ``copy_beta`` s/B; for step 0 before the loop, for step ``i + 1`` during step ``i``, right after the
   reduction (the transport's overlap with the peers' reductions); ``copied`` is published at the start of
   the step, once the previous step's copy out is done;
2. join: wait until every peer has published, plus ``flag_alpha`` (a flag store seen by another core);
3. reduce the own piece from the ``P`` inputs: ``(P-1)·γ·n_r`` (γ per byte reduced, as ``reduce_into``; one
   rank alone copies it instead, ``copy_beta·n_r``); all-reduce: copy it out (block by block as it is
   reduced, ``copy_beta·n_r``), then publish ``reduced``;
4. copy out the peers' pieces, ``r+1, r+2, ...``, each at ``copy_beta``; all-reduce: a peer's piece only
   once its ``reduced`` is seen (its time plus ``flag_alpha``); all-gather: the join sufficed; reduce-scatter
   copies nothing.

An all-reduce of at most ``WHOLE_MAX_BYTES`` (and one slot) on ``P >= 2`` ranks takes the one-step path
instead: copy all ``M`` bytes in, join, reduce all of them from the ``P`` slots: ``call + b·M + a + (P-1)·γ·M``.

A call also pays ``call_alpha`` once (TorusComm's Python work around the step loop). ``replay`` runs these
per-rank clocks over every step (any count: uneven chunks, empty pieces skip their reduction and their wait);
``closed_form`` is the symmetric case (``P`` divides the count, every chunk a whole number ``S`` of steps):

- all-reduce: ``call + (P-1)·b·s + S·(a + (P-1)·γ·s + P·b·s) + (S-1)·max(a, (P-1)·b·s) + a``,
  ``s = slot/P``: after its reduction and own copy out a rank copies in the next step while the peers'
  ``reduced`` arrive, hence the ``max`` (the last step has no next copy in: it waits the whole ``a``);
- reduce-scatter: ``call + S·(a + (P-1)·(b + γ)·s)``;
- all-gather: ``call + S·(a + P·b·s)`` with ``s = slot``;

(``a = flag_alpha``, ``b = copy_beta``). Bytes: copied in ``(P-1)/P·M`` (all-gather ``M/P``), reduced
``(P-1)/P·M``, as the transport's docstring counts them. Flags on the critical path: 2 per step for an
all-reduce, 1 otherwise.

This follows ``run`` and ``run_whole`` step for step as they are now; a change to the protocol needs its
counterpart here and in the closed forms. Not modelled: ``run_window`` (``TorusComm.alloc`` buffers), and
waits when ranks outnumber cores (a scheduler hand-off, not a flag latency; bench/README.md).
"""
from __future__ import annotations

import numpy as np

from torus.partition import chunks
from torus.sim.model import Cost, Layout, SimulationError

SEGMENT_BYTES = 256 << 10  # torus.runtime.shm.SEGMENT_BYTES (not imported: the simulator needs no compiled code)
WHOLE_MAX_BYTES = 16 << 10  # torus.runtime.shm.WHOLE_MAX_BYTES: all-reduces up to it (and the slot) take one step


def slot_bytes(cost: Cost, P: int) -> int:
    """A rank's window slot as the transport sizes it: segment_bytes (or SEGMENT_BYTES) rounded up to 64·P."""
    line = 64 * P
    return -(-(cost.segment_bytes or SEGMENT_BYTES) // line) * line


def _constants(cost: Cost):
    b = cost.beta if cost.copy_beta is None else cost.copy_beta
    a = cost.alpha if cost.flag_alpha is None else cost.flag_alpha
    return a, b, cost.gamma, cost.call_alpha


def replay(collective: str, layout: Layout, count: int, itemsize: int, cost: Cost) -> tuple:
    """``(time, flag_steps, copied, reduced, flags)``: seconds until the last rank finishes, flags waited on in
    sequence, and per rank (arrays) bytes copied into the window, bytes reduced and flags published. Raises
    SimulationError unless every rank is on one node."""
    P = layout.N
    if layout.nodes != 1:
        raise SimulationError(f"torus-sim shm {collective}: shared memory serves one node; this layout has "
                              f"{layout.nodes}")
    a, b, g, call = _constants(cost)
    slot = slot_bytes(cost, P)
    counts = np.asarray(chunks(count, P)[0], np.int64)  # all-reduce chunks; reduce-scatter/all-gather blocks
    seg = slot // itemsize if collective == "allgather" else slot // P // itemsize
    nsteps = -(-int(counts.max(initial=0)) // seg)
    t = np.full(P, float(call) if count else 0.0)
    copied, reduced, flags = np.zeros(P), np.zeros(P), np.zeros(P)
    if collective == "allreduce" and P > 1 and 0 < count * itemsize <= min(WHOLE_MAX_BYTES, slot):
        M = count * itemsize  # one step: every rank copies all in, joins, reduces everything from the slots
        return float(call + b * M + a + (P - 1) * g * M), 1, np.full(P, float(M)), np.full(P, (P - 1.0) * M), \
            np.ones(P)
    ranks = np.arange(P)

    def piece(i):  # bytes of every chunk in step i, and what this rank copies in for it
        n = np.clip(counts - i * seg, 0, seg) * itemsize
        return n, (n if collective == "allgather" else n.sum() - n)

    if nsteps:
        inbytes = piece(0)[1]
        t = t + b * inbytes
        copied += inbytes
    for i in range(nsteps):
        n, _ = piece(i)
        done = t  # this step's input is in: copied published
        flags += 1
        # join: every peer's copied flag, seen flag_alpha after it was stored (one rank alone waits for none)
        first = int(np.argmax(done))
        others = np.full(P, done[first]) if P > 1 else np.full(P, -np.inf)
        if P > 1:
            others[first] = np.delete(done, first).max()
        join = np.maximum(done, others + a)
        if collective == "allgather":
            ready = join
        else:
            ready = join + np.where(n > 0, (P - 1) * g * n if P > 1 else b * n, 0.0)
            if collective == "allreduce":  # our own piece goes out as it is reduced, before ``reduced``
                ready = ready + b * n
            reduced += np.where(n > 0, (P - 1) * n, 0)
        if collective == "allreduce":
            flags += 1
        t = ready.copy()
        if i + 1 < nsteps:  # the next step's copy in, while the peers finish reducing this one
            inbytes = piece(i + 1)[1]
            t = t + b * inbytes
            copied += inbytes
        if collective == "reduce_scatter":
            continue
        for k in range(1, P):  # copy out chunk rank + k on every rank (our own is out already)
            q = (ranks + k) % P
            take = n[q] > 0
            if collective == "allreduce":
                t = np.where(take, np.maximum(t, ready[q] + a), t)
            t = t + np.where(take, b * n[q], 0.0)
    steps = nsteps * (2 if collective == "allreduce" else 1)
    return float(t.max(initial=0.0)), steps, copied, reduced, flags


def closed_form(collective: str, M: float, P: int, cost: Cost) -> float:
    """Seconds for the symmetric case (module docstring): ``M`` bytes in all, ``P >= 2`` ranks."""
    if P < 2:
        raise ValueError("torus-sim shm closed form: needs at least 2 ranks (one rank is replayed)")
    a, b, g, call = _constants(cost)
    slot = slot_bytes(cost, P)
    if collective == "allgather":
        return call + M / P / slot * (a + P * b * slot)
    s = slot / P
    S = M / P / s
    if collective == "reduce_scatter":
        return call + S * (a + (P - 1) * (b + g) * s)
    if M <= min(WHOLE_MAX_BYTES, slot):
        return call + b * M + a + (P - 1) * g * M
    return call + (P - 1) * b * s + S * (a + (P - 1) * g * s + P * b * s) + (S - 1) * max(a, (P - 1) * b * s) + a
