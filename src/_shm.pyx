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
    void torus_flag_sleep(const uint64_t* flag, uint64_t seen, double seconds)
    void torus_cpu_relax()

cdef extern from "shm_copy.h" nogil:
    void torus_copy_stream(char* dst, const char* src, size_t n)
    void torus_stream_fence()

from host_c cimport monotonic_s, reduce_t, sched_yield

cdef reduce_t _reduce_raw = <reduce_t>PyCapsule_GetPointer(_reduce.raw_reduce(), b"torus._ext._reduce.raw")

# A rank's region of the window: two flag lines (copied, reduced), then buffer 0 and buffer 1, each a header
# line (the call's signature) followed by slot_bytes of data.
cdef enum:
    COPIED = 0
    LEFT = 16  # in copied's line, after its sleeper count (src/shm_flags.h): nonzero once this rank's Python exits
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
    ALLREDUCE_WHOLE = 3

cpdef enum:
    DONE = 0
    STALLED_COPY = 1
    STALLED_REDUCE = 2
    MISMATCH = 3
    PEER_ERROR = 4
    PEER_OTHER = 5
    PEER_LEFT = 6

# The headers a rank writes instead of a signature (``announce``) when its own arguments failed their local
# check, and when it runs another algorithm than shm in this call with the argument check on; signatures are
# 32-bit checksums, so neither ever equals one.
cdef uint64_t _ERROR_SIG = 0xFFFFFFFFFFFFFFFFULL
cdef uint64_t _OTHER_SIG = 0xFFFFFFFFFFFFFFFEULL
ERROR_SIG = _ERROR_SIG
OTHER_SIG = _OTHER_SIG


# Longest single sleep of a wait: how often a sleeping rank looks at its deadline (a wake-up is never lost).
cdef double _NAP = 0.05

# Bytes of a chunk's segment reduced at a time, from every peer, before the next: the block of the result
# stays in L1 (32-48 KiB on current x86) between the peers' passes and its copy out.
cdef int64_t _BLOCK_BYTES = 16384


cdef int _wait(const char* region, int64_t flag_off, uint64_t target, double timeout, int spin,
               int stalled) noexcept nogil:
    """Wait on the flag at ``flag_off`` in a peer's ``region``: DONE once it is ``>= target``, ``stalled``
    after ``timeout`` s (> 0; else forever) without, PEER_LEFT once the peer has left (its ``LEFT`` word set:
    its Python exited, ``mark_left``) without storing it: it never will, since it stores its flags before it
    leaves (looked at between sleeps, which its mark wakes). ``spin >= 0``: polls
    that many times (a few microseconds when every rank has its own core); ``spin < 0``: yields the core
    ``-spin`` times instead (more ranks than cores: the rank waited for may need this very core, and on a
    quiet node a yield hands it over at once). Then sleeps on the flag until its writer wakes it
    (src/shm_flags.h): a rank that kept yielding would stay runnable and take its share of a busy core."""
    cdef const uint64_t* flag = <const uint64_t*>(region + flag_off)
    cdef const uint64_t* gone = <const uint64_t*>(region + LEFT)
    cdef double deadline = 0.0, left = _NAP
    cdef int polls = 0
    cdef uint64_t seen = torus_flag_load(flag)
    if seen >= target:
        return 0
    while polls < spin:
        torus_cpu_relax()
        if torus_flag_load(flag) >= target:
            return 0
        polls += 1
    while polls < -spin:
        sched_yield()
        if torus_flag_load(flag) >= target:
            return 0
        polls += 1
    if timeout > 0:
        deadline = monotonic_s() + timeout
    while True:
        seen = torus_flag_load(flag)
        if seen >= target:
            return 0
        if torus_flag_load(gone):  # acquire: the writer's flag stores before it came are visible now
            return DONE if torus_flag_load(flag) >= target else PEER_LEFT
        if timeout > 0:
            left = deadline - monotonic_s()
            if left <= 0:
                return stalled
            if left > _NAP:
                left = _NAP
        torus_flag_sleep(flag, seen, left)


