"""Runs a plan (see plan.py) over MPI point-to-point on one working buffer.

Per step: post every receive (segmented; a reducing receive lands in scratch), post every send (segmented the
same way, so the peers' messages match one to one), then wait for the receives in order and reduce each
segment as soon as it arrives, so the transfer of the next segments overlaps this segment's reduction. Sends
are completed before the next step, whose sends may read what this step reduced.

Waiting polls with ``MPI.Request.Test`` when a timeout is set, so a dead or stuck peer turns into
``torus.errors.TimeoutError`` naming the operation, step and peer instead of a silent hang.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from torus import kernels
from torus.errors import TimeoutError as TorusTimeout
from torus.partition import segments

_TAG_MOD = 32767  # MPI guarantees tags up to at least 32767


class Executor:
    """Holds the communicators by name and the reusable scratch buffer of one TorusComm."""

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

    def _wait(self, req, what: str, step: int, nsteps: int, peer: int, comm: str) -> None:
        if self.timeout is None:
            req.Wait()
            return
        deadline = time.monotonic() + self.timeout
        spins = 0
        while not req.Test():
            spins += 1
            if spins > 1000:  # only read the clock once in a while
                spins = 0
                if time.monotonic() > deadline:
                    raise TorusTimeout(
                        f"{what} on rank {self.rank}: no progress for {self.timeout:g} s at step "
                        f"{step + 1}/{nsteps} waiting on rank {peer} of the {comm} communicator "
                        "(a peer died, stalled or called a different collective); the communicator "
                        "is unusable now, abort the job")

    def run(self, what: str, plan, buf: np.ndarray, op: str, scale: float) -> None:
        """Execute ``plan`` on ``buf`` (1-D contiguous, modified in place)."""
        itemsize = buf.itemsize
        seg = max(1, self.segment_bytes // itemsize)
        raw = buf.view(np.uint8)
        nsteps = len(plan)
        for si, step in enumerate(plan):
            tag = si % _TAG_MOD
            if step.scale is not None:
                o, c = step.scale.offset, step.scale.count
                if scale != 1.0 and c:
                    kernels.scale(buf[o:o + c], scale)
                continue
            need = sum(r.count for r in step.recvs if r.reduce) * itemsize
            tmp = self.buffer("scratch", need).view(buf.dtype) if need else None
            pending, t = [], 0
            for r in step.recvs:
                comm = self.comms[r.comm]
                for o, c in segments(r.offset, r.count, seg):
                    if r.reduce:
                        target = tmp[t:t + c]
                        t += c
                        req = comm.Irecv([target.view(np.uint8), MPI.BYTE], r.peer, tag)
                    else:
                        target = None
                        req = comm.Irecv([raw[o * itemsize:(o + c) * itemsize], MPI.BYTE], r.peer, tag)
                    pending.append((req, r, o, c, target))
            sends = []
            for s in step.sends:
                comm = self.comms[s.comm]
                for o, c in segments(s.offset, s.count, seg):
                    sends.append((comm.Isend([raw[o * itemsize:(o + c) * itemsize], MPI.BYTE], s.peer, tag),
                                  s))
            for req, r, o, c, target in pending:
                self._wait(req, what, si, nsteps, r.peer, r.comm)
                if target is not None:
                    kernels.reduce_into(buf[o:o + c], target, op, scale if r.final else 1.0)
            for req, s in sends:
                self._wait(req, what, si, nsteps, s.peer, s.comm)
