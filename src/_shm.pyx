# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The shared-memory transport's step loop (the protocol is in torus/runtime/shm.py's docstring).

Private: ``torus.runtime.shm.SharedMemory.run`` validates and calls :func:`run`; nothing here checks its
arguments. Reductions go through ``_reduce_raw`` of torus._ext._reduce (the kernels of src/loops.h, taken
from its capsule as the C step loop does), copies through memcpy, flags through src/shm_flags.h.
"""
cimport numpy as cnp
from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy

from torus._ext import _reduce

cnp.import_array()

cdef extern from "shm_flags.h" nogil:
    uint64_t torus_flag_load(const uint64_t* flag)
    void torus_flag_store(uint64_t* flag, uint64_t value)

cdef extern from "sched.h" nogil:
    int sched_yield()

cdef extern from "time.h" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int CLOCK_MONOTONIC
    int clock_gettime(int, timespec*)

ctypedef void (*reduce_t)(int, char*, const char*, const char*, Py_ssize_t, Py_ssize_t, int, double,
                          int) noexcept nogil
cdef reduce_t _reduce_raw = <reduce_t>PyCapsule_GetPointer(_reduce.raw_reduce(), b"torus._ext._reduce.raw")

# A rank's region of the window: two flag lines (copied, reduced), then buffer 0 and buffer 1, each a header
# line (the call's signature) followed by slot_bytes of data.
cdef enum:
    COPIED = 0
    REDUCED = 64
    FLAG_AREA = 128
    HEADER = 64

FLAG_BYTES = FLAG_AREA
HEADER_BYTES = HEADER

# Collectives (``mode``) and what ``run`` returns in its status.
cpdef enum:
    ALLREDUCE = 0
    REDUCE_SCATTER = 1
    ALLGATHER = 2

cpdef enum:
    DONE = 0
    STALLED_COPY = 1
    STALLED_REDUCE = 2
    MISMATCH = 3


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef int _wait(const uint64_t* flag, uint64_t target, double timeout) noexcept nogil:
    """0 once ``*flag >= target``, 1 after ``timeout`` s (> 0; else forever) without. Yields the core after
    every unsuccessful look, as the C step loop does: the rank waited for may need this very core."""
    cdef double deadline = 0.0
    cdef int polls = 0
    if torus_flag_load(flag) >= target:
        return 0
    if timeout > 0:
        deadline = _now() + timeout
    while True:
        sched_yield()
        if torus_flag_load(flag) >= target:
            return 0
        polls += 1
        if timeout > 0 and (polls & 63) == 0 and _now() > deadline:
            return 1


cdef inline int64_t _piece(int64_t count, int64_t lo, int64_t seg) noexcept nogil:
    """Elements of a chunk of ``count`` in the segment starting at ``lo``."""
    cdef int64_t n = count - lo
    return 0 if n <= 0 else (seg if n > seg else n)


def run(const int64_t[::1] bases, int rank, cnp.ndarray src not None, cnp.ndarray out not None,
        const int64_t[::1] counts, const int64_t[::1] displs, int64_t seg, int64_t stride, int64_t slot_bytes,
        int mode, int kind, int op, double scale, int nthreads, double timeout, uint64_t seq, uint64_t sig):
    """Run one collective over the window whose ranks' regions start at ``bases`` (addresses).

    ``src``: the input (all chunks; all-gather: this rank's chunk); ``out``: the output (all chunks;
    reduce-scatter: this rank's chunk); ``counts``/``displs``: every rank's chunk, in elements. Step ``i``
    moves elements ``[i*seg, (i+1)*seg)`` of every chunk, each in its sub-slot ``stride`` bytes apart (one
    sub-slot for all-gather), with flag value ``seq + i + 1``. Returns ``(status, step, peer, nsteps)``:
    status DONE, STALLED_COPY / STALLED_REDUCE (no progress for ``timeout`` s waiting on ``peer``'s copy-in /
    reduced chunk at ``step``), MISMATCH (``peer``'s signature differs from ``sig``)."""
    cdef int P = bases.shape[0], k, q, status = DONE, peer = -1
    cdef char* s = <char*>cnp.PyArray_DATA(src)
    cdef char* o = <char*>cnp.PyArray_DATA(out)
    cdef Py_ssize_t item = cnp.PyArray_ITEMSIZE(out)
    cdef int64_t nsteps = 0, i = 0, lo, n, maxc = 0, r, buf_off, sub
    cdef uint64_t cur
    cdef char* mine
    cdef char* acc
    for r in range(P):
        if counts[r] > maxc:
            maxc = counts[r]
    nsteps = (maxc + seg - 1) // seg
    with nogil:
        for i in range(nsteps):
            cur = seq + <uint64_t>i + 1
            buf_off = FLAG_AREA + <int64_t>(cur & 1) * (HEADER + slot_bytes)  # double buffer by parity
            lo = i * seg
            mine = <char*>bases[rank] + buf_off
            # Copy in. Buffer (cur & 1) is free: every peer passed step cur - 1 (we waited for that below),
            # which it enters only after its last read of this buffer, in step cur - 2.
            if mode == ALLGATHER:
                n = _piece(counts[rank], lo, seg)
                if n:
                    memcpy(mine + HEADER, s + lo * item, n * item)
            else:
                for r in range(P):
                    n = _piece(counts[r], lo, seg)
                    if n:
                        memcpy(mine + HEADER + r * stride, s + (displs[r] + lo) * item, n * item)
            (<uint64_t*>mine)[0] = sig
            torus_flag_store(<uint64_t*>(<char*>bases[rank] + COPIED), cur)
            # Wait for every peer's input; check it is the same call.
            for k in range(1, P):
                q = (rank + k) % P
                if _wait(<const uint64_t*>(<char*>bases[q] + COPIED), cur, timeout):
                    status, peer = STALLED_COPY, q
                    break
                if (<uint64_t*>(<char*>bases[q] + buf_off))[0] != sig:
                    status, peer = MISMATCH, q
                    break
            if status:
                break
            # Reduce this rank's chunk straight from every peer's sub-slot.
            sub = HEADER + rank * stride
            n = _piece(counts[rank], lo, seg) if mode != ALLGATHER else 0
            if n and mode == ALLREDUCE:  # into our own sub-slot, where the others copy it from
                acc = mine + sub
                for k in range(1, P):
                    q = (rank + k) % P
                    _reduce_raw(kind, acc, acc, <char*>bases[q] + buf_off + sub, n, item, op,
                                scale if k == P - 1 else 1.0, nthreads)
            elif n and mode == REDUCE_SCATTER:  # into the output, ranks in order
                acc = o + lo * item
                if P == 1:
                    memcpy(acc, mine + sub, n * item)
                else:
                    _reduce_raw(kind, acc, <char*>bases[0] + buf_off + sub, <char*>bases[1] + buf_off + sub, n,
                                item, op, scale if P == 2 else 1.0, nthreads)
                for q in range(2, P):
                    _reduce_raw(kind, acc, acc, <char*>bases[q] + buf_off + sub, n, item, op,
                                scale if q == P - 1 else 1.0, nthreads)
            if mode == REDUCE_SCATTER:
                continue
            if mode == ALLREDUCE:
                torus_flag_store(<uint64_t*>(<char*>bases[rank] + REDUCED), cur)
            # Copy out every rank's (reduced) chunk, starting with our own, then the next ranks, so that the
            # ranks do not all read the same peer at once.
            for k in range(P):
                q = (rank + k) % P
                n = _piece(counts[q], lo, seg)
                if n == 0 or (mode == ALLGATHER and q == rank):  # all-gather: our chunk is in out already
                    continue
                if mode == ALLREDUCE and q != rank and _wait(<const uint64_t*>(<char*>bases[q] + REDUCED), cur,
                                                              timeout):
                    status, peer = STALLED_REDUCE, q
                    break
                memcpy(o + (displs[q] + lo) * item,
                       <char*>bases[q] + buf_off + HEADER + (q * stride if mode == ALLREDUCE else 0), n * item)
            if status:
                break
    return status, i, peer, nsteps
