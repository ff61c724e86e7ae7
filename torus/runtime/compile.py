"""Compiling a plan (torus.schedules.plan) once into what the step interpreter, the C step loop and the
simulator all run: every message cut into segments of at most ``segment_bytes`` (element ranges of the
working buffer), each reducing receive given its place in scratch, and each send its deadline.

Deadlines: a send is waited for only before the first later step that writes its region (or at the end):
waiting at the end of its own step would make each rank wait for its right neighbour to receive before it may
receive from its left, a chain of handshakes that costs a scheduler round trip per step when ranks outnumber
cores. A step may reduce into a region it also sends (Swing's latency-optimal all-reduce exchanges the whole
buffer at every step): those sends are the step's ``inner`` ones, waited for once the step's messages are
posted and before its receives are reduced, since a reduction must not write what a send still reads.

Out of place (the interpreter's ``src``) nothing is copied up front: a send reads ``src`` while its region is
still untouched in the working buffer (``fresh``), and the first reduction into a region reads ``src`` and
writes the buffer in one pass. ``compile_plan`` works out which messages those are, which regions a step must copy
first (a message that straddles touched and untouched elements: ``prefill``) and which regions no step ever
writes (``untouched``, copied at the end). For device buffers it marks, per send, the regions the host mirror
does not hold yet (``stage``).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, replace

from torus.partition import segments

TAG_MOD = 32767  # MPI guarantees tags up to at least 32767; a message's tag is its step index modulo this


@dataclass(frozen=True)
class _Message:
    comm: object  # the MPI communicator (None in the simulator)
    name: str  # communicator name, for error messages
    peer: int
    lo: int  # element range in the working buffer
    hi: int
    tmp_lo: int = -1  # element range in scratch for a reducing receive, -1 otherwise
    final: bool = False
    fresh: bool = False  # out of place: the region is untouched so far, so read it from src
    until: int = 0  # a send: the step that next writes its region, so the send must complete before it
    stage: tuple = ()  # a send from device memory: (lo, hi) ranges to copy to the host mirror first
    sid: int = -1  # a send: its index among all sends of the plan (run's table of requests)


@dataclass(frozen=True)
class _Step:
    recvs: tuple
    sends: tuple
    scratch: int  # elements of scratch the reducing receives need
    scale: tuple | None  # (lo, hi) to scale when no reduce completed the owner's region
    prefill: tuple = ()  # out of place: (lo, hi) regions to copy from src before this step
    retire: tuple = ()  # sends (``sid``) whose deadline is this step: wait for them before it starts
    inner: tuple = ()  # sends (``sid``) of this step that its reductions overwrite: wait before reducing


@dataclass(frozen=True)
class CompiledPlan:
    steps: tuple
    itemsize: int
    scratch: int
    untouched: tuple = ()  # out of place: (lo, hi) regions no step writes, copied from src at the end
    sends: tuple = ()  # every send, by ``sid``: (step, message), for the requests' table and error messages
    tail: tuple = ()  # sends no step waits for: waited for at the end
    table: tuple | None = None  # the C step loop's arrays (c_step_loop.table), when it is used


class _Touched:
    """The element ranges of ``buf`` written so far, as sorted disjoint ``[lo, hi)`` intervals."""

    def __init__(self):
        self.spans: list = []

    def gaps(self, lo: int, hi: int) -> list:
        """The parts of ``[lo, hi)`` not written yet."""
        out = []
        for a, b in self.spans:
            if b <= lo or a >= hi:
                continue
            if a > lo:
                out.append((lo, a))
            lo = max(lo, b)
        if lo < hi:
            out.append((lo, hi))
        return out

    def add(self, lo: int, hi: int) -> None:
        if lo >= hi:
            return
        keep = [(a, b) for a, b in self.spans if b < lo or a > hi]
        merged = [(a, b) for a, b in self.spans if not (b < lo or a > hi)]
        lo = min([lo] + [a for a, _ in merged])
        hi = max([hi] + [b for _, b in merged])
        self.spans = sorted(keep + [(lo, hi)])

    def remove(self, lo: int, hi: int) -> None:
        out = []
        for a, b in self.spans:
            if b <= lo or a >= hi:
                out.append((a, b))
                continue
            if a < lo:
                out.append((a, lo))
            if b > hi:
                out.append((hi, b))
        self.spans = out


def _fresh(touched: _Touched, lo: int, hi: int, prefill: list) -> bool:
    """True when ``[lo, hi)`` is wholly untouched (read it from src). A region partly touched gets its
    untouched parts copied before the step (``prefill``) and counts as touched from then on."""
    gaps = touched.gaps(lo, hi)
    if gaps == [(lo, hi)]:
        return True
    for a, b in gaps:
        prefill.append((a, b))
        touched.add(a, b)
    return False


def _own_writes(step: _Step) -> list:
    """The sorted, merged ``[lo, hi)`` spans that ``step``'s reducing receives write."""
    out: list = []
    for lo, hi in sorted((m.lo, m.hi) for m in step.recvs if m.hi > m.lo and m.tmp_lo >= 0):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _overlaps(spans: list, lo: int, hi: int) -> bool:
    i = bisect_left(spans, (hi,))  # spans starting before hi: the last of them is the only candidate
    return lo < hi and i > 0 and spans[i - 1][1] > lo