cdef inline void _copy_out(char* dst, const char* src, size_t n, bint stream) noexcept nogil:
    if stream:
        torus_copy_stream(dst, src, n)
    else:
        memcpy(dst, src, n)


cdef inline int64_t _piece(int64_t count, int64_t lo, int64_t seg) noexcept nogil:
    """Elements of a chunk of ``count`` in the segment starting at ``lo``."""
    cdef int64_t n = count - lo
    return 0 if n <= 0 else (seg if n > seg else n)


cdef int _join(const int64_t[::1] bases, int rank, int P, uint64_t cur, uint64_t sig, int64_t header_off,
               double timeout, int spin, int* peer) noexcept nogil:
    """Wait for every peer's ``copied >= cur`` and compare the signature in its header at ``header_off``:
    DONE, or STALLED_COPY / PEER_LEFT / PEER_ERROR / PEER_OTHER / MISMATCH with ``peer[0]`` the first peer
    found so."""
    cdef int k, q
    cdef uint64_t theirs
    cdef int w
    for k in range(1, P):
        q = (rank + k) % P
        w = _wait(<char*>bases[q], COPIED, cur, timeout, spin, STALLED_COPY)
        if w:
            peer[0] = q
            return w
        theirs = (<uint64_t*>(<char*>bases[q] + header_off))[0]
        if theirs != sig:
            peer[0] = q
            return PEER_ERROR if theirs == _ERROR_SIG else PEER_OTHER if theirs == _OTHER_SIG else MISMATCH
    return DONE


cdef void _copy_in(const int64_t[::1] bases, int rank, int P, const char* s, const int64_t[::1] counts,
                   const int64_t[::1] displs, int64_t lo, int64_t seg, int64_t stride, int64_t slot_bytes,
                   Py_ssize_t item, int mode, uint64_t step, uint64_t sig) noexcept nogil:
    """Copy in what the peers need at ``step`` (elements ``[lo, lo + seg)`` of each chunk) into our buffer
    ``step & 1``, and the signature into its header: our own chunk for all-gather, every other rank's chunk
    for a reduction (our own chunk is reduced from src where it lies). Published by the caller."""
    cdef char* mine = <char*>bases[rank] + FLAG_AREA + <int64_t>(step & 1) * (HEADER + slot_bytes)
    cdef int64_t n
    cdef int r
    if mode == ALLGATHER:
        n = _piece(counts[rank], lo, seg)
        if n:
            memcpy(mine + HEADER, s + lo * item, n * item)
    else:
        for r in range(P):
            n = _piece(counts[r], lo, seg)
            if n and r != rank:
                memcpy(mine + HEADER + r * stride, s + (displs[r] + lo) * item, n * item)
    (<uint64_t*>mine)[0] = sig


