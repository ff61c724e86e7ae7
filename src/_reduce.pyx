# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Host reduction kernels: ``acc[i] = op(acc[i], src[i])`` (optionally times ``scale``), no validation.

Private: ``torus.kernels`` validates dtypes, shapes and contiguity and then calls these. Every function
takes 1-D C-contiguous numpy arrays of equal length and dtype; float16/bfloat16 arrive as uint16 views and
are widened to float32 for each operation and rounded once (round-to-nearest-even) when stored.
"""
from cython.parallel cimport prange
from libc.stdint cimport int32_t, int64_t, uint16_t
cimport numpy as cnp

cnp.import_array()

cdef extern from "half.h" nogil:
    float f16_to_f32(uint16_t h)
    uint16_t f32_to_f16(float f)
    float bf16_to_f32(uint16_t h)
    uint16_t f32_to_bf16(float f)

# Operation codes shared with torus/ops.py.
cdef enum:
    OP_SUM = 0
    OP_PROD = 1
    OP_MIN = 2
    OP_MAX = 3

# Storage formats of the 16-bit types.
cdef enum:
    FMT_F16 = 0
    FMT_BF16 = 1

ctypedef fused native_t:
    float
    double
    int32_t
    int64_t

# Below this many elements per thread a parallel region costs more than it saves.
cdef Py_ssize_t MIN_PER_THREAD = 1 << 16


cdef inline int _threads(Py_ssize_t n, int nthreads) noexcept nogil:
    if nthreads < 1:
        return 1
    if n < MIN_PER_THREAD * nthreads:
        nthreads = <int>(n // MIN_PER_THREAD)
    return nthreads if nthreads > 1 else 1


cdef void _native_block(native_t* acc, const native_t* src, Py_ssize_t n, int op,
                        double scale) noexcept nogil:
    cdef Py_ssize_t i
    cdef native_t s
    if op == OP_SUM and scale != 1.0:
        s = <native_t>scale
        for i in range(n):
            acc[i] = (acc[i] + src[i]) * s
    elif op == OP_SUM:
        for i in range(n):
            acc[i] = acc[i] + src[i]
    elif op == OP_PROD:
        for i in range(n):
            acc[i] = acc[i] * src[i]
    elif op == OP_MIN:
        for i in range(n):
            acc[i] = src[i] if src[i] < acc[i] else acc[i]
    else:
        for i in range(n):
            acc[i] = src[i] if src[i] > acc[i] else acc[i]


cdef inline float _widen(uint16_t h, int fmt) noexcept nogil:
    return f16_to_f32(h) if fmt == FMT_F16 else bf16_to_f32(h)


cdef inline uint16_t _narrow(float f, int fmt) noexcept nogil:
    return f32_to_f16(f) if fmt == FMT_F16 else f32_to_bf16(f)


cdef void _half_block(uint16_t* acc, const uint16_t* src, Py_ssize_t n, int op, float scale,
                      int fmt) noexcept nogil:
    cdef Py_ssize_t i
    cdef float a, b, r
    for i in range(n):
        a = _widen(acc[i], fmt)
        b = _widen(src[i], fmt)
        if op == OP_SUM:
            r = (a + b) * scale
        elif op == OP_PROD:
            r = a * b
        elif op == OP_MIN:
            r = b if b < a else a
        else:
            r = b if b > a else a
        acc[i] = _narrow(r, fmt)


def reduce_native(native_t[::1] acc, const native_t[::1] src, int op, double scale, int nthreads):
    """acc = op(acc, src) [* scale for SUM]; 1-D, same length; float32/float64/int32/int64."""
    cdef Py_ssize_t n = acc.shape[0], b, lo, hi, block
    cdef int t = _threads(n, nthreads)
    if n == 0:
        return
    with nogil:
        if t == 1:
            _native_block(&acc[0], &src[0], n, op, scale)
        else:
            block = (n + t - 1) // t
            for b in prange(t, num_threads=t, schedule='static'):
                lo = b * block
                hi = lo + block if lo + block < n else n
                if hi > lo:
                    _native_block(&acc[lo], &src[lo], hi - lo, op, scale)


def reduce_half(uint16_t[::1] acc, const uint16_t[::1] src, int op, double scale, int fmt,
                int nthreads):
    """The same for float16 (fmt 0) or bfloat16 (fmt 1) stored as uint16, float32 arithmetic."""
    cdef Py_ssize_t n = acc.shape[0], b, lo, hi, block
    cdef int t = _threads(n, nthreads)
    cdef float s = <float>scale
    if n == 0:
        return
    with nogil:
        if t == 1:
            _half_block(&acc[0], &src[0], n, op, s, fmt)
        else:
            block = (n + t - 1) // t
            for b in prange(t, num_threads=t, schedule='static'):
                lo = b * block
                hi = lo + block if lo + block < n else n
                if hi > lo:
                    _half_block(&acc[lo], &src[lo], hi - lo, op, s, fmt)
