"""Runs a plan (see plan.py) over MPI point-to-point on one working buffer.

``compile`` turns a plan into byte ranges once (plans repeat every training step); ``run`` then does, per
step: post every receive (segmented; a reducing receive lands in scratch), post every send (segmented the
same way, so the peers' messages match one to one), then wait for the receives in order and reduce each
segment as soon as it arrives, so the transfer of later segments overlaps this segment's reduction. Sends
complete before the next step, whose sends may read what this step reduced.

Waiting polls with ``MPI.Request.Test`` when a timeout is set, so a dead or stuck peer turns into
``torus.errors.TimeoutError`` naming the operation, step and peer instead of a silent hang.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from torus import faults, kernels
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


@dataclass(frozen=True)
class _Step:
    recvs: tuple
    sends: tuple
    scratch: int  # elements of scratch the reducing receives need
    scale: tuple | None  # (lo, hi) to scale when no reduce completed the owner's region


@dataclass(frozen=True)
class CompiledPlan:
    steps: tuple
    itemsize: int
    scratch: int


class Executor:
    """Holds the communicators by name and the reusable buffers of one TorusComm."""

    def __init__(self, comms: dict, rank: int, segment_bytes: int, timeout: float | None):
        self.comms = comms
        self.rank = rank
        self.segment_bytes = segment_bytes
        self.timeout = timeout
        self._buffers: dict = {}

    def buffer(self, name: str, nbytes: int) -> np.ndarray:
        """Named bytes reused across calls, growing only, so steady-state calls allocate nothing (and
        pay no first-touch page faults)."""
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._buffers[name] = np.empty(nbytes, np.uint8)
        return buf[:nbytes]

    def compile(self, plan, itemsize: int) -> CompiledPlan:
        """Cut every message of ``plan`` into segments of at most ``segment_bytes``."""
        seg = max(1, self.segment_bytes // itemsize)
        steps = []
        for step in plan:
            if step.scale is not None:
                steps.append(_Step((), (), 0, (step.scale.offset, step.scale.offset + step.scale.count)))
                continue
            recvs, t = [], 0
            for r in step.recvs:
                for o, c in segments(r.offset, r.count, seg):
                    recvs.append(_Message(self.comms[r.comm], r.comm, r.peer, o, o + c,
                                          t if r.reduce else -1, r.final))
                    t += c if r.reduce else 0
            sends = tuple(_Message(self.comms[s.comm], s.comm, s.peer, o, o + c)
                          for s in step.sends for o, c in segments(s.offset, s.count, seg))
            steps.append(_Step(tuple(recvs), sends, t, None))
        return CompiledPlan(tuple(steps), itemsize, max((s.scratch for s in steps), default=0))

    def _wait(self, req, what: str, step: int, nsteps: int, msg: _Message) -> None:
        faults.wait(req, self.timeout, lambda: (
            f"{what} on rank {self.rank}: no progress for {self.timeout:g} s at step {step + 1}/{nsteps} "
            f"waiting on rank {msg.peer} of the {msg.name} communicator (a peer died, stalled or called a "
            "different collective); the communicator is unusable now, abort the job"))

    def run(self, what: str, plan: CompiledPlan, buf: np.ndarray, op: str, scale: float) -> None:
        """Execute ``plan`` on ``buf`` (1-D contiguous, modified in place)."""
        isz = plan.itemsize
        raw = buf.view(np.uint8)
        tmp = self.buffer("scratch", plan.scratch * isz).view(buf.dtype) if plan.scratch else None
        rtmp = tmp.view(np.uint8) if tmp is not None else None
        nsteps = len(plan.steps)
        for si, step in enumerate(plan.steps):
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
            sends = [m.comm.Isend([raw[m.lo * isz:m.hi * isz], MPI.BYTE], m.peer, tag) for m in step.sends]
            for req, m in zip(pending, step.recvs):
                self._wait(req, what, si, nsteps, m)
                if m.tmp_lo >= 0:
                    kernels.reduce_into(buf[m.lo:m.hi], tmp[m.tmp_lo:m.tmp_lo + m.hi - m.lo], op,
                                        scale if m.final else 1.0)
            for req, m in zip(sends, step.sends):
                self._wait(req, what, si, nsteps, m)