def run(const int64_t[::1] bases, int rank, cnp.ndarray src not None, cnp.ndarray out not None,
        const int64_t[::1] counts, const int64_t[::1] displs, int64_t seg, int64_t stride, int64_t slot_bytes,
        int mode, int kind, int op, double scale, int nthreads, double timeout, int spin, uint64_t seq,
        uint64_t sig, bint stream):
    """Run one collective over the window whose ranks' regions start at ``bases`` (addresses).

    ``src``: the input (all chunks; all-gather: this rank's chunk); ``out``: the output (all chunks;
    reduce-scatter: this rank's chunk); ``counts``/``displs``: every rank's chunk, in elements. Step ``i``
    moves elements ``[i*seg, (i+1)*seg)`` of every chunk, each in its sub-slot ``stride`` bytes apart (one
    sub-slot for all-gather), with flag value ``seq + i + 1``. A wait polls ``spin`` times before sleeping.
    ``stream``: copy out with non-temporal stores (src/shm_copy.h; for outputs larger than the caches that
    are not the input, whose lines a copy out would otherwise first read).
    Returns ``(status, step, peer, nsteps)``: status DONE, STALLED_COPY / STALLED_REDUCE (no progress for
    ``timeout`` s waiting on ``peer``'s copy-in / reduced chunk at ``step``), MISMATCH (``peer``'s signature
    differs from ``sig``), PEER_ERROR (``peer`` announced an argument error instead), PEER_LEFT (``peer``'s
    Python exited without storing the flag waited for)."""
    cdef int P = bases.shape[0], k, q, w, status = DONE, peer = -1
    cdef char* s = <char*>cnp.PyArray_DATA(src)
    cdef char* o = <char*>cnp.PyArray_DATA(out)
    cdef Py_ssize_t item = cnp.PyArray_ITEMSIZE(out)
    cdef int64_t nsteps = 0, i = 0, lo, n, maxc = 0, r, buf_off, sub
    cdef uint64_t cur, theirs
    cdef char* mine
    cdef char* acc
    cdef char* slot
    cdef char* own
    cdef int64_t blk, b0, bn
    for r in range(P):
        if counts[r] > maxc:
            maxc = counts[r]
    nsteps = (maxc + seg - 1) // seg
    with nogil:
        if nsteps:
            _copy_in(bases, rank, P, s, counts, displs, 0, seg, stride, slot_bytes, item, mode, seq + 1, sig)
        for i in range(nsteps):
            cur = seq + <uint64_t>i + 1
            buf_off = FLAG_AREA + <int64_t>(cur & 1) * (HEADER + slot_bytes)  # double buffer by parity
            lo = i * seg
            mine = <char*>bases[rank] + buf_off
            sub = HEADER + rank * stride
            # This step's input is in (copied during the step before, see below): publish it.
            torus_flag_store(<uint64_t*>(<char*>bases[rank] + COPIED), cur)
            # Wait for every peer's input; check it is the same call.
            status = _join(bases, rank, P, cur, sig, buf_off, timeout, spin, &peer)
            if status:
                break
            # Reduce this rank's chunk, ranks in the order rank, rank + 1, ...: our own part straight from src,
            # the peers' from their sub-slots. All-reduce: into our own sub-slot, where every rank copies it
            # from; reduce-scatter: into the output (in place it is our part of src: read before written).
            # All-reduce: each block of our chunk is copied out as soon as it is reduced, from L1 (a separate
            # pass after the copy in below read it back from L2: docs/design.md, "The shm protocol").
            n = _piece(counts[rank], lo, seg) if mode != ALLGATHER else 0
            if n:
                own = s + (displs[rank] + lo) * item
                acc = mine + sub if mode == ALLREDUCE else o + lo * item
                if P == 1 and acc != own:
                    memcpy(acc, own, n * item)
                blk = _BLOCK_BYTES // item
                b0 = 0
                while b0 < n:
                    bn = n - b0 if n - b0 < blk else blk
                    for k in range(1, P):
                        q = (rank + k) % P
                        _reduce_raw(kind, acc + b0 * item, (own if k == 1 else acc) + b0 * item,
                                    <char*>bases[q] + buf_off + sub + b0 * item, bn, item, op,
                                    scale if k == P - 1 else 1.0, nthreads)
                    if mode == ALLREDUCE:
                        _copy_out(o + (displs[rank] + lo + b0) * item, acc + b0 * item, bn * item, stream)
                    b0 += bn
            if mode == ALLREDUCE:
                torus_flag_store(<uint64_t*>(<char*>bases[rank] + REDUCED), cur)
            # Copy in the next step's input now, while the peers finish reducing this one (its ``copied`` is
            # published only after this step's copy out, so a peer that sees it knows we are done reading
            # its buffers of this step). Buffer (cur + 1) & 1 is free: every peer published ``copied = cur``
            # (we waited for it above) after its last read of that buffer, in step cur - 1.
            if i + 1 < nsteps:
                _copy_in(bases, rank, P, s, counts, displs, lo + seg, seg, stride, slot_bytes, item, mode, cur + 1,
                         sig)
            if mode == REDUCE_SCATTER:
                continue
            # Copy out every other rank's (reduced) chunk, the next ranks first, so that the ranks do not all
            # read the same peer at once (our own chunk is in out already: all-reduce copied it out above).
            for k in range(1, P):
                q = (rank + k) % P
                n = _piece(counts[q], lo, seg)
                if n == 0:
                    continue
                w = DONE if mode != ALLREDUCE else _wait(<char*>bases[q], REDUCED, cur, timeout, spin,
                                                         STALLED_REDUCE)
                if w:
                    status, peer = w, q
                    break
                slot = <char*>bases[q] + buf_off + HEADER + (q * stride if mode == ALLREDUCE else 0)
                _copy_out(o + (displs[q] + lo) * item, slot, n * item, stream)
            if status:
                break
        if stream:
            torus_stream_fence()
    return status, i, peer, nsteps


