"""One call's buffers, resolved once: validation, the collective's count rule, where the plan runs.

``resolve`` checks the caller's arrays (kind, dtype, layout, sizes, overlap) on the calling rank, before any
message, raising ValueError/TypeError naming the operation and the rank, and returns a ``Placement``: the
1-D views every later stage uses, so nothing after it asks what kind of memory a buffer is.

Memory kinds (``Placement.memory``):
- ``"host"``: numpy arrays; the plan runs on ``work`` (recvbuf, or a reusable working buffer), reading
  ``src`` directly where the collective allows it (out of place, no copy first).
- ``"staged"``: GPU arrays reduced on the host: ``work`` is a pinned host mirror of the whole buffer, copied
  in before and the result copied back after (``gpu_reduce`` off, and every native call).
- ``"device"``: GPU arrays reduced on the GPU: ``work`` is device memory and every message is staged through
  a pinned host mirror (``torus.runtime.memory.DeviceMemory``).

Each collective is one ``Collective`` descriptor: its count rule (what recvbuf must hold), where the input
lands in the working buffer, which part of it is the result, and its native call.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
from mpi4py import MPI

from torus import device
from torus.ops import check_op_dtype
from torus.partition import displacements
from torus.runtime import native


@dataclass(frozen=True)
class Collective:
    name: str
    work: str  # "recv": the plan runs on recvbuf itself; "scratch": on a reusable buffer of the input's size
    input_own: bool  # the input is this rank's block only (all-gather); else the whole buffer
    output_own: bool  # the result is this rank's block only (reduce-scatter); else the whole buffer
    native: Callable  # (comm, work, out, counts, displs, op, scale) -> the host array holding the result


ALLREDUCE = Collective("allreduce", "recv", False, False,
                       lambda comm, work, out, counts, displs, op, scale: native.allreduce(comm, work, op, scale))
REDUCE_SCATTER = Collective("reduce_scatter", "scratch", False, True,
                            lambda comm, work, out, counts, displs, op, scale: native.reduce_scatter(
                                comm, work, out, counts, op, scale))
ALLGATHER = Collective("allgather", "recv", True, False,
                       lambda comm, work, out, counts, displs, op, scale: native.allgather(comm, work, counts,
                                                                                           displs))


@dataclass(slots=True)
class Placement:
    """One call, resolved. ``work``: the 1-D buffer the plan (or native call) runs on; ``src``: the input
    still to bring into ``work`` at ``inp`` (None when it is already there); ``lazy``: the host step loop may
    read ``src`` directly instead; ``out``: where the result (``work[own]`` or all of ``work``) must be copied
    at the end (None when ``work`` is the destination); ``result``: what the call returns."""
    memory: str
    dtype: np.dtype
    count: int  # elements of the working buffer
    counts: Any  # per-rank blocks, a list (None for all-reduce)
    displs: Any
    own: slice  # this rank's block of the working buffer
    in_place: bool
    recv: Any  # recvbuf, 1-D (numpy or numba device array, as every array field here)
    full_src: Any  # the whole input (1-D), or this rank's block when the collective takes only that
    result: Any
    work: Any = None
    src: Any = None
    lazy: bool = False
    out: Any = None


def fail(what: str, rank: int, exc, msg: str) -> NoReturn:
    raise exc(f"{what} on rank {rank}: {msg}")


def array(what: str, rank: int, name: str, buf, writable: bool):
    """``buf`` if it is a usable numpy or GPU array, else raise."""
    if buf is None or buf is MPI.IN_PLACE:
        fail(what, rank, ValueError, f"{name} is required")
    if not isinstance(buf, np.ndarray):
        if device.is_device(buf):
            try:
                why = device.problem(buf, writable)
            except Exception as exc:  # no CUDA driver, numba-cuda missing, a foreign context, ...
                fail(what, rank, TypeError, f"{name} is a GPU array, but numba.cuda cannot use it here "
                                            f"({type(exc).__name__}: {str(exc).strip()})")
            if why:
                fail(what, rank, ValueError, f"{name} (device array) {why}")
            return buf
        fail(what, rank, TypeError, f"{name} must be a numpy or GPU array, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        fail(what, rank, ValueError, f"{name} is not C-contiguous (pass np.ascontiguousarray(...))")
    if writable and not buf.flags.writeable:
        fail(what, rank, ValueError, f"{name} is read-only")
    return buf


def _counts(what: str, rank: int, size: int, recvcounts, block: int) -> list:
    if recvcounts is None:
        return [block] * size
    counts = [int(c) for c in recvcounts]
    if len(counts) != size or min(counts) < 0:
        fail(what, rank, ValueError, f"recvcounts needs {size} non-negative counts, got {recvcounts!r}")
    return counts


def _block_counts(spec: Collective, rank: int, size: int, sendbuf, recvbuf, in_place: bool, recvcounts):
    """The per-rank counts of a reduce-scatter or all-gather, checked against the input's size."""
    what = spec.name
    if spec.input_own:  # all-gather: sendbuf is this rank's block
        if in_place:
            recvbuf = array(what, rank, "recvbuf (in place)", recvbuf, True)
            if recvcounts is None and recvbuf.size % size:
                fail(what, rank, ValueError, f"recvbuf has {recvbuf.size} elements, not a multiple of {size}; "
                                             "pass recvcounts")
            return _counts(what, rank, size, recvcounts, recvbuf.size // size)
        sendbuf = array(what, rank, "sendbuf", sendbuf, False)
        counts = _counts(what, rank, size, recvcounts, sendbuf.size)
        if sendbuf.size != counts[rank]:
            fail(what, rank, ValueError, f"sendbuf has {sendbuf.size} elements, recvcounts[{rank}] is "
                                         f"{counts[rank]}")
        return counts
    full = recvbuf if in_place else sendbuf
    total = getattr(full, "size", 0) if full is not None and full is not MPI.IN_PLACE else 0
    if recvcounts is None and total % size:
        fail(what, rank, ValueError, f"{total} elements do not split into {size} equal blocks; pass recvcounts")
    return _counts(what, rank, size, recvcounts, total // size)


def resolve(spec: Collective, rank: int, size: int, sendbuf, recvbuf, op: str, recvcounts=None) -> Placement:
    """Validate one call's arguments and return its Placement (``memory`` "host" or "device"; TorusComm
    turns "device" into "staged" where the GPU does not reduce, then calls ``bind``)."""
    what = spec.name
    in_place = sendbuf is MPI.IN_PLACE or (sendbuf is not None and sendbuf is recvbuf)
    counts: Any = None if spec is ALLREDUCE else _block_counts(spec, rank, size, sendbuf, recvbuf, in_place,
                                                               recvcounts)
    total: Any = None if counts is None else sum(counts)
    if in_place:
        recvbuf = array(what, rank, "recvbuf (in place)", recvbuf, True)
        dt = check_op_dtype(what, rank, op, recvbuf.dtype)
        if total is not None and recvbuf.size != total:
            fail(what, rank, ValueError, f"recvbuf (in place) has {recvbuf.size} elements, recvcounts sum to "
                                         f"{total}")
    else:
        sendbuf = array(what, rank, "sendbuf", sendbuf, False)
        dt = check_op_dtype(what, rank, op, sendbuf.dtype)
        if spec is REDUCE_SCATTER and sendbuf.size != total:
            fail(what, rank, ValueError, f"sendbuf has {sendbuf.size} elements, recvcounts sum to {total}")
        n = sendbuf.size if spec is ALLREDUCE else total if spec is ALLGATHER else counts[rank]
        on_device = not isinstance(sendbuf, np.ndarray)  # array() let only numpy or GPU arrays through
        if recvbuf is None:
            shape = sendbuf.shape if spec is ALLREDUCE else (n,)
            recvbuf = device.empty(sendbuf, shape, dt) if on_device else np.empty(shape, dt)
        else:
            recvbuf = array(what, rank, "recvbuf", recvbuf, True)
            if isinstance(recvbuf, np.ndarray) == on_device:
                where = ("GPU", "host") if on_device else ("host", "GPU")
                fail(what, rank, TypeError, f"sendbuf is in {where[0]} memory and recvbuf in {where[1]} "
                                            "memory; pass both on the host or both on the GPU")
            if recvbuf.dtype != dt:
                fail(what, rank, TypeError, f"recvbuf dtype {recvbuf.dtype} differs from sendbuf dtype {dt}")
            if recvbuf.size != n:
                fail(what, rank, ValueError, f"recvbuf has {recvbuf.size} elements, expected {n}")
            if device.overlap(sendbuf, recvbuf) if on_device else np.may_share_memory(sendbuf, recvbuf):
                fail(what, rank, ValueError, "sendbuf and recvbuf overlap without being the same buffer "
                                             "(use MPI.IN_PLACE)")
    on_device = not isinstance(recvbuf, np.ndarray)
    recv = device.view(recvbuf).reshape(-1) if on_device else recvbuf.reshape(-1)
    count = recv.size if spec is ALLREDUCE else total
    displs: Any = None if counts is None else displacements(counts)
    own = slice(0, count) if counts is None else slice(displs[rank], displs[rank] + counts[rank])
    if in_place:
        full_src = recv[own] if spec.input_own else recv
        result = recvbuf.reshape(-1)[own] if spec.output_own else recvbuf
    else:
        full_src = device.view(sendbuf).reshape(-1) if on_device else sendbuf.reshape(-1)
        result = recvbuf
    return Placement("device" if on_device else "host", dt, count, counts, displs, own, in_place, recv,
                     full_src, result)


def _copy(dst, src) -> None:
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst, src)
    else:
        device.copy(dst, src)


def bind(p: Placement, spec: Collective, memory: str, buffer: Callable, lazy_ok: bool) -> Placement:
    """Choose the working buffer for memory kind ``memory``; ``buffer(kind, name, count, dtype)`` hands out
    reusable buffers ("host", "pinned" or "device" memory). ``lazy_ok``: the host step loop may read the
    input in place (a schedule, no pre-scaling)."""
    p.memory = memory
    block_out = p.recv if not p.in_place or not spec.output_own else p.recv[p.own]
    if memory == "staged":
        p.work = buffer("pinned", "stage", p.count, p.dtype)
        p.src, p.out = p.full_src, block_out
        return p
    if spec.work == "recv":
        p.work = p.recv
        p.src = None if p.in_place else p.full_src
    else:
        p.work = buffer("device" if memory == "device" else "host", "work", p.count, p.dtype)
        p.src, p.out = p.full_src, block_out
    p.lazy = memory == "host" and lazy_ok and not spec.input_own and p.src is not None
    return p


def stage_in(p: Placement, spec: Collective) -> None:
    """Bring the input into the working buffer unless the step loop reads it where it is."""
    if p.src is not None and not p.lazy:
        _copy(p.work[p.own] if spec.input_own else p.work, p.src)
        p.src = None


def stage_out(p: Placement, spec: Collective, result) -> None:
    """Copy the result (``result``: the host or device array holding it) to its destination."""
    if p.out is not None and p.out is not result:
        _copy(p.out, result)
