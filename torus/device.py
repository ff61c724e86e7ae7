"""Device (GPU) arrays as TorusComm sees them: recognise, validate, view, allocate.

Accepted: arrays exposing ``__cuda_array_interface__`` with numpy's ``dtype``/``size``/``shape``/``reshape``
(CuPy arrays, numba device arrays; a PyTorch CUDA tensor has other meanings for ``size`` and ``dtype``:
wrap it with ``cupy.asarray`` first) and the CUDA simulator's arrays (``NUMBA_ENABLE_CUDASIM=1``, which carry only
``__cuda_ndarray__``). Internally every one is handled as a zero-copy numba device-array view, because the
staged executor needs numba's ``copy_to_host``/``copy_to_device`` and ``torus.kernels`` dispatches those views
to the Numba-CUDA kernels. numba is imported only when a device array is actually seen.
"""
from __future__ import annotations

import numpy as np

from torus.kernels import is_device  # noqa: F401  (re-exported: one definition of "device array")


def view(buf):
    """A numba device-array view of ``buf``'s memory (``buf`` itself for numba's and the simulator's)."""
    if getattr(buf, "__cuda_ndarray__", False):
        return buf
    from numba import cuda
    return cuda.as_cuda_array(buf)


def problem(buf, writable: bool) -> str | None:
    """Why ``buf`` cannot be used (layout, read-only), or None."""
    v = view(buf)
    if not v.is_c_contiguous():
        return "is not C-contiguous (make a contiguous copy first)"
    cai = getattr(buf, "__cuda_array_interface__", None)
    if writable and cai is not None and cai["data"][1]:
        return "is read-only"
    return None


def _span(buf):
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        lo = cai["data"][0]
        return lo, lo + view(buf).nbytes
    ary = getattr(buf, "_ary", None)  # the simulator keeps its data in a numpy array
    if ary is not None:
        lo = ary.__array_interface__["data"][0]
        return lo, lo + ary.nbytes
    return None


def overlap(a, b) -> bool:
    """True when the two device arrays share bytes (False where that cannot be told)."""
    sa, sb = _span(a), _span(b)
    return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1] and min(
        sa[1] - sa[0], sb[1] - sb[0]) > 0


def empty(like, shape, dtype):
    """Uninitialised device memory of ``shape``/``dtype``: a CuPy array when ``like`` is one, else a numba
    device array."""
    if type(like).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy.empty(shape, dtype)
    from numba import cuda
    return cuda.device_array(shape, np.dtype(dtype))


_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(a):
    """``a`` viewed as unsigned integers of its item size (numpy or numba device array): copies between host
    and device go through these views, since numba cannot copy types it does not know (bfloat16)."""
    return a.view(_BITS[a.dtype.itemsize])


def copy(dst, src) -> None:
    """``dst[:] = src``: same-size 1-D arrays, at least one a numba device view; nothing for zero elements."""
    if dst.size == 0:
        return
    if isinstance(dst, np.ndarray):
        bits(src).copy_to_host(bits(dst))
    else:
        bits(dst).copy_to_device(bits(src))
