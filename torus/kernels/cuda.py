"""Device buffer math: the Numba-CUDA twins of the Cython host kernels, for arrays in GPU memory.

``torus.kernels`` imports this module lazily and calls it for any buffer that exposes
``__cuda_array_interface__`` (CuPy, PyTorch, numba device arrays) or is a numba device array (including the
``NUMBA_ENABLE_CUDASIM=1`` simulator's). Callers pass 1-D contiguous arrays of equal length and dtype; nothing
is re-validated here. Results are bit-identical to the host kernels (src/_reduce.pyx, src/_convert.pyx):
the same expressions in the same order, float16/bfloat16 widened to float32 for each operation and rounded
once (round to nearest even) with the bit manipulation of src/half.h, so NaN encodings match too. The 16-bit
formats are handled as uint16 views, because numba has no bfloat16 array type and because the GPU's own
float16 conversion (cvt.rn.f16.f32) may return a canonical NaN where numpy keeps the sign and payload.

Each function launches one grid-stride kernel on the default stream and waits for that stream: the schedules
hand the buffer to a CUDA-aware MPI next, which does not order itself after our stream. Inputs written by
other streams must be complete before the call (numba waits for the stream a ``__cuda_array_interface__``
names). Kernels are compiled lazily, once per (function, storage format) and then once per dtype by numba's
dispatcher, which caches them for the life of the process.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
from numba import cuda

from torus.ops import HALF_FORMAT, OP_CODE

_SUM, _PROD, _MIN = OP_CODE["sum"], OP_CODE["prod"], OP_CODE["min"]
_F16, _BF16 = 0, 1  # HALF_FORMAT values
_THREADS = 256
# 4096 blocks x 256 threads keep every SM of current GPUs (132 on an H100/H200) busy; the grid-stride loop
# covers longer buffers, and fewer, longer-lived threads amortise the index arithmetic.
_MAX_BLOCKS = 4096
# Small segments need small grids, by design; numba would warn once per distinct grid size under 128 blocks.
warnings.filterwarnings("ignore", message=r"Grid size \d+ will likely result in GPU under-utilization")


# -- bit casts and the 16-bit formats (src/half.h, F. Giesen's float_to_half_fast3_rtne) -------------------
# Integer work is in int64 so numba's integer promotion and numpy's (in the simulator) agree.

@cuda.jit(device=True)
def _f2u(f):
    """float32 -> its bit pattern as int64 in [0, 2**32)."""
    box = cuda.local.array(1, np.float32)
    box[0] = f
    return np.int64(box.view(np.uint32)[0])


@cuda.jit(device=True)
def _u2f(u):
    """int64 bit pattern in [0, 2**32) -> float32."""
    box = cuda.local.array(1, np.uint32)
    box[0] = u
    return box.view(np.float32)[0]


@cuda.jit(device=True)
def _f16_to_f32(h):
    h = np.int64(h)
    o = (h & 0x7fff) << 13
    exp = o & (0x7c00 << 13)
    o += (127 - 15) << 23
    if exp == 0x7c00 << 13:  # Inf or NaN
        o += (128 - 16) << 23
    elif exp == 0:  # zero or subnormal: renormalise through the FPU
        o += 1 << 23
        o = _f2u(_u2f(o) - _u2f(113 << 23))
    return _u2f(o | ((h & 0x8000) << 16))


@cuda.jit(device=True)
def _f32_to_f16(f):
    denorm_magic = ((127 - 15) + (23 - 10) + 1) << 23
    x = _f2u(f)
    sign = x & 0x80000000
    x ^= sign
    if x >= (127 + 16) << 23:  # overflow to Inf, or NaN (quiet)
        o = 0x7e00 if x > 255 << 23 else 0x7c00
    elif x < 113 << 23:  # the result is subnormal or zero: let the FPU round
        o = _f2u(_u2f(x) + _u2f(denorm_magic)) - denorm_magic
    else:
        mant_odd = (x >> 13) & 1
        o = (x + ((15 - 127) << 23) + 0xfff + mant_odd) >> 13
    return (o & 0xffff) | (sign >> 16)


@cuda.jit(device=True)
def _bf16_to_f32(h):
    return _u2f(np.int64(h) << 16)


@cuda.jit(device=True)
def _f32_to_bf16(f):
    x = _f2u(f)
    if x & 0x7fffffff > 0x7f800000:  # quiet NaN
        return (x >> 16) | 0x40
    return (x + 0x7fff + ((x >> 16) & 1)) >> 16


@cuda.jit(device=True)
def _same(x):
    return x


# storage format -> (load as the arithmetic type, store from it); None is a native dtype.
_CODECS = {None: (_same, _same), _F16: (_f16_to_f32, _f32_to_f16), _BF16: (_bf16_to_f32, _f32_to_bf16)}


# -- kernels: one factory per function, one kernel per storage format --------------------------------------

@functools.cache
def _reduce_kernel(fmt):
    load, store = _CODECS[fmt]

    @cuda.jit
    def reduce_kernel(out, acc, src, op, scale):
        for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
            a = load(acc[i])
            b = load(src[i])
            if op == _SUM:
                r = a + b
                if scale != 1:
                    r = r * scale
            elif op == _PROD:
                r = a * b
            elif op == _MIN:
                r = b if b < a else a  # a NaN in acc stays, a NaN in src is ignored, as on the host
            else:
                r = b if b > a else a
            out[i] = store(r)

    return reduce_kernel


@functools.cache
def _scale_kernel(fmt):
    load, store = _CODECS[fmt]

    @cuda.jit
    def scale_kernel(buf, factor):
        for i in range(cuda.grid(1), buf.size, cuda.gridsize(1)):
            buf[i] = store(load(buf[i]) * factor)

    return scale_kernel


@functools.cache
def _narrow_kernel(fmt):
    store = _CODECS[fmt][1]

    @cuda.jit
    def narrow_kernel(src, dst):
        for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
            dst[i] = store(src[i])

    return narrow_kernel


@functools.cache
def _widen_kernel(fmt):
    load = _CODECS[fmt][0]

    @cuda.jit
    def widen_kernel(src, dst):
        for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
            dst[i] = load(src[i])

    return widen_kernel


# -- host-side wrappers --------------------------------------------------------------------------------------

def _device_array(buf):
    """``buf`` as a numba device array over the same memory, and its 16-bit format (None if native).

    16-bit float arrays come back as uint16 views. Other ``__cuda_array_interface__`` objects are wrapped
    without a copy (numba waits for the stream they name, if any).
    """
    arr = buf if getattr(buf, "__cuda_ndarray__", False) else cuda.as_cuda_array(buf)
    fmt = HALF_FORMAT.get(np.dtype(arr.dtype))
    return (arr, None) if fmt is None else (arr.view(np.uint16), fmt)


def _arith_scalar(value: float, dtype: np.dtype, fmt):
    """``value`` in the kernel's arithmetic type: float32 for 16-bit formats, else the buffer's dtype."""
    return np.float32(value) if fmt is not None else dtype.type(value)


def _launch(kernel, n: int, *args) -> None:
    if n == 0:
        return
    stream = cuda.default_stream()
    kernel[min(-(-n // _THREADS), _MAX_BLOCKS), _THREADS, stream](*args)
    stream.synchronize()  # this stream only: work of other libraries on their own streams may go on


def reduce_into(acc, src, op: str, scale: float = 1.0, out=None) -> None:
    """``acc[i] = op(acc[i], src[i])``, then ``acc[i] *= scale`` when ``op`` is sum/avg and ``scale != 1``;
    with ``out`` (same length and dtype, acc itself or overlapping neither operand) the result goes there.

    acc, src: 1-D contiguous device arrays, same length (elements) and dtype (float16, bfloat16, float32,
    float64, int32, int64). acc is modified in place; src is read only. op: sum/avg/min/max/prod ("avg" is a
    sum; the caller passes 1/size as ``scale``). float16/bfloat16 use float32 arithmetic and one rounding per
    element; min/max keep a NaN already in acc and ignore one in src, exactly as the host kernels do.
    Raises KeyError for an unknown op. Returns after the kernel has finished.
    """
    acc_d, fmt = _device_array(acc)
    src_d, _ = _device_array(src)
    out_d = acc_d if out is None else _device_array(out)[0]
    s = _arith_scalar(scale, np.dtype(acc_d.dtype), fmt)
    _launch(_reduce_kernel(fmt), acc_d.size, out_d, acc_d, src_d, OP_CODE[op], s)


def scale(buf, factor: float) -> None:
    """``buf *= factor`` in place; buf: 1-D contiguous device array (float dtypes; 16-bit types round once).

    ``factor`` is cast to float32 for float16/bfloat16/float32 buffers and to float64 for float64 ones.
    """
    buf_d, fmt = _device_array(buf)
    _launch(_scale_kernel(fmt), buf_d.size, buf_d, _arith_scalar(factor, np.dtype(buf_d.dtype), fmt))


def narrow(src, dst) -> None:
    """Cast float32 ``src`` into float16/bfloat16 ``dst`` (1-D device arrays, same length), round to nearest
    even; NaN becomes a quiet NaN of the same sign, overflow becomes Inf (as numpy / ml_dtypes do)."""
    src_d, _ = _device_array(src)
    dst_d, fmt = _device_array(dst)
    _launch(_narrow_kernel(fmt), src_d.size, src_d, dst_d)


def widen(src, dst) -> None:
    """Cast float16/bfloat16 ``src`` into float32 ``dst`` (1-D device arrays, same length); exact."""
    src_d, fmt = _device_array(src)
    dst_d, _ = _device_array(dst)
    _launch(_widen_kernel(fmt), src_d.size, src_d, dst_d)
