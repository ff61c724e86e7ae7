"""Memory policies of the step interpreter (torus.runtime.interpreter): where a message is received, what a
send reads, and what happens to a received segment, for host buffers and for GPU buffers staged per message.

``HostMemory``: numpy buffers; a reducing receive lands in scratch and is reduced into the buffer as soon as
it arrives; out of place, a send or first reduction of a region not written yet reads ``src`` (the caller's
sendbuf) directly, and ``finish`` copies the regions no step wrote.

``DeviceMemory``: a buffer in GPU memory, reduced on the GPU (torus.kernels' Numba-CUDA kernels), every message
staged through a pinned host *mirror* of the buffer, since the MPI here (and most MPIs unless built
CUDA-aware) cannot read or write device pointers:

- a step's sends first copy, device to host, the parts of their regions the mirror does not hold yet
  (``compile_plan`` marks them per message: the regions reduced or scaled on the device since they were last
  staged; adjacent ones go in one copy), then send from the mirror;
- a receive that reduces lands in pinned host scratch; once the step's receives are in, the scratch goes to
  the device in one copy and each message is reduced into the buffer by one kernel launch (not one per
  segment: a launch costs more than the transfer of a segment; bench/gpu/README.md);
- a receive that overwrites (the all-gather phase) lands in the mirror and is copied to the device.

Correctness follows the host policy's: the mirror is written only where the host would write the buffer (a
receive), or where the device wrote since the last staging (then every send that read the old bytes has
passed its deadline, the step that wrote them). Out of place the caller copies the input into the buffer on
the device first. Device copies and kernels run on the default stream and are waited for before the bytes go
to MPI. Cost beyond the host path: one device-to-host copy of each region before it is first sent after a
change, one host-to-device copy of every byte received, and a kernel launch per reduced message.

Not done: CUDA-aware MPI (passing device pointers straight to MPI) and CUDA streams other than the default.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from torus import kernels
from torus.device import bits


def pinned(ex, name: str, nbytes: int) -> np.ndarray:
    """Page-locked host bytes reused across calls (growing only): device copies from and to them run at
    full speed and need no bounce buffer in the driver."""
    from numba import cuda
    return ex.buffer(("pinned", name), nbytes, lambda n: cuda.pinned_array(n, np.uint8))


def device_buffer(ex, name: str, count: int, dtype):
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


class _Scaled:
    """``scale(lo, hi)``: ``buf[lo:hi] *= scale_factor`` by the kernel layer (host or device array alike)."""

    buf: Any
    scale_factor: float

    def scale(self, lo: int, hi: int) -> None:
        if self.scale_factor != 1.0 and hi > lo:
            kernels.scale(self.buf[lo:hi], self.scale_factor)


class HostMemory(_Scaled):
    """Numpy ``buf`` (1-D, modified in place); ``src`` (optional, same length and dtype, not overlapping):
    out of place, the input is read from ``src`` (never written) instead of ``buf``'s old contents;
    ``keep`` = ``(lo, hi)``: only that range of ``buf`` is wanted, untouched regions outside it are not
    copied."""

    def __init__(self, plan, buf: np.ndarray, op: str, scale: float, src=None, keep=None, tmp=None):
        isz = plan.itemsize
        self.plan, self.buf, self.op, self.scale_factor, self.src, self.keep, self.tmp = (
            plan, buf, op, scale, src, keep, tmp)
        self.raw = buf.view(np.uint8)
        self.rsrc = src.view(np.uint8) if src is not None else None
        self.rtmp = tmp.view(np.uint8) if tmp is not None else None
        self.isz = isz

    def prefill(self, regions) -> None:
        if self.src is not None:
            for lo, hi in regions:
                np.copyto(self.buf[lo:hi], self.src[lo:hi])

    def recv_target(self, m):
        isz = self.isz
        if m.tmp_lo >= 0:
            return self.rtmp[m.tmp_lo * isz:(m.tmp_lo + m.hi - m.lo) * isz]
        return self.raw[m.lo * isz:m.hi * isz]

    def stage_sends(self, sends) -> None:
        pass

    def send_data(self, m):
        return (self.rsrc if m.fresh and self.src is not None else self.raw)[m.lo * self.isz:m.hi * self.isz]

    def received(self, m) -> None:
        if m.tmp_lo < 0:
            return
        received = self.tmp[m.tmp_lo:m.tmp_lo + m.hi - m.lo]
        s = self.scale_factor if m.final else 1.0
        if m.fresh and self.src is not None:
            kernels.reduce_into(self.src[m.lo:m.hi], received, self.op, s, self.buf[m.lo:m.hi])
        else:
            kernels.reduce_into(self.buf[m.lo:m.hi], received, self.op, s)

    def step_done(self, step) -> None:
        pass

    def finish(self) -> None:
        copy_untouched(self.plan, self.buf, self.src, self.keep)


def copy_untouched(plan, buf, src, keep) -> None:
    """Out of place: copy from ``src`` the regions no step wrote (within ``keep`` when given)."""
    if src is not None:
        for lo, hi in plan.untouched:
            if keep is not None:
                lo, hi = max(lo, keep[0]), min(hi, keep[1])
            if hi > lo:
                np.copyto(buf[lo:hi], src[lo:hi])


class DeviceMemory(_Scaled):
    """``buf``: a 1-D contiguous numba device array, modified in place (see the module docstring)."""

    def __init__(self, ex, plan, buf, op: str, scale: float):
        isz = plan.itemsize
        self.buf, self.op, self.scale_factor, self.isz = buf, op, scale, isz
        self.mirror = pinned(ex, "mirror", buf.size * isz)
        self.mirror_el = bits(self.mirror.view(buf.dtype))
        self.htmp = pinned(ex, "scratch", plan.scratch * isz)
        self.htmp_el = bits(self.htmp.view(buf.dtype))
        self.raw = bits(buf)
        self.dtmp: Any = device_buffer(ex, "scratch", plan.scratch, buf.dtype) if plan.scratch else None

    def prefill(self, regions) -> None:
        pass  # the input is in buf already (the caller copied it on the device)

    def recv_target(self, m):
        isz = self.isz
        if m.tmp_lo >= 0:
            return self.htmp[m.tmp_lo * isz:(m.tmp_lo + m.hi - m.lo) * isz]
        return self.mirror[m.lo * isz:m.hi * isz]

    def stage_sends(self, sends) -> None:
        for lo, hi in _runs([r for m in sends for r in m.stage]):
            self.raw[lo:hi].copy_to_host(self.mirror_el[lo:hi])

    def send_data(self, m):
        return self.mirror[m.lo * self.isz:m.hi * self.isz]

    def received(self, m) -> None:
        pass  # batched per step in step_done

    def step_done(self, step) -> None:
        if step.scratch:
            bits(self.dtmp)[:step.scratch].copy_to_device(self.htmp_el[:step.scratch])
        for kind, lo, hi, tlo, final in _batches(step.recvs):
            if kind == "reduce":
                kernels.reduce_into(self.buf[lo:hi], self.dtmp[tlo:tlo + hi - lo], self.op,
                                    self.scale_factor if final else 1.0)
            else:
                self.raw[lo:hi].copy_to_device(self.mirror_el[lo:hi])

    def finish(self) -> None:
        pass


def buffer(executor, kind: str, name: str, count: int, dtype):
    """``count`` elements of ``dtype`` of ``executor``'s reusable memory of ``kind``: "host" (numpy), "pinned"
    (page-locked host memory) or "device" (a numba device array)."""
    if kind == "host":
        return executor.buffer(name, count * dtype.itemsize).view(dtype)
    if kind == "pinned":
        return pinned(executor, name, count * dtype.itemsize).view(dtype)
    return device_buffer(executor, name, count, dtype)
