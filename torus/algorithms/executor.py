"""Runs a plan (see plan.py) over MPI point-to-point on one working buffer.

``compile`` turns a plan into byte ranges once (plans repeat every training step); ``run`` then does, per
step: post every receive (segmented; a reducing receive lands in scratch), post every send (segmented the
same way, so the peers' messages match one to one), then wait for the receives in order and reduce each
segment as soon as it arrives, so the transfer of later segments overlaps this segment's reduction. A send is
waited for only before the first later step that writes its region (or at the end): waiting at the end of its
own step would make each rank wait for its right neighbour to receive before it may receive from its left,
a chain of handshakes that costs a scheduler round trip per step when ranks outnumber cores.

Out of place (``run(..., src=sendbuf)``) nothing is copied up front: a send reads ``src`` while its region is
still untouched in ``buf``, and the first reduction into a region reads ``src`` and writes ``buf`` in one pass
(``reduce_into(..., out=)``). ``compile`` works out, once per plan, which messages those are, which regions a
step must copy first (a message that straddles touched and untouched elements) and which regions no step ever
writes (copied at the end). This saves a full pass over the message: at 1 MiB about a sixth of an all-reduce.

Waiting polls with ``MPI.Request.Test`` when a timeout is set, so a dead or stuck peer turns into
``torus.errors.TimeoutError`` naming the operation, step and peer instead of a silent hang.

Host buffers run this loop in C where it is built and mpi4py runs on an MPICH-ABI library (cloop.py,
``src/_sched.pyx``: the same messages, waits, timeouts and kernels, from tables ``compile`` adds to the plan);
the Python loop below is the fallback (``TORUS_C_LOOP=0``) and the reference the C one is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from mpi4py import MPI

from torus import faults, kernels
from torus.algorithms import cloop
from torus.errors import TimeoutError as TorusTimeout
from torus.ops import OP_CODE
from torus.partition import segments

_TAG_MOD = 32767  # MPI guarantees tags up to at least 32767


@dataclass(frozen=True)
class _Message:
    comm: MPI.Comm
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


@dataclass(frozen=True)
class CompiledPlan:
    steps: tuple
    itemsize: int
    scratch: int
    untouched: tuple = ()  # out of place: (lo, hi) regions no step writes, copied from src at the end
    sends: tuple = ()  # every send, by ``sid``: (step, message), for the requests' table and error messages
    tail: tuple = ()  # sends no step waits for: waited for at the end
    table: tuple | None = None  # the C loop's arrays (cloop.table), when it is available


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


def _deadlines(steps: list) -> tuple:
    """Set each send's ``until`` (the first later step that writes, i.e. receives into, reduces into or
    scales, any element the send reads from buf, or ``len(steps)``; reading the same region again is no
    conflict) and its ``sid``, and give each step the sends to wait for before it (``retire``).
    Returns (steps, every send as (step, message), the sends left for the end)."""
    writes = []
    for st in steps:
        spans = [(m.lo, m.hi) for m in st.recvs if m.hi > m.lo]
        if st.scale is not None and st.scale[1] > st.scale[0]:
            spans.append(st.scale)
        box = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else (0, 0)
        writes.append((box, spans))
    out, every = [], []
    retire: list = [[] for _ in range(len(steps) + 1)]
    for si, st in enumerate(steps):
        sends = []
        for m in st.sends:
            until = len(steps)
            for t in range(si + 1, len(steps)):
                (blo, bhi), spans = writes[t]
                if blo < m.hi and m.lo < bhi and any(a < m.hi and m.lo < b for a, b in spans):
                    until = t
                    break
            m = replace(m, until=until, sid=len(every))
            retire[until].append(m.sid)
            every.append((si, m))
            sends.append(m)
        out.append(replace(st, sends=tuple(sends)))
    out = [replace(st, retire=tuple(retire[si])) for si, st in enumerate(out)]
    return out, tuple(every), tuple(retire[len(steps)])


class Executor:
    """Holds the communicators by name and the reusable buffers of one TorusComm."""

    def __init__(self, comms: dict, rank: int, segment_bytes: int, timeout: float | None):
        self.comms = comms
        self.rank = rank
        self.segment_bytes = segment_bytes
        self.timeout = timeout
        self._buffers: dict = {}
        self.c_loop = True  # run host buffers through the C loop when cloop.AVAILABLE (tests turn it off)

    def buffer(self, name, nbytes: int, alloc=None):
        """Named bytes (a 1-D uint8 array of ``nbytes``) reused across calls, growing only, so steady-state
        calls allocate nothing (and pay no first-touch page faults). ``alloc(nbytes)`` makes a new one
        (default ``np.empty``; staged.py passes pinned host and device allocators under names of its own)."""
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._buffers[name] = (alloc or (lambda n: np.empty(n, np.uint8)))(max(nbytes, 1))
        return buf[:nbytes]

    def free(self) -> None:
        """Drop every buffer of :meth:`buffer` (their memory goes once no caller holds a view of it)."""
        self._buffers.clear()

    def compile(self, plan, itemsize: int, count: int | None = None) -> CompiledPlan:
        """Cut every message of ``plan`` into segments of at most ``segment_bytes``; ``count`` (elements of
        the working buffer, default: the plan's extent) bounds the regions an out-of-place run copies at the
        end because no step writes them."""
        seg = max(1, self.segment_bytes // itemsize)
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
                    sends.append(_Message(self.comms[s.comm], s.comm, s.peer, o, o + c, fresh=fresh,
                                          stage=stage))
                    extent = max(extent, o + c)
            recvs, t = [], 0
            for r in step.recvs:
                for o, c in segments(r.offset, r.count, seg):
                    fresh = r.reduce and c > 0 and _fresh(touched, o, o + c, prefill)
                    recvs.append(_Message(self.comms[r.comm], r.comm, r.peer, o, o + c,
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
        table = cloop.table(steps, itemsize, tail) if cloop.AVAILABLE and self.c_loop else None
        return CompiledPlan(tuple(steps), itemsize, max((s.scratch for s in steps), default=0), untouched,
                            every, tail, table)

    def _stall(self, what: str, step: int, nsteps: int, msg: _Message) -> str:
        return (f"{what} on rank {self.rank}: no progress for {self.timeout:g} s at step {step + 1}/{nsteps} "
                f"waiting on rank {msg.peer} of the {msg.name} communicator (a peer died, stalled or called a "
                "different collective); the communicator is unusable now, abort the job")

    def _wait(self, req, what: str, step: int, nsteps: int, msg: _Message) -> None:
        faults.wait(req, self.timeout, lambda: self._stall(what, step, nsteps, msg))

    def stalled(self, what: str, step: int, nsteps: int, msg: _Message):
        """Raise the TimeoutError ``_wait`` raises (for the C loop, which detects the stall itself)."""
        raise TorusTimeout(self._stall(what, step, nsteps, msg))

    def wait_sends(self, reqs: list, sids: tuple, plan: CompiledPlan, what: str) -> None:
        """Wait for the sends ``sids`` (indices into ``reqs``, the requests by ``sid``)."""
        for g in sids:
            req = reqs[g]
            if not req.Test():  # most have long completed: skip the timeout bookkeeping then
                si, m = plan.sends[g]
                self._wait(req, what, si, len(plan.steps), m)

    def run(self, what: str, plan: CompiledPlan, buf: np.ndarray, op: str, scale: float, src=None,
            keep: tuple | None = None) -> None:
        """Execute ``plan`` on ``buf`` (1-D contiguous, modified in place).

        ``src`` (optional, 1-D, same length and dtype, not overlapping ``buf``): out of place, the input is
        read from ``src`` (never written) instead of ``buf``'s old contents. ``keep`` = ``(lo, hi)``: only that
        range of ``buf`` is wanted (reduce-scatter's own block); untouched regions outside it are not copied."""
        isz = plan.itemsize
        raw = buf.view(np.uint8)
        rsrc = src.view(np.uint8) if src is not None else None
        tmp = self.buffer("scratch", plan.scratch * isz).view(buf.dtype) if plan.scratch else None
        if plan.table is not None and self.c_loop:
            cloop.run(self, what, plan, buf, OP_CODE[op], scale, src, tmp)
            self._copy_untouched(plan, buf, src, keep)
            return
        rtmp = tmp.view(np.uint8) if tmp is not None else None
        nsteps = len(plan.steps)
        reqs: list = [None] * len(plan.sends)  # send requests by sid, waited for at their deadline step
        for si, step in enumerate(plan.steps):
            if step.retire:
                self.wait_sends(reqs, step.retire, plan, what)
            if src is not None:
                for lo, hi in step.prefill:
                    np.copyto(buf[lo:hi], src[lo:hi])
            if step.scale is not None:
                lo, hi = step.scale
                if scale != 1.0 and hi > lo:
                    kernels.scale(buf[lo:hi], scale)
                continue
            tag = si % _TAG_MOD
            pending = []
            for m in step.recvs:
                if m.tmp_lo >= 0:
                    t = m.tmp_lo + m.hi - m.lo
                    target = rtmp[m.tmp_lo * isz:t * isz]
                else:
                    target = raw[m.lo * isz:m.hi * isz]
                pending.append(m.comm.Irecv([target, MPI.BYTE], m.peer, tag))
            for m in step.sends:
                data = (rsrc if m.fresh and src is not None else raw)[m.lo * isz:m.hi * isz]
                reqs[m.sid] = m.comm.Isend([data, MPI.BYTE], m.peer, tag)
            for req, m in zip(pending, step.recvs):
                self._wait(req, what, si, nsteps, m)
                if m.tmp_lo >= 0:
                    received = tmp[m.tmp_lo:m.tmp_lo + m.hi - m.lo]
                    s = scale if m.final else 1.0
                    if m.fresh and src is not None:
                        kernels.reduce_into(src[m.lo:m.hi], received, op, s, buf[m.lo:m.hi])
                    else:
                        kernels.reduce_into(buf[m.lo:m.hi], received, op, s)
        self.wait_sends(reqs, plan.tail, plan, what)
        self._copy_untouched(plan, buf, src, keep)

    @staticmethod
    def _copy_untouched(plan: CompiledPlan, buf, src, keep) -> None:
        if src is not None:
            for lo, hi in plan.untouched:
                if keep is not None:
                    lo, hi = max(lo, keep[0]), min(hi, keep[1])
                if hi > lo:
                    np.copyto(buf[lo:hi], src[lo:hi])
