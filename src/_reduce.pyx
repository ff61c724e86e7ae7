# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Host reduction kernel: ``acc[i] = op(acc[i], src[i])`` (times ``scale`` for a sum when ``scale != 1``),
or the same into a third array ``out``.

Private: ``torus.kernels.reduce_into`` calls :func:`reduce`. One entry point for every dtype, taking numpy
arrays through numpy's C API: the schedules call it once per segment, often on a few KiB, where the cost of
the call itself (Cython's fused-type dispatch and two typed memoryviews) used to exceed the loop.
float16/bfloat16 are widened to float32 for each operation and rounded once (round-to-nearest-even) when
stored. The loops themselves are in loops.h (vectorised per CPU); this module splits the work across OpenMP
threads.
"""
cimport numpy as cnp
from cython.parallel cimport prange
from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport int32_t, int64_t, uint16_t

import ml_dtypes
import numpy as np

cnp.import_array()

cdef extern from "loops.h" nogil:
    void torus_reduce_f32(float* acc, const float* src, Py_ssize_t n, int op, float s, int scaled)
    void torus_reduce_f64(double* acc, const double* src, Py_ssize_t n, int op, double s, int scaled)
    void torus_reduce_i32(int32_t* acc, const int32_t* src, Py_ssize_t n, int op, int32_t s, int scaled)
    void torus_reduce_i64(int64_t* acc, const int64_t* src, Py_ssize_t n, int op, int64_t s, int scaled)
    void torus_reduce_f16(uint16_t* acc, const uint16_t* src, Py_ssize_t n, int op, float s)
    void torus_reduce_bf16(uint16_t* acc, const uint16_t* src, Py_ssize_t n, int op, float s)
    void torus_reduce_f323(float* out, const float* a, const float* b, Py_ssize_t n, int op, float s, int scaled)
    void torus_reduce_f643(double* out, const double* a, const double* b, Py_ssize_t n, int op, double s,
                           int scaled)
    void torus_reduce_i323(int32_t* out, const int32_t* a, const int32_t* b, Py_ssize_t n, int op, int32_t s,
                           int scaled)
    void torus_reduce_i643(int64_t* out, const int64_t* a, const int64_t* b, Py_ssize_t n, int op, int64_t s,
                           int scaled)
    void torus_reduce_f163(uint16_t* out, const uint16_t* a, const uint16_t* b, Py_ssize_t n, int op, float s)
    void torus_reduce_bf163(uint16_t* out, const uint16_t* a, const uint16_t* b, Py_ssize_t n, int op, float s)

# Kinds of element the loops know.
cdef enum:
    F32, F64, I32, I64, F16, BF16

# ml_dtypes registers bfloat16 as a user-defined numpy type; its type number is fixed once imported.
cdef int BF16_TYPENUM = np.dtype(ml_dtypes.bfloat16).num

# Below this many bytes per thread a parallel region costs more than it saves. Counted in bytes, not
# elements: the loops run at about the same bytes per second for every dtype (16-bit ones included), and a
# segment is a number of bytes. Counted in elements (65,536, this value for float32), every 16-bit segment of
# the default 256 KiB across nodes forked a parallel region where a float32 one of the same bytes did not;
# where the ranks' threads outnumber the cores, each such region may wait a scheduler slice for its second
# thread while the link idles (bench/wire/README.md).
cdef Py_ssize_t MIN_BYTES_PER_THREAD = 256 << 10


cdef inline int _threads(Py_ssize_t nbytes, int nthreads) noexcept nogil:
    if nthreads < 1:
        return 1
    if nbytes < MIN_BYTES_PER_THREAD * nthreads:
        nthreads = <int>(nbytes // MIN_BYTES_PER_THREAD)
    return nthreads if nthreads > 1 else 1


cdef int _kind(cnp.ndarray a) except -1:
    cdef int num = cnp.PyArray_TYPE(a)
    cdef Py_ssize_t size = cnp.PyArray_ITEMSIZE(a)
    if num == cnp.NPY_FLOAT32:
        return F32
    if num == cnp.NPY_FLOAT64:
        return F64
    if num == cnp.NPY_FLOAT16:
        return F16
    if num == BF16_TYPENUM:
        return BF16
    if cnp.PyArray_ISINTEGER(a) and cnp.PyArray_ISSIGNED(a) and (size == 4 or size == 8):
        return I32 if size == 4 else I64
    raise TypeError(f"torus reduce kernel: unsupported dtype {a.dtype}")


cdef void _loop(int kind, char* out, const char* a, const char* b, Py_ssize_t n, int op,
               double scale) noexcept nogil:
    """out = op(a, b); out is a (in place) or overlaps neither."""
    cdef int scaled = scale != 1.0
    if out == a:
        if kind == F32:
            torus_reduce_f32(<float*>out, <const float*>b, n, op, <float>scale, scaled)
        elif kind == F64:
            torus_reduce_f64(<double*>out, <const double*>b, n, op, scale, scaled)
        elif kind == I32:
            torus_reduce_i32(<int32_t*>out, <const int32_t*>b, n, op, <int32_t>scale, scaled)
        elif kind == I64:
            torus_reduce_i64(<int64_t*>out, <const int64_t*>b, n, op, <int64_t>scale, scaled)
        elif kind == F16:
            torus_reduce_f16(<uint16_t*>out, <const uint16_t*>b, n, op, <float>scale)
        else:
            torus_reduce_bf16(<uint16_t*>out, <const uint16_t*>b, n, op, <float>scale)
    elif kind == F32:
        torus_reduce_f323(<float*>out, <const float*>a, <const float*>b, n, op, <float>scale, scaled)
    elif kind == F64:
        torus_reduce_f643(<double*>out, <const double*>a, <const double*>b, n, op, scale, scaled)
    elif kind == I32:
        torus_reduce_i323(<int32_t*>out, <const int32_t*>a, <const int32_t*>b, n, op, <int32_t>scale, scaled)
    elif kind == I64:
        torus_reduce_i643(<int64_t*>out, <const int64_t*>a, <const int64_t*>b, n, op, <int64_t>scale, scaled)
    elif kind == F16:
        torus_reduce_f163(<uint16_t*>out, <const uint16_t*>a, <const uint16_t*>b, n, op, <float>scale)
    else:
        torus_reduce_bf163(<uint16_t*>out, <const uint16_t*>a, <const uint16_t*>b, n, op, <float>scale)


cdef inline bint _overlap(const char* p, const char* q, Py_ssize_t nbytes) noexcept nogil:
    return p < q + nbytes and q < p + nbytes


def reduce(cnp.ndarray acc not None, cnp.ndarray src not None, int op, double scale, int nthreads,
           cnp.ndarray out=None):
    """acc = op(acc, src) [* scale for sum]; or, with ``out``, out = op(acc, src) and acc is only read.

    C-contiguous arrays of equal size and dtype; the written one writeable; ``out`` either is ``acc`` or
    overlaps neither operand. op: 0 sum, 1 prod, 2 min, 3 max. Raises TypeError for another dtype and
    ValueError for arrays that do not fit; these checks read only the array headers (tens of nanoseconds)."""
    cdef Py_ssize_t n = cnp.PyArray_SIZE(acc), item, nbytes
    cdef int kind = _kind(acc)
    cdef char* o
    cdef const char* a
    cdef const char* s
    if out is None:
        out = acc
    if (cnp.PyArray_TYPE(src) != cnp.PyArray_TYPE(acc) or cnp.PyArray_SIZE(src) != n
            or cnp.PyArray_TYPE(out) != cnp.PyArray_TYPE(acc) or cnp.PyArray_SIZE(out) != n):
        raise ValueError(f"torus reduce kernel: acc is {n} x {acc.dtype}, src is {src.size} x {src.dtype}, "
                         f"out is {out.size} x {out.dtype}")
    if not (cnp.PyArray_IS_C_CONTIGUOUS(acc) and cnp.PyArray_IS_C_CONTIGUOUS(src)
            and cnp.PyArray_IS_C_CONTIGUOUS(out)):
        raise ValueError("torus reduce kernel: acc, src and out must be C-contiguous")
    if not cnp.PyArray_ISWRITEABLE(out):
        raise ValueError("torus reduce kernel: the output (acc or out) is read-only")
    if n == 0:
        return
    o = <char*>cnp.PyArray_DATA(out)
    a = <const char*>cnp.PyArray_DATA(acc)
    s = <const char*>cnp.PyArray_DATA(src)
    item = cnp.PyArray_ITEMSIZE(acc)
    nbytes = n * item
    if o != a and (_overlap(o, a, nbytes) or _overlap(o, s, nbytes)):
        raise ValueError("torus reduce kernel: out overlaps an operand without being acc")
    with nogil:
        _reduce_raw(kind, o, a, s, n, item, op, scale, nthreads)


cdef void _reduce_raw(int kind, char* o, const char* a, const char* s, Py_ssize_t n, Py_ssize_t item, int op,
                      double scale, int nthreads) noexcept nogil:
    """``reduce`` on raw pointers, checks done: split over up to ``nthreads`` OpenMP threads."""
    cdef Py_ssize_t b, lo, hi, block
    cdef int t = _threads(n * item, nthreads)
    if t == 1:
        _loop(kind, o, a, s, n, op, scale)
    else:
        block = (n + t - 1) // t
        for b in prange(t, num_threads=t, schedule='static'):
            lo = b * block
            hi = lo + block if lo + block < n else n
            if hi > lo:
                _loop(kind, o + lo * item, a + lo * item, s + lo * item, hi - lo, op, scale)


def threads(cnp.ndarray a not None, int nthreads):
    """The OpenMP threads ``reduce`` splits a reduction over ``a`` across with at most ``nthreads``."""
    return _threads(cnp.PyArray_SIZE(a) * cnp.PyArray_ITEMSIZE(a), nthreads)


def kind(cnp.ndarray a not None):
    """The element kind code of ``a``'s dtype for ``raw_reduce`` (TypeError for a dtype the kernels lack)."""
    return _kind(a)


def raw_reduce():
    """A capsule holding ``_reduce_raw`` (for torus._ext._step_loop, which calls it without Python)."""
    return PyCapsule_New(<void*>_reduce_raw, b"torus._ext._reduce.raw", NULL)
