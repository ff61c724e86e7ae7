"""The runtime of one TorusComm: its communicators by name, its reusable buffers, plan compilation, and the
runs: host buffers through the C step loop where it is built (torus.runtime.c_step_loop) or the step
interpreter with ``HostMemory``; GPU buffers through the interpreter with ``DeviceMemory``; a phased call
(torus.schedules.phases) phase after phase, each a plan or a call of a node-level shared-memory transport.
On a GPU buffer a phased call's plans run on the device as any plan does, and only its shared-memory phases
go through the host (the window is host memory): each copies its input region to the pinned mirror, runs
there and copies its output region back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torus import faults
from torus.device import bits
from torus.errors import TimeoutError as TorusTimeout
from torus.ops import OP_CODE
from torus.runtime import c_step_loop, interpreter
from torus.runtime.compile import CompiledPlan, _Message, compile_plan
from torus.runtime.memory import DeviceMemory, HostMemory, copy_untouched, pinned
from torus.runtime.shm import SharedMemory
from torus.schedules import phases as phased
from torus.schedules.build import build


@dataclass(frozen=True)
class _PlanPhase:
    plan: CompiledPlan
    keep: tuple | None

    def run(self, ex, what: str, buf, op: str, scale: float, src, check: bool) -> None:
        ex.run(what, self.plan, buf, op, scale, src, self.keep)

    def run_device(self, ex, what: str, buf, op: str, scale: float, check: bool) -> None:
        ex.run_device(what, self.plan, buf, op, scale)


@dataclass(frozen=True)
class _ShmPhase:
    transport: SharedMemory  # of the phase's communicator
    phase: phased.Shm

    def run(self, ex, what: str, buf, op: str, scale: float, src, check: bool) -> None:
        ph = self.phase
        inp = (buf if src is None else src)[ph.inp[0]:ph.inp[1]]
        self.transport.run(what, ph.collective, inp, buf[ph.out[0]:ph.out[1]], ph.counts, op,
                           scale if ph.final else 1.0, check)

    def run_device(self, ex, what: str, buf, op: str, scale: float, check: bool) -> None:
        """On device ``buf``: the input region to the pinned mirror, the transport there, the output back."""
        (ilo, ihi), (olo, ohi) = self.phase.inp, self.phase.out
        mirror = pinned(ex, "mirror", buf.size * buf.dtype.itemsize).view(buf.dtype)
        if ihi > ilo:
            bits(buf)[ilo:ihi].copy_to_host(bits(mirror)[ilo:ihi])
        self.run(ex, what, mirror, op, scale, None, check)
        if ohi > olo:
            bits(buf)[olo:ohi].copy_to_device(bits(mirror)[olo:ohi])


class Executor:
    """Holds the communicators by name, the node-level shared-memory transports by communicator name
    (``shm``: those phased calls use; torus.runtime.shm.SharedMemory) and the reusable buffers of one
    TorusComm."""

    def __init__(self, comms: dict, rank: int, segment_bytes: int, timeout: float | None, shm=None):
        self.comms = comms
        self.shm = shm or {}
        self.rank = rank
        self.segment_bytes = segment_bytes
        self.timeout = timeout
        self._buffers: dict = {}
        self._plans: dict = {}
        self.c_loop = True  # run host buffers through the C step loop when it is available (tests turn it off)

    def buffer(self, name, nbytes: int, alloc=None):
        """Named bytes (a 1-D uint8 array of ``nbytes``) reused across calls, growing only, so steady-state
        calls allocate nothing (and pay no first-touch page faults). ``alloc(nbytes)`` makes a new one
        (default ``np.empty``; memory.py passes pinned host and device allocators under names of its own)."""
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._buffers[name] = (alloc or (lambda n: np.empty(n, np.uint8)))(max(nbytes, 1))
        return buf[:nbytes]

    def free(self) -> None:
        """Drop every buffer of :meth:`buffer` (their memory goes once no caller holds a view of it)."""
        self._buffers.clear()

    def compile(self, plan, itemsize: int, count: int | None = None) -> CompiledPlan:
        """``compile_plan`` on this TorusComm's communicators and segment size (with the C step loop's
        tables when it will run the plan)."""
        table = c_step_loop.table if c_step_loop.AVAILABLE and self.c_loop else None
        return compile_plan(plan, self.comms, self.segment_bytes, itemsize, count, table)

    def plan(self, what: str, algo: str, topology, counts, itemsize: int) -> CompiledPlan:
        """The compiled plan of ``schedules.build(what, algo, topology, counts)``, cached: training repeats the
        same few shapes every step, and a plan is a pure function of these on a given rank and grid."""
        key = (what, algo, counts, itemsize)
        compiled = self._plans.get(key)
        if compiled is None:
            if len(self._plans) >= 256:  # bounded: a sweep over many sizes must not grow without limit
                self._plans.clear()
            total = counts if isinstance(counts, int) else sum(counts)
            compiled = self._plans[key] = self.compile(build(what, algo, topology, counts), itemsize, total)
        return compiled

    def phases(self, what: str, algo: str, topology, counts, itemsize: int, shared: bool) -> tuple:
        """``schedules.phases.build(what, algo, topology, counts, shared)`` ready to run (plans compiled),
        cached as ``plan`` is."""
        key = ("phases", what, algo, counts, itemsize, shared)
        hit = self._plans.get(key)
        if hit is None:
            if len(self._plans) >= 256:
                self._plans.clear()
            total = counts if isinstance(counts, int) else sum(counts)
            hit = self._plans[key] = tuple(
                _PlanPhase(self.compile(ph.steps, itemsize, total), ph.keep) if isinstance(ph, phased.Plan)
                else _ShmPhase(self.shm[ph.comm], ph)
                for ph in phased.build(what, algo, topology, counts, shared))
        return hit

    def _stall(self, what: str, step: int, nsteps: int, msg: _Message) -> str:
        return (f"{what} on rank {self.rank}: no progress for {self.timeout:g} s at step {step + 1}/{nsteps} "
                f"waiting on rank {msg.peer} of the {msg.name} communicator (a peer died, stalled or called a "
                "different collective); the communicator is unusable now, abort the job")

    def wait(self, req, what: str, step: int, nsteps: int, msg: _Message) -> None:
        faults.wait(req, self.timeout, lambda: self._stall(what, step, nsteps, msg))

    def stalled(self, what: str, step: int, nsteps: int, msg: _Message):
        """Raise the TimeoutError ``wait`` raises (for the C step loop, which detects the stall itself)."""
        faults.stalled()
        raise TorusTimeout(self._stall(what, step, nsteps, msg))

    def wait_sends(self, reqs: list, sids: tuple, plan: CompiledPlan, what: str) -> None:
        """Wait for the sends ``sids`` (indices into ``reqs``, the requests by ``sid``)."""
        for g in sids:
            req = reqs[g]
            if not req.Test():  # most have long completed: skip the timeout bookkeeping then
                si, m = plan.sends[g]
                self.wait(req, what, si, len(plan.steps), m)

    def run(self, what: str, plan: CompiledPlan, buf: np.ndarray, op: str, scale: float, src=None,
            keep: tuple | None = None) -> None:
        """Execute ``plan`` on host ``buf`` (1-D contiguous, modified in place); ``src``, ``keep``: see
        ``HostMemory``."""
        tmp = self.buffer("scratch", plan.scratch * plan.itemsize).view(buf.dtype) if plan.scratch else None
        if plan.table is not None and self.c_loop:
            c_step_loop.run(self, what, plan, buf, OP_CODE[op], scale, src, tmp)
            copy_untouched(plan, buf, src, keep)
            return
        interpreter.run(self, what, plan, HostMemory(plan, buf, op, scale, src, keep, tmp))

    def run_phases(self, what: str, phases: tuple, buf: np.ndarray, op: str, scale: float, src,
                   check: bool) -> None:
        """Run ``phases`` (from :meth:`phases`) in order on host ``buf``; ``src``: the out-of-place input, read
        by the first phase only (it leaves in ``buf`` what the later ones read). ``check``: the TorusComm's
        argument check is on (see SharedMemory.run)."""
        for phase in phases:
            phase.run(self, what, buf, op, scale, src, check)
            src = None

    def run_phases_device(self, what: str, phases: tuple, buf, op: str, scale: float, check: bool) -> None:
        """Run ``phases`` in order on ``buf``, a 1-D contiguous numba device array holding the input."""
        for phase in phases:
            phase.run_device(self, what, buf, op, scale, check)

    def run_device(self, what: str, plan: CompiledPlan, buf, op: str, scale: float) -> None:
        """Execute ``plan`` on ``buf``, a 1-D contiguous numba device array (see ``DeviceMemory``)."""
        interpreter.run(self, what, plan, DeviceMemory(self, plan, buf, op, scale))