def run_whole(const int64_t[::1] bases, int rank, cnp.ndarray src not None, cnp.ndarray out not None,
              int64_t slot_bytes, int kind, int op, double scale, int nthreads, double timeout, int spin,
              uint64_t seq, uint64_t sig):
    """All-reduce of a buffer that fits one slot (``src.nbytes <= slot_bytes``) in one step, flag value
    ``seq + 1``: every rank copies its whole input into its slot, waits for every peer's (and compares
    signatures), then reduces every element itself from the slots, ranks in the order 0, 1, ..., size - 1 on
    every rank (so every rank's result is bitwise identical), into ``out`` (may be ``src``: only slots are
    read). One flag wait instead of two per step, and no copy out, for ``size`` times the reads: what
    small calls want. Returns ``(status, 0, peer, 1)`` with the statuses of ``run``."""
    cdef int P = bases.shape[0], q, status = DONE, peer = -1
    cdef Py_ssize_t item = cnp.PyArray_ITEMSIZE(out)
    cdef int64_t n = cnp.PyArray_SIZE(out)
    cdef uint64_t cur = seq + 1
    cdef int64_t buf_off = FLAG_AREA + <int64_t>(cur & 1) * (HEADER + slot_bytes)
    cdef char* mine = <char*>bases[rank] + buf_off
    cdef char* o = <char*>cnp.PyArray_DATA(out)
    with nogil:
        if n:
            memcpy(mine + HEADER, <char*>cnp.PyArray_DATA(src), n * item)
        (<uint64_t*>mine)[0] = sig
        torus_flag_store(<uint64_t*>(<char*>bases[rank] + COPIED), cur)
        status = _join(bases, rank, P, cur, sig, buf_off, timeout, spin, &peer)
        if status == DONE and n:
            _reduce_raw(kind, o, <char*>bases[0] + buf_off + HEADER, <char*>bases[1] + buf_off + HEADER, n, item,
                        op, scale if P == 2 else 1.0, nthreads)
            for q in range(2, P):
                _reduce_raw(kind, o, o, <char*>bases[q] + buf_off + HEADER, n, item, op,
                            scale if q == P - 1 else 1.0, nthreads)
    return status, 0, peer, 1


def announce(int64_t base, int64_t slot_bytes, uint64_t seq, uint64_t sig):
    """Tell the peers, at step ``seq + 1``, ``sig`` (ERROR_SIG: this rank rejected its own arguments;
    OTHER_SIG: it runs another algorithm): in that step's header, then the copied flag (release). The buffer
    is free for the reason ``run`` gives."""
    cdef uint64_t cur = seq + 1
    cdef char* region = <char*>base
    (<uint64_t*>(region + FLAG_AREA + <int64_t>(cur & 1) * (HEADER + slot_bytes)))[0] = sig
    torus_flag_store(<uint64_t*>(region + COPIED), cur)