def _deadlines(steps: list) -> tuple:
    """Set each send's ``until`` (the first later step that writes, i.e. receives into, reduces into or
    scales, any element the send reads from buf, or ``len(steps)``; reading the same region again is no
    conflict; its own step where that step reduces into it) and its ``sid``, and give each step the sends
    to wait for before it (``retire``) and before its reductions (``inner``).
    Returns (steps, every send as (step, message), the sends left for the end).

    One backward pass over the steps keeps, per elementary interval of the buffer (cut at every message
    boundary), the next step that writes it: linear in the messages for a ring plan, not quadratic."""
    writes = []
    for st in steps:
        spans = [(m.lo, m.hi) for m in st.recvs if m.hi > m.lo]
        if st.scale is not None and st.scale[1] > st.scale[0]:
            spans.append(st.scale)
        writes.append(spans)
    cuts = sorted({b for st in steps for m in st.sends for b in (m.lo, m.hi)}
                  | {b for spans in writes for span in spans for b in span})
    nxt = [len(steps)] * len(cuts)  # nxt[j]: the next step that writes [cuts[j], cuts[j + 1])
    untils: list = [()] * len(steps)
    for si in range(len(steps) - 1, -1, -1):
        untils[si] = tuple(min(nxt[bisect_left(cuts, m.lo):bisect_left(cuts, m.hi)], default=len(steps))
                           for m in steps[si].sends)
        for lo, hi in writes[si]:
            a, b = bisect_left(cuts, lo), bisect_left(cuts, hi)
            nxt[a:b] = [si] * (b - a)
    out: list = []
    every: list = []
    retire: list = [[] for _ in range(len(steps) + 1)]
    for si, st in enumerate(steps):
        sends: list = []
        inner: list = []
        own = _own_writes(st) if st.sends else []
        for m, until in zip(st.sends, untils[si]):
            if own and _overlaps(own, m.lo, m.hi):
                until = si
            m = replace(m, until=until, sid=len(every))
            (inner if until == si else retire[until]).append(m.sid)
            every.append((si, m))
            sends.append(m)
        out.append(replace(st, sends=tuple(sends), inner=tuple(inner)))
    out = [replace(st, retire=tuple(retire[si])) for si, st in enumerate(out)]
    return out, tuple(every), tuple(retire[len(steps)])


def segment_elements(segment_bytes: int, itemsize: int) -> int:
    """Elements per segment: the most that fit in ``segment_bytes``, at least one."""
    return max(1, segment_bytes // itemsize)


def compile_plan(plan, comms: dict, segment_bytes: int, itemsize: int, count: int | None = None,
            table=None) -> CompiledPlan:
    """Cut every message of ``plan`` into segments of at most ``segment_bytes``; ``count`` (elements of
    the working buffer, default: the plan's extent) bounds the regions an out-of-place run copies at the
    end because no step writes them. ``comms`` maps communicator names to the objects messages carry
    (MPI communicators; anything, e.g. None, for the simulator). ``table(steps, itemsize, tail)``, if
    given, builds the C step loop's arrays once, here."""
    seg = segment_elements(segment_bytes, itemsize)
    steps, touched, extent = [], _Touched(), 0
    mirrored = _Touched()  # device buffers: where the host mirror holds the device's current bytes
    for step in plan:
        prefill: list = []
        if step.scale is not None:
            lo, hi = step.scale.offset, step.scale.offset + step.scale.count
            prefill = touched.gaps(lo, hi)  # scaling happens in buf: bring the input there first
            touched.add(lo, hi)
            mirrored.remove(lo, hi)
            extent = max(extent, hi)
            steps.append(_Step((), (), 0, (lo, hi), tuple(prefill)))
            continue
        sends = []
        for s in step.sends:
            for o, c in segments(s.offset, s.count, seg):
                fresh = c > 0 and _fresh(touched, o, o + c, prefill)
                stage = tuple(mirrored.gaps(o, o + c))
                mirrored.add(o, o + c)
                sends.append(_Message(comms[s.comm], s.comm, s.peer, o, o + c, fresh=fresh,
                                      stage=stage))
                extent = max(extent, o + c)
        recvs, t = [], 0
        for r in step.recvs:
            for o, c in segments(r.offset, r.count, seg):
                fresh = r.reduce and c > 0 and _fresh(touched, o, o + c, prefill)
                recvs.append(_Message(comms[r.comm], r.comm, r.peer, o, o + c,
                                      t if r.reduce else -1, r.final, fresh))
                touched.add(o, o + c)  # now, so a second reduce into it in this step reads buf
                if r.reduce:  # reduced on the device: the mirror is stale there until staged again
                    mirrored.remove(o, o + c)
                else:  # received into the mirror, then copied to the device
                    mirrored.add(o, o + c)
                t += c if r.reduce else 0
                extent = max(extent, o + c)
        steps.append(_Step(tuple(recvs), tuple(sends), t, None, tuple(prefill)))
    untouched = tuple(touched.gaps(0, extent if count is None else count))
    steps, every, tail = _deadlines(steps)
    return CompiledPlan(tuple(steps), itemsize, max((s.scratch for s in steps), default=0), untouched,
                        every, tail, table(steps, itemsize, tail) if table is not None else None)
