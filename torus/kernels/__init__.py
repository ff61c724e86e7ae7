"""Buffer math for the schedules: reduce a received segment into an accumulator, scale, cast.

Dispatch by buffer type: numpy arrays (host memory) go to the Cython kernels in ``torus._ext``; arrays that
expose ``__cuda_array_interface__`` go to the Numba-CUDA kernels in ``torus.kernels.cuda`` (imported lazily, so
the host path never needs a GPU or CUDA toolkit). Callers pass 1-D contiguous arrays of equal length and dtype;
the schedules guarantee that, so these functions do not re-validate on the hot path.

``set_num_threads(n)`` bounds the OpenMP threads a host kernel may use (default: ``TORUS_NUM_THREADS`` or the
number of CPUs); ``TorusComm`` lowers it to CPUs per node-local rank so ranks sharing a node do not
oversubscribe its cores.
"""
from __future__ import annotations

import os

import numpy as np

from torus import knobs
from torus._ext import _convert, _reduce  # type: ignore[attr-defined]  # compiled, no stubs
from torus.ops import HALF_FORMAT, OP_CODE

_num_threads = knobs.read("TORUS_NUM_THREADS") or (os.cpu_count() or 1)


def set_num_threads(n: int) -> None:
    """Let host kernels use at most ``n`` (>= 1) OpenMP threads."""
    global _num_threads
    _num_threads = max(1, int(n))


def get_num_threads() -> int:
    return _num_threads


def is_device(buf) -> bool:
    """True for a GPU array (``__cuda_array_interface__``, or the CUDA simulator's arrays)."""
    # numba's own device arrays are marked __cuda_ndarray__; the CUDA simulator's (NUMBA_ENABLE_CUDASIM=1)
    # carry only that mark, no __cuda_array_interface__.
    return not isinstance(buf, np.ndarray) and (hasattr(buf, "__cuda_array_interface__")
                                                or getattr(buf, "__cuda_ndarray__", False))


def reduce_into(acc, src, op: str, scale: float = 1.0, out=None) -> None:
    """``acc[i] = op(acc[i], src[i])``, then ``*= scale`` when ``op`` is sum/avg and ``scale != 1``.

    acc, src: 1-D contiguous, same length (elements) and dtype. acc is modified in place; src is read only.
    With ``out`` (same length and dtype, overlapping neither operand, or ``acc`` itself) the result goes to
    ``out`` and acc is only read: one pass where a copy then an in-place reduce would take two.
    float16/bfloat16 use float32 arithmetic and one rounding per element. Host arrays with a wrong length,
    dtype, layout or overlap raise ValueError/TypeError before any element is written.
    """
    if isinstance(acc, np.ndarray):  # the host fast path first: schedules call this once per segment
        _reduce.reduce(acc, src, OP_CODE[op], scale, _num_threads, out)
        return
    if not is_device(acc):
        raise TypeError(f"reduce_into: expected numpy or CUDA arrays, got {type(acc).__name__}")
    from torus.kernels import cuda
    cuda.reduce_into(acc, src, op, scale, out)


def scale(buf, factor: float) -> None:
    """``buf *= factor`` in place (float dtypes; 16-bit types round once)."""
    if is_device(buf):
        from torus.kernels import cuda
        cuda.scale(buf, factor)
        return
    fmt = HALF_FORMAT.get(buf.dtype)
    if fmt is None:
        _convert.scale_native(buf, factor, _num_threads)
    else:
        _convert.scale_half(buf.view(np.uint16), factor, fmt, _num_threads)


def narrow(src, dst) -> None:
    """Cast float32 ``src`` into float16/bfloat16 ``dst`` (same length), round to nearest even."""
    if is_device(src):
        from torus.kernels import cuda
        cuda.narrow(src, dst)
        return
    _convert.narrow(src, dst.view(np.uint16), HALF_FORMAT[dst.dtype], _num_threads)


def widen(src, dst) -> None:
    """Cast float16/bfloat16 ``src`` into float32 ``dst`` (same length), exact."""
    if is_device(src):
        from torus.kernels import cuda
        cuda.widen(src, dst)
        return
    _convert.widen(src.view(np.uint16), dst, HALF_FORMAT[src.dtype], _num_threads)