def mark_left(int64_t base):
    """This rank's Python is exiting: say so in its region (the peers' waits on its flags end with PEER_LEFT
    instead of the stall timeout) and wake whoever sleeps on its flags. Its flags keep their values."""
    cdef char* region = <char*>base
    torus_flag_store(<uint64_t*>(region + LEFT), 1)
    torus_flag_store(<uint64_t*>(region + COPIED), torus_flag_load(<uint64_t*>(region + COPIED)))
    torus_flag_store(<uint64_t*>(region + REDUCED), torus_flag_load(<uint64_t*>(region + REDUCED)))


def left_ranks(const int64_t[::1] bases, int rank):
    """The ranks other than ``rank`` whose region holds the ``mark_left`` mark."""
    return [q for q in range(bases.shape[0])
            if q != rank and torus_flag_load(<const uint64_t*>(<char*>bases[q] + LEFT))]


def run_window(const int64_t[::1] bases, const int64_t[::1] data, int rank, const int64_t[::1] counts,
               const int64_t[::1] displs, int64_t slot_bytes, int kind, int item, int op, double scale,
               int nthreads, double timeout, int spin, uint64_t seq, uint64_t sig):
    """All-reduce in place of buffers that live in shared memory: rank ``q``'s buffer starts at address
    ``data[q]``, its flags and headers in the window region at ``bases[q]``; ``counts``/``displs``: every
    rank's chunk, in elements. Three phases, flag values ``seq + 1`` and ``seq + 2``:

    1. ``copied = seq + 1`` (our buffer holds this call's input), wait for every peer's, compare signatures;
    2. reduce our chunk in place from every peer's buffer (ranks in the order rank, rank + 1, ...),
       ``reduced = seq + 1``;
    3. once a peer's ``reduced`` is there, copy its chunk from its buffer into ours; then ``copied = seq + 2``
       and wait for every peer's (nobody's buffer is written again, by its owner, while a peer still reads it).

    Returns ``(status, phase, peer)`` with the statuses of ``run`` (phase 0, 1 or 2)."""
    cdef int P = bases.shape[0], k, q, w, status = DONE, peer = -1, phase = 0
    cdef uint64_t cur = seq + 1, theirs
    cdef char* mine = <char*>data[rank]
    cdef char* acc
    cdef int64_t n = counts[rank]
    with nogil:
        (<uint64_t*>(<char*>bases[rank] + FLAG_AREA + <int64_t>(cur & 1) * (HEADER + slot_bytes)))[0] = sig
        torus_flag_store(<uint64_t*>(<char*>bases[rank] + COPIED), cur)
        status = _join(bases, rank, P, cur, sig, FLAG_AREA + <int64_t>(cur & 1) * (HEADER + slot_bytes), timeout,
                       spin, &peer)
        if status == DONE:
            phase = 1
            acc = mine + displs[rank] * item
            for k in range(1, P):
                q = (rank + k) % P
                if n:
                    _reduce_raw(kind, acc, acc, <char*>data[q] + displs[rank] * item, n, item, op,
                                scale if k == P - 1 else 1.0, nthreads)
            torus_flag_store(<uint64_t*>(<char*>bases[rank] + REDUCED), cur)
            phase = 2
            for k in range(1, P):
                q = (rank + k) % P
                w = _wait(<char*>bases[q], REDUCED, cur, timeout, spin, STALLED_REDUCE)
                if w:
                    status, peer = w, q
                    break
                if counts[q]:
                    memcpy(mine + displs[q] * item, <char*>data[q] + displs[q] * item, counts[q] * item)
        if status == DONE:
            (<uint64_t*>(<char*>bases[rank] + FLAG_AREA + <int64_t>((cur + 1) & 1) * (HEADER + slot_bytes)))[0] = sig
            torus_flag_store(<uint64_t*>(<char*>bases[rank] + COPIED), cur + 1)
            for k in range(1, P):
                q = (rank + k) % P
                w = _wait(<char*>bases[q], COPIED, cur + 1, timeout, spin, STALLED_COPY)
                if w:
                    status, peer = w, q
                    break
    return status, phase, peer
