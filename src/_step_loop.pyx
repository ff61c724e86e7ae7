# cython: boundscheck=False, wraparound=False
"""The host memory policy's step loop in C: the same messages, waits and reductions as the Python step
interpreter (``torus.runtime.interpreter``, whose docstring describes them), driven without Python.

Why: with more ranks than cores every rank's CPU time counts twice, and the Python driving each message
(slicing, mpi4py's argument parsing, the wait loop) is a large share of a mid-size all-reduce there
(bench/torus_bench/README.md has the figures).

Written against mpi4py's Cython API (``mpi4py/libmpi.pxd``: the MPI types and calls, ``MPI.Comm.ob_mpi``: the
handle behind a communicator), so it compiles against any MPI's ``mpi.h`` (setup.py says which it finds);
``matches()`` tells whether mpi4py runs on that same MPI, and torus.runtime.c_step_loop uses this module only
then.

Private: called by ``torus.runtime.c_step_loop.run`` with the tables ``c_step_loop.table`` builds from a
compiled plan.
"""
cimport numpy as cnp
from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from mpi4py cimport MPI
from mpi4py.libmpi cimport (MPI_BYTE, MPI_COMM_WORLD, MPI_STATUS_IGNORE, MPI_SUCCESS, MPI_Comm, MPI_Irecv,
                            MPI_Isend, MPI_Request, MPI_Test)

from mpi4py import MPI

from torus._ext import _reduce

cnp.import_array()

from host_c cimport monotonic_s, nanosleep, reduce_t, sched_yield, timespec

cdef reduce_t _reduce_raw = <reduce_t>PyCapsule_GetPointer(_reduce.raw_reduce(), b"torus._ext._reduce.raw")

# Table columns (cloop.table): one row per message, receives then sends, step by step.
cdef enum:
    KIND = 0      # 0 receive, 1 send
    COMM = 1      # index into the plan's communicators
    PEER = 2
    BLO = 3       # byte range in buf
    BHI = 4
    TLO = 5       # a reducing receive: byte offset in scratch
    REDUCE = 6
    SID = 7       # a send: its index among the plan's sends
    FINAL = 8     # a reducing receive that completes its element: apply the scale
    FRESH = 9     # out of place: read src instead of buf
    INNER = 10    # a send the step's reductions overwrite: wait for it once the step's messages are posted



def matches():
    """True when mpi4py runs on the MPI this module was compiled against: the ``MPI_BYTE`` and
    ``MPI_COMM_WORLD`` handles mpi4py holds are the ones compiled in (compile-time constants in MPICH's ABI,
    addresses of the library's objects in Open MPI's, so another library, or another copy of it, differs)."""
    return ((<MPI.Datatype>MPI.BYTE).ob_mpi == MPI_BYTE
            and (<MPI.Comm>MPI.COMM_WORLD).ob_mpi == MPI_COMM_WORLD)


cdef class Communicators:
    """The MPI handles of a plan's communicators (mpi4py ``Comm`` objects), read once when the plan's table
    is built rather than on every run; it holds the communicators, so the handles stay valid while it lives."""
    cdef readonly tuple comms
    cdef MPI_Comm* handles

    def __cinit__(self, tuple comms not None):
        self.comms = comms
        self.handles = <MPI_Comm*>malloc((len(comms) + 1) * sizeof(MPI_Comm))
        if self.handles == NULL:
            raise MemoryError("torus executor: no memory for the communicator table")
        for j, c in enumerate(comms):
            self.handles[j] = (<MPI.Comm?>c).ob_mpi

    def __dealloc__(self):
        free(self.handles)


cdef int _wait(MPI_Request* req, double timeout, long pause_ns, int* mpi_rc) noexcept nogil:
    """0 when ``req`` completed, 1 after ``timeout`` s (> 0) without completion, 2 on an MPI error. Yields
    the core after every unsuccessful test, as faults.wait does (the rank it waits for may need it); after 64
    of them, with ``pause_ns`` > 0, sleeps that long between tests instead (a communication thread beside
    compute: a yield gives nothing to threads of lower priority, so a polling thread would hold a core)."""
    cdef int flag = 0, polls = 0
    cdef double deadline = 0.0
    cdef int rc = MPI_Test(req, &flag, MPI_STATUS_IGNORE)
    if rc != MPI_SUCCESS:
        mpi_rc[0] = rc
        return 2
    if flag:
        return 0
    if timeout > 0:
        deadline = monotonic_s() + timeout
    cdef timespec pause
    pause.tv_sec = 0
    pause.tv_nsec = pause_ns
    while True:
        if pause_ns > 0 and polls > 64:
            nanosleep(&pause, NULL)
        else:
            sched_yield()
        rc = MPI_Test(req, &flag, MPI_STATUS_IGNORE)
        if rc != MPI_SUCCESS:
            mpi_rc[0] = rc
            return 2
        if flag:
            return 0
        polls += 1
        if timeout > 0 and (polls & 63) == 0 and monotonic_s() > deadline:
            return 1


