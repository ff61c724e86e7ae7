# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Host conversion kernels: float32 <-> float16/bfloat16 casts (wire compression) and in-place scaling.

Private: ``torus.kernels`` validates and calls these. Arrays are 1-D C-contiguous; 16-bit types arrive as
uint16 views. Casts round to nearest even, exactly as numpy (float16) and ml_dtypes (bfloat16) do.
"""
from cython.parallel cimport prange
from libc.stdint cimport int32_t, int64_t, uint16_t

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


cdef extern from "loops.h" nogil:
    void torus_narrow_f16(uint16_t* dst, const float* src, Py_ssize_t n)
    void torus_narrow_bf16(uint16_t* dst, const float* src, Py_ssize_t n)
    void torus_widen_f16(float* dst, const uint16_t* src, Py_ssize_t n)
    void torus_widen_bf16(float* dst, const uint16_t* src, Py_ssize_t n)
    void torus_scale_f16(uint16_t* buf, Py_ssize_t n, float s)
    void torus_scale_bf16(uint16_t* buf, Py_ssize_t n, float s)

# What one thread's block does (loops.h: vectorised per CPU, F16C where it helps).
cdef enum:
    NARROW, WIDEN, SCALE


cdef void _block(int what, int fmt, uint16_t* half, float* single, Py_ssize_t n, float f) noexcept nogil:
    if what == NARROW:
        if fmt == 0:
            torus_narrow_f16(half, single, n)
        else:
            torus_narrow_bf16(half, single, n)
    elif what == WIDEN:
        if fmt == 0:
            torus_widen_f16(single, half, n)
        else:
            torus_widen_bf16(single, half, n)
    elif fmt == 0:
        torus_scale_f16(half, n, f)
    else:
        torus_scale_bf16(half, n, f)


cdef void _split(int what, int fmt, uint16_t* half, float* single, Py_ssize_t n, float f,
                 int t) noexcept nogil:
    """``_block`` over ``n`` elements, cut into ``t`` contiguous blocks, one per OpenMP thread."""
    cdef Py_ssize_t b, lo, hi, block
    if t == 1:
        _block(what, fmt, half, single, n, f)
        return
    block = (n + t - 1) // t
    for b in prange(t, num_threads=t, schedule='static'):
        lo = b * block
        hi = lo + block if lo + block < n else n
        if hi > lo:
            _block(what, fmt, half + lo, (single + lo) if single != NULL else NULL, hi - lo, f)


def narrow(const float[::1] src, uint16_t[::1] dst, int fmt, int nthreads):
    """dst = round(src) as float16 (fmt 0) or bfloat16 (fmt 1); equal lengths."""
    cdef Py_ssize_t n = src.shape[0]
    if n:
        with nogil:
            _split(NARROW, fmt, &dst[0], <float*>&src[0], n, 1.0, _threads(n, nthreads))


def widen(const uint16_t[::1] src, float[::1] dst, int fmt, int nthreads):
    """dst = float32(src) from float16 (fmt 0) or bfloat16 (fmt 1); exact."""
    cdef Py_ssize_t n = src.shape[0]
    if n:
        with nogil:
            _split(WIDEN, fmt, <uint16_t*>&src[0], &dst[0], n, 1.0, _threads(n, nthreads))


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
    cdef Py_ssize_t n = buf.shape[0]
    if n:
        with nogil:
            _split(SCALE, fmt, &buf[0], NULL, n, <float>factor, _threads(n, nthreads))
