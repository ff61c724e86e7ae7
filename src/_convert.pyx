# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Host conversion kernels: float32 <-> float16/bfloat16 casts (wire compression) and in-place scaling.

Private: ``torus.kernels`` validates and calls these. Arrays are 1-D C-contiguous; 16-bit types arrive as
uint16 views. Casts round to nearest even, exactly as numpy (float16) and ml_dtypes (bfloat16) do.
"""
from cython.parallel cimport prange
from libc.stdint cimport int32_t, int64_t, uint16_t

cdef extern from "half.h" nogil:
    float f16_to_f32(uint16_t h)
    uint16_t f32_to_f16(float f)
    float bf16_to_f32(uint16_t h)
    uint16_t f32_to_bf16(float f)

ctypedef fused native_t:
    float
    double
    int32_t
    int64_t

cdef Py_ssize_t MIN_PER_THREAD = 1 << 16


cdef inline int _threads(Py_ssize_t n, int nthreads) noexcept nogil:
    if nthreads < 1 or n < MIN_PER_THREAD * nthreads:
        nthreads = <int>(n // MIN_PER_THREAD) if nthreads >= 1 else 1
    return nthreads if nthreads > 1 else 1


def narrow(const float[::1] src, uint16_t[::1] dst, int fmt, int nthreads):
    """dst = round(src) as float16 (fmt 0) or bfloat16 (fmt 1); equal lengths."""
    cdef Py_ssize_t i, n = src.shape[0]
    cdef int t = _threads(n, nthreads)
    with nogil:
        if fmt == 0:
            for i in prange(n, num_threads=t, schedule='static'):
                dst[i] = f32_to_f16(src[i])
        else:
            for i in prange(n, num_threads=t, schedule='static'):
                dst[i] = f32_to_bf16(src[i])


def widen(const uint16_t[::1] src, float[::1] dst, int fmt, int nthreads):
    """dst = float32(src) from float16 (fmt 0) or bfloat16 (fmt 1); exact."""
    cdef Py_ssize_t i, n = src.shape[0]
    cdef int t = _threads(n, nthreads)
    with nogil:
        if fmt == 0:
            for i in prange(n, num_threads=t, schedule='static'):
                dst[i] = f16_to_f32(src[i])
        else:
            for i in prange(n, num_threads=t, schedule='static'):
                dst[i] = bf16_to_f32(src[i])


def scale_native(native_t[::1] buf, double factor, int nthreads):
    """buf *= factor in place (float32/float64)."""
    cdef Py_ssize_t i, n = buf.shape[0]
    cdef int t = _threads(n, nthreads)
    cdef native_t f = <native_t>factor
    with nogil:
        for i in prange(n, num_threads=t, schedule='static'):
            buf[i] = buf[i] * f


def scale_half(uint16_t[::1] buf, double factor, int fmt, int nthreads):
    """buf = round(float32(buf) * factor) in place, float16 (fmt 0) or bfloat16 (fmt 1)."""
    cdef Py_ssize_t i, n = buf.shape[0]
    cdef int t = _threads(n, nthreads)
    cdef float f = <float>factor
    with nogil:
        if fmt == 0:
            for i in prange(n, num_threads=t, schedule='static'):
                buf[i] = f32_to_f16(f16_to_f32(buf[i]) * f)
        else:
            for i in prange(n, num_threads=t, schedule='static'):
                buf[i] = f32_to_bf16(bf16_to_f32(buf[i]) * f)