def run(const int64_t[:, ::1] msgs, const int64_t[::1] step_lo, const int64_t[::1] retire,
        const int64_t[::1] retire_lo, const int64_t[::1] tail, const int64_t[::1] send_row,
        const int64_t[:, ::1] prefill, const int64_t[::1] prefill_lo, const int64_t[:, ::1] scales,
        Communicators comms not None, cnp.ndarray buf not None, cnp.ndarray src, cnp.ndarray tmp, int kind,
        int op, double scale, int nthreads, double timeout, int tag_mod, scale_step, double pause=0.0):
    """Run the plan; returns ``(status, step, row, mpi_rc)``: status 0 done, 1 timed out waiting on
    message ``row`` in ``step``, 2 an MPI call failed with ``mpi_rc``. ``comms``: the communicators the
    table's COMM column indexes. A message's tag is its step index modulo ``tag_mod``
    (torus.runtime.compile.TAG_MOD). ``scale_step(lo, hi)`` (Python, called with the GIL) scales elements
    [lo, hi) of buf for the plan's scale steps. ``pause``: seconds (< 1) a long wait sleeps between tests
    (``_wait``; 0: it only yields)."""
    cdef char* b = <char*>cnp.PyArray_DATA(buf)
    cdef char* s = <char*>cnp.PyArray_DATA(src) if src is not None else NULL
    cdef char* t = <char*>cnp.PyArray_DATA(tmp) if tmp is not None else NULL
    cdef Py_ssize_t item = cnp.PyArray_ITEMSIZE(buf)
    cdef Py_ssize_t nsteps = step_lo.shape[0] - 1, nsends = send_row.shape[0], si = 0, i = -1, j, nr, maxr = 1
    cdef int status = 0, mpi_rc = 0, rc, tag
    cdef long pause_ns = <long>(min(max(pause, 0.0), 0.999) * 1e9)
    cdef int64_t blo, n
    cdef char* data
    for si in range(nsteps):
        if step_lo[si + 1] - step_lo[si] > maxr:
            maxr = step_lo[si + 1] - step_lo[si]
    cdef MPI_Comm* handle = comms.handles
    cdef MPI_Request* sreq = <MPI_Request*>malloc((nsends + 1) * sizeof(MPI_Request))
    cdef MPI_Request* rreq = <MPI_Request*>malloc(maxr * sizeof(MPI_Request))
    if sreq == NULL or rreq == NULL:
        free(sreq)
        free(rreq)
        raise MemoryError("torus executor: no memory for the request tables")
    try:
        with nogil:
            for si in range(nsteps):
                for j in range(retire_lo[si], retire_lo[si + 1]):
                    status = _wait(&sreq[retire[j]], timeout, pause_ns, &mpi_rc)
                    if status:
                        i = send_row[retire[j]]
                        break
                if status:
                    break
                if s != NULL:
                    for j in range(prefill_lo[si], prefill_lo[si + 1]):
                        memcpy(b + prefill[j, 0], s + prefill[j, 0], prefill[j, 1] - prefill[j, 0])
                if scales[si, 0] >= 0:
                    if scale != 1.0 and scales[si, 1] > scales[si, 0]:
                        with gil:
                            scale_step(scales[si, 0], scales[si, 1])
                    continue
                tag = <int>(si % tag_mod)
                nr = 0
                for i in range(step_lo[si], step_lo[si + 1]):
                    if msgs[i, KIND] == 0:
                        data = (t + msgs[i, TLO]) if msgs[i, REDUCE] else (b + msgs[i, BLO])
                        rc = MPI_Irecv(data, <int>(msgs[i, BHI] - msgs[i, BLO]), MPI_BYTE, <int>msgs[i, PEER],
                                       tag, handle[msgs[i, COMM]], &rreq[nr])
                        nr += 1
                    else:
                        data = (s if msgs[i, FRESH] and s != NULL else b) + msgs[i, BLO]
                        rc = MPI_Isend(data, <int>(msgs[i, BHI] - msgs[i, BLO]), MPI_BYTE, <int>msgs[i, PEER],
                                       tag, handle[msgs[i, COMM]], &sreq[msgs[i, SID]])
                    if rc != MPI_SUCCESS:
                        status, mpi_rc = 2, rc
                        break
                if status:
                    break
                for i in range(step_lo[si], step_lo[si + 1]):
                    if msgs[i, KIND] == 1 and msgs[i, INNER]:
                        status = _wait(&sreq[msgs[i, SID]], timeout, pause_ns, &mpi_rc)
                        if status:
                            break
                if status:
                    break
                nr = 0
                for i in range(step_lo[si], step_lo[si + 1]):
                    if msgs[i, KIND] != 0:
                        continue
                    status = _wait(&rreq[nr], timeout, pause_ns, &mpi_rc)
                    nr += 1
                    if status:
                        break
                    if msgs[i, REDUCE]:
                        blo = msgs[i, BLO]
                        n = (msgs[i, BHI] - blo) // item
                        if n > 0:
                            if msgs[i, FRESH] and s != NULL:
                                _reduce_raw(kind, b + blo, s + blo, t + msgs[i, TLO], n, item, op,
                                            scale if msgs[i, FINAL] else 1.0, nthreads)
                            else:
                                _reduce_raw(kind, b + blo, b + blo, t + msgs[i, TLO], n, item, op,
                                            scale if msgs[i, FINAL] else 1.0, nthreads)
                if status:
                    break
            if not status:
                si = nsteps
                for j in range(tail.shape[0]):
                    status = _wait(&sreq[tail[j]], timeout, pause_ns, &mpi_rc)
                    if status:
                        i = send_row[tail[j]]
                        break
    finally:
        free(sreq)
        free(rreq)
    return status, si, i if status == 1 else -1, mpi_rc
