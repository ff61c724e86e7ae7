"""Runs a compiled plan on a buffer in GPU memory, staging each message through host memory (TorusComm
uses it for GPU buffers from 16 MiB, or always with ``gpu_reduce=True``; smaller ones are copied to the host
whole, reduced there and copied back, which measured faster below 16 MiB: bench/README.md, "On a GPU").

The MPI here (the ``mpich`` wheel, and most MPIs unless built CUDA-aware) cannot read or write device
pointers, so every message goes through a pinned host *mirror* of the working buffer, while the buffer math
stays on the GPU (``torus.kernels`` dispatches device arrays to the Numba-CUDA kernels):

- a step's sends first copy, device to host, the parts of their regions the mirror does not hold yet
  (``compile`` marks them per message: the regions reduced or scaled on the device since they were last
  staged; adjacent ones go in one copy), then send from the mirror;
- a receive that reduces lands in pinned host scratch; once the step's receives are in, the scratch goes to
  the device in one copy and each message is reduced into the buffer by one kernel launch (not one per
  segment: on an H200 a launch costs 100-250 us of Python, more than the transfer of a 1 MiB segment);
- a receive that overwrites (the all-gather phase) lands in the mirror and is copied to the device.

Correctness follows the host executor's: the mirror is written only where the host path would write the
buffer (a receive), or where the device wrote since the last staging (then every send that read the old
bytes has passed its deadline, the step that wrote them). Out of place the caller copies the input into the
buffer on the device first. Device copies and kernels run on the default stream and are waited for before
the bytes go to MPI. Cost beyond the host path: one device-to-host copy of each region before it is first
sent after a change, one host-to-device copy of every byte received, and a kernel launch per reduced
message (on an H200 with numba-cuda 0.30, 100-250 us of Python per launch).

Not done: CUDA-aware MPI (passing device pointers straight to MPI) and CUDA streams other than the default.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from torus import kernels
from torus.device import bits, copy
from torus.algorithms.executor import _TAG_MOD, CompiledPlan, Executor


def pinned(ex: Executor, name: str, nbytes: int) -> np.ndarray:
    """Page-locked host bytes reused across calls (growing only): device copies from and to them run at
    full speed and need no bounce buffer in the driver."""
    from numba import cuda
    return ex.buffer(("pinned", name), nbytes, lambda n: cuda.pinned_array(n, np.uint8))


def device_buffer(ex: Executor, name: str, count: int, dtype):
    """Device memory of ``count`` elements of ``dtype`` reused across calls (growing only)."""
    from numba import cuda
    isz = np.dtype(dtype).itemsize
    raw = ex.buffer(("device", name, isz), count * isz, lambda n: cuda.device_array(n, np.uint8))
    return raw.view(dtype)


def _runs(ranges: list) -> list:
    """``(lo, hi)`` ranges in order, each joined to the one before when they touch: one device copy each."""
    out: list = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        elif hi > lo:
            out.append((lo, hi))
    return out


def _batches(recvs) -> list:
    """A step's receives as device operations in receive order: ``(kind, lo, hi, tmp_lo, final)``, the
    segments of one message (adjacent in the buffer and in scratch, same kind) joined, so a message costs
    one kernel launch or one copy instead of one per segment. Two reductions into the same region stay two,
    in order, as on the host."""
    out: list = []
    for m in recvs:
        if m.hi == m.lo:
            continue
        kind = "reduce" if m.tmp_lo >= 0 else "copy"
        if out:
            k, lo, hi, tlo, final = out[-1]
            if k == kind and hi == m.lo and final == m.final and (kind == "copy" or tlo + hi - lo == m.tmp_lo):
                out[-1] = (k, lo, m.hi, tlo, final)
                continue
        out.append((kind, m.lo, m.hi, m.tmp_lo, m.final))
    return out


def run(ex: Executor, what: str, plan: CompiledPlan, buf, op: str, scale: float) -> None:
    """Execute ``plan`` on ``buf`` (a 1-D contiguous numba device array, modified in place), as
    ``Executor.run`` does on host memory; see the module docstring for the staging."""
    isz = plan.itemsize
    n = buf.size
    mirror = pinned(ex, "mirror", n * isz)
    mirror_el = bits(mirror.view(buf.dtype))
    htmp = pinned(ex, "scratch", plan.scratch * isz)
    htmp_el = bits(htmp.view(buf.dtype))
    raw = bits(buf)
    dtmp = device_buffer(ex, "scratch", plan.scratch, buf.dtype) if plan.scratch else None
    nsteps = len(plan.steps)
    reqs: list = [None] * len(plan.sends)  # send requests by sid, waited for at their deadline step
    for si, step in enumerate(plan.steps):
        if step.retire:
            ex.wait_sends(reqs, step.retire, plan, what)
        if step.scale is not None:
            lo, hi = step.scale
            if scale != 1.0 and hi > lo:
                kernels.scale(buf[lo:hi], scale)
            continue
        tag = si % _TAG_MOD
        pending = []
        for m in step.recvs:
            if m.tmp_lo >= 0:
                target = htmp[m.tmp_lo * isz:(m.tmp_lo + m.hi - m.lo) * isz]
            else:
                target = mirror[m.lo * isz:m.hi * isz]
            pending.append(m.comm.Irecv([target, MPI.BYTE], m.peer, tag))
        for lo, hi in _runs([r for m in step.sends for r in m.stage]):
            raw[lo:hi].copy_to_host(mirror_el[lo:hi])
        for m in step.sends:
            data = mirror[m.lo * isz:m.hi * isz]
            reqs[m.sid] = m.comm.Isend([data, MPI.BYTE], m.peer, tag)
        for req, m in zip(pending, step.recvs):
            ex._wait(req, what, si, nsteps, m)
        if step.scratch:
            bits(dtmp)[:step.scratch].copy_to_device(htmp_el[:step.scratch])
        for kind, lo, hi, tlo, final in _batches(step.recvs):
            if kind == "reduce":
                kernels.reduce_into(buf[lo:hi], dtmp[tlo:tlo + hi - lo], op, scale if final else 1.0)
            else:
                raw[lo:hi].copy_to_device(mirror_el[lo:hi])
    ex.wait_sends(reqs, plan.tail, plan, what)
