# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Host reduction kernels: ``acc[i] = op(acc[i], src[i])`` (optionally times ``scale``), no validation.

Private: ``torus.kernels`` validates dtypes, shapes and contiguity and then calls these. Every function
takes 1-D C-contiguous numpy arrays of equal length and dtype; float16/bfloat16 arrive as uint16 views and
are widened to float32 for each operation and rounded once (round-to-nearest-even) when stored. The loops
themselves are in loops.h (vectorised per CPU); this module splits the work across OpenMP threads.
"""
from cython.parallel cimport prange
from libc.stdint cimport int32_t, int64_t, uint16_t

cdef extern from "loops.h" nogil:
    void torus_reduce_f32(float* acc, const float* src, Py_ssize_t n, int op, float s, int scaled)
    void torus_reduce_f64(double* acc, const double* src, Py_ssize_t n, int op, double s, int scaled)
    void torus_reduce_i32(int32_t* acc, const int32_t* src, Py_ssize_t n, int op, int32_t s, int scaled)
    void torus_reduce_i64(int64_t* acc, const int64_t* src, Py_ssize_t n, int op, int64_t s, int scaled)
    void torus_reduce_f16(uint16_t* acc, const uint16_t* src, Py_ssize_t n, int op, float s)
    void torus_reduce_bf16(uint16_t* acc, const uint16_t* src, Py_ssize_t n, int op, float s)

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


cdef inline void _native(native_t* acc, const native_t* src, Py_ssize_t n, int op, double scale) noexcept nogil:
    cdef int scaled = scale != 1.0
    if native_t is float:
        torus_reduce_f32(acc, src, n, op, <float>scale, scaled)
    elif native_t is double:
        torus_reduce_f64(acc, src, n, op, scale, scaled)
    elif native_t is int32_t:
        torus_reduce_i32(acc, src, n, op, <int32_t>scale, scaled)
    else:
        torus_reduce_i64(acc, src, n, op, <int64_t>scale, scaled)


cdef inline void _half(uint16_t* acc, const uint16_t* src, Py_ssize_t n, int op, float scale,
                       int fmt) noexcept nogil:
    if fmt == 0:
        torus_reduce_f16(acc, src, n, op, scale)
    else:
        torus_reduce_bf16(acc, src, n, op, scale)


def reduce_native(native_t[::1] acc, const native_t[::1] src, int op, double scale, int nthreads):
    """acc = op(acc, src) [* scale for SUM]; 1-D, same length; float32/float64/int32/int64."""
    cdef Py_ssize_t n = acc.shape[0], b, lo, hi, block
    cdef int t = _threads(n, nthreads)
    if n == 0:
        return
    with nogil:
        if t == 1:
            _native(&acc[0], &src[0], n, op, scale)
        else:
            block = (n + t - 1) // t
            for b in prange(t, num_threads=t, schedule='static'):
                lo = b * block
                hi = lo + block if lo + block < n else n
                if hi > lo:
                    _native(&acc[lo], &src[lo], hi - lo, op, scale)


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
            _half(&acc[0], &src[0], n, op, s, fmt)
        else:
            block = (n + t - 1) // t
            for b in prange(t, num_threads=t, schedule='static'):
                lo = b * block
                hi = lo + block if lo + block < n else n
                if hi > lo:
                    _half(&acc[lo], &src[lo], hi - lo, op, s, fmt)
