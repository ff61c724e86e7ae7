"""The shared-memory transport (``algorithm="shm"``, torus/runtime/shm.py) in the cost model: ranks on one node,
no messages, copies and flags.

What is priced is what ``src/_shm.pyx``'s ``run``, ``run_whole`` and ``run_window`` do on ``P`` ranks, step by
step: per step a copy in of the peers' pieces (``copy_beta`` s/B), a join on the peers' flags
(``flag_alpha``), the reduction of this rank's piece (``(P-1)·γ`` per byte), the copy out; a call pays
``call_alpha`` once. ``replay`` runs these per-rank clocks over every step (any count); ``closed_form`` is the
symmetric case. In-place all-reduces of ``TorusComm.alloc`` buffers copy between whole buffers at
``window_beta``.

A change to the protocol needs its counterpart here and in the closed forms. The model step by step, the
closed forms, why ``window_beta`` and what is not modelled: docs/performance.md, "The shm transport in the
model".
"""
from __future__ import annotations

import numpy as np

from torus.partition import chunks
from torus.sim.model import Cost, Layout, SimulationError

SEGMENT_BYTES = 256 << 10  # torus.runtime.shm.SEGMENT_BYTES (not imported: the simulator needs no compiled code)
WHOLE_MAX_BYTES = 16 << 10  # torus.runtime.shm.WHOLE_MAX_BYTES: all-reduces up to it (and the slot) take one step


def slot_bytes(cost: Cost, P: int, nbytes: int | None = None) -> int:
    """A rank's window slot as the transport sizes it: ``nbytes`` (default segment_bytes; None: SEGMENT_BYTES)
    rounded up to 64·P."""
    line = 64 * P
    return -(-((cost.segment_bytes if nbytes is None else nbytes) or SEGMENT_BYTES) // line) * line


def _constants(cost: Cost):
    b = cost.beta if cost.copy_beta is None else cost.copy_beta
    a = cost.alpha if cost.flag_alpha is None else cost.flag_alpha
    return a, b, cost.gamma, cost.call_alpha


def _window_beta(cost: Cost) -> float:
    b = _constants(cost)[1]
    return b if cost.window_beta is None else cost.window_beta


def _one_node(what: str, layout: Layout) -> None:
    if layout.nodes != 1:
        raise SimulationError(f"torus-sim shm {what}: shared memory serves one node; this layout has "
                              f"{layout.nodes} (on the command line: --ranks-per-node {layout.N})")


def _join(done: np.ndarray, a: float) -> np.ndarray:
    """When each rank has seen every peer's flag stored at ``done`` (one rank alone waits for none)."""
    P = done.size
    if P == 1:
        return done.copy()
    first = int(np.argmax(done))
    others = np.full(P, done[first])
    others[first] = np.delete(done, first).max()
    return np.maximum(done, others + a)


def replay(collective: str, layout: Layout, count: int, itemsize: int, cost: Cost) -> tuple:
    """``(time, flag_steps, copied, reduced, flags)``: seconds until the last rank finishes, flags waited on in
    sequence, and per rank (arrays) bytes copied into the window, bytes reduced and flags published. Raises
    SimulationError unless every rank is on one node."""
    _one_node(collective, layout)
    P = layout.N
    end, steps, copied, reduced, flags = ranks(collective, chunks(count, P)[0], itemsize, cost,
                                               slot_bytes(cost, P), np.zeros(P))
    return float(end.max(initial=0.0)), steps, copied, reduced, flags


def ranks(collective: str, counts, itemsize: int, cost: Cost, slot: int, start) -> tuple:
    """``replay`` on ``len(counts)`` ranks of one node that enter the call at ``start`` (seconds, per rank):
    ``(end, flag_steps, copied, reduced, flags)``, ``end`` per rank. ``counts``: elements per rank's chunk (an
    all-reduce's; blocks of a reduce-scatter or all-gather, zeros allowed: the broadcast of a phased
    hierarchical all-reduce is an all-gather with one block); ``slot``: the window slot in bytes."""
    counts = np.asarray(counts, np.int64)
    P = counts.size
    a, b, g, call = _constants(cost)
    count = int(counts.sum())
    seg = slot // itemsize if collective == "allgather" else slot // P // itemsize
    nsteps = -(-int(counts.max(initial=0)) // seg)
    t = np.asarray(start, float) + (call if count else 0.0)
    copied, reduced, flags = np.zeros(P), np.zeros(P), np.zeros(P)
    if collective == "allreduce" and P > 1 and 0 < count * itemsize <= min(WHOLE_MAX_BYTES, slot):
        M = count * itemsize  # one step: every rank copies all in, joins, reduces everything from the slots
        return _join(t + b * M, a) + (P - 1) * g * M, 1, np.full(P, float(M)), np.full(P, (P - 1.0) * M), \
            np.ones(P)
    idx = np.arange(P)

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
        join = _join(done, a)  # every peer's copied flag, seen flag_alpha after it was stored
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
            q = (idx + k) % P
            take = n[q] > 0
            if collective == "allreduce":
                t = np.where(take, np.maximum(t, ready[q] + a), t)
            t = t + np.where(take, b * n[q], 0.0)
    steps = nsteps * (2 if collective == "allreduce" else 1)
    return t, steps, copied, reduced, flags


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


def replay_window(layout: Layout, count: int, itemsize: int, cost: Cost) -> tuple:
    """``replay``'s tuple for the in-place all-reduce of a ``TorusComm.alloc`` buffer (``run_window``, module
    docstring), ``count`` elements of ``itemsize`` bytes; ``copied``: bytes each rank copies from the peers'
    buffers into its own. Raises SimulationError unless every rank is on one node."""
    P = layout.N
    _one_node("allreduce of an alloc buffer", layout)
    a, _, g, call = _constants(cost)
    w = _window_beta(cost)
    n = np.asarray(chunks(count, P)[0], np.int64) * itemsize
    ranks = np.arange(P)
    t = _join(np.full(P, float(call)), a)  # copied published on entry: the buffer is the input
    reduced_at = t + (P - 1) * g * n  # every peer's pass over our chunk, in place
    t = reduced_at
    for k in range(1, P):  # chunk rank + k once its owner's reduced is seen, empty ones too
        q = (ranks + k) % P
        t = np.maximum(t, reduced_at[q] + a) + w * n[q]
    t = _join(t, a)  # the closing copied: every peer is done reading our buffer
    copied = (n.sum() - n).astype(float)
    return float(t.max()), 3 if P > 1 else 0, copied, ((P - 1) * n).astype(float), np.full(P, 3.0)


def closed_form_window(M: float, P: int, cost: Cost) -> float:
    """Seconds of ``replay_window`` in the symmetric case (``P`` divides the count): ``M`` bytes, ``P`` ranks."""
    a, _, g, call = _constants(cost)
    return call + (3 * a if P > 1 else 0.0) + (P - 1) / P * M * (g + _window_beta(cost))
