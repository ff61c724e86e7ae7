"""The shared-memory transport (``algorithm="shm"``): ranks on one node reduce straight from each other's
memory instead of sending messages.

Set-up (once per TorusComm, at its first shm call; collective): a timed barrier, then
``MPI_Comm_split_type(COMM_TYPE_SHARED)`` (refused unless it holds every rank) and one MPI-3 shared window
(``MPI_Win_allocate_shared``): per rank two flag lines (``copied``, ``reduced``: 64-bit sequence numbers) and
two buffers (double buffering by the parity of the step number), each a header line (the call's signature)
and ``slot_bytes`` of data.

The protocol runs in src/_shm.pyx without the GIL: each step copies in what the peers need, publishes
``copied``, waits for the peers' flags and compares their signatures, reduces this rank's chunk (its own part
straight from the input), publishes ``reduced`` and copies out the peers' chunks. Small all-reduces (up to
``WHOLE_MAX_BYTES``) take one step; in-place all-reduces of ``TorusComm.alloc`` buffers reduce straight from
the peers' buffers (``run_window``). Every rank's result is bitwise identical.

Contract: a signature mismatch at any step is a MismatchError on the ranks that see it, even with the
argument check off; a wait without progress for ``timeout`` seconds, or on a peer whose Python has exited,
is a TimeoutError naming the step and the peer; after either the transport refuses further calls.

The protocol step by step, why no barrier is needed between calls, what the signature catches and misses,
and the cost per byte: docs/design.md, "The shm protocol".
"""
from __future__ import annotations

import ctypes
import functools
import os
import weakref
import zlib

import numpy as np
from mpi4py import MPI

from torus import agreement, faults, kernels, knobs
from torus._ext import _reduce, _shm  # type: ignore[attr-defined]  # compiled, no stubs
from torus.errors import MismatchError, TorusError
from torus.errors import TimeoutError as TorusTimeout
from torus.ops import DTYPE_CODE, DTYPES, OP_CODE, OPS
from torus.partition import chunks, displacements
from torus.select import ALGORITHMS

_MODE = {"allreduce": _shm.ALLREDUCE, "reduce_scatter": _shm.REDUCE_SCATTER, "allgather": _shm.ALLGATHER}
_PAGE = 4096
# Signature mode of an in-place all-reduce of the k-th ``alloc`` buffer: this plus k (ranks must agree on it).
_WINDOW_ALLREDUCE = 16
# Data bytes per rank and step unless TorusComm's segment_bytes is given. Every rank its own core: small, so
# a step's window data stays in a core's L2 cache between the copy in, the peers' reduction and the copy out.
# More ranks than cores: each step waits for every rank to be scheduled, so fewer, larger steps
# (bench/shared_memory/README.md; docs/performance.md, "Where the constants come from").
SEGMENT_BYTES = 256 << 10
OVERSUBSCRIBED_SEGMENT_BYTES = 1 << 20
# Polls of a flag before a wait sleeps, when every rank of the node has a core of its own (fewer polls made
# small all-reduces slower: docs/performance.md, "Where the constants come from"); with more ranks than cores
# a wait sleeps at once.
SPIN_POLLS = 20000
# Where MPI maps shared windows (MPICH and Open MPI on Linux), and what alloc leaves free there for others.
SHM_DIR = "/dev/shm"
SHM_HEADROOM_BYTES = 16 << 20
# All-reduces up to this size (and the slot) run in one step, every rank reducing the whole buffer from
# the slots (src/_shm.pyx run_whole): one flag wait and no copy out, for ``size`` times the reads (faster up
# to this size, slower above: docs/performance.md, "Where the constants come from").
WHOLE_MAX_BYTES = knobs.read("TORUS_SHM_WHOLE_BYTES")
# Outputs from this size (out of place) are copied out with non-temporal stores (src/shm_copy.h).
STREAM_MIN_BYTES = knobs.read("TORUS_SHM_STREAM_BYTES")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_PROT_READ, _MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_FIXED_NOREPLACE = 0x1, 0x02, 0x20, 0x100000


def _pages(nbytes: int) -> int:
    """Bytes of whole pages holding ``nbytes`` (at least one page: MPI refuses an empty shared window)."""
    return max(-(-nbytes // _PAGE) * _PAGE, _PAGE)


def _cover(array: np.ndarray, nbytes: int) -> None:
    """After its window is freed, map empty read-only pages where ``array``'s ``nbytes`` (whole pages) were,
    for as long as the array lives: a read of a freed alloc buffer then sees zeros instead of ending the
    process with SIGSEGV (a write through a view made before free still faults). Only where the range is
    free again (Linux's MAP_FIXED_NOREPLACE: never over another mapping, such as one a thread made
    meanwhile); otherwise, or off Linux, the range is left as MPI left it."""
    address = array.__array_interface__["data"][0]
    if address % _PAGE or not nbytes:
        return
    got = _libc.mmap(address, nbytes, _PROT_READ, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE, -1, 0)
    if got is None or got == ctypes.c_void_p(-1).value:
        return
    if got != address:  # a kernel without MAP_FIXED_NOREPLACE took it as a hint and mapped elsewhere
        _libc.munmap(got, nbytes)
        return
    weakref.finalize(array, _libc.munmap, address, nbytes)


class StepMismatch(MismatchError):
    """The peers' headers differed from this rank's at the first step of a call, which every rank then fails
    at: the transport stays usable, and TorusComm (with its argument check on) runs the all-gather of the
    arguments to say which differ."""


class SharedMemory:
    """The shared-memory transport of one TorusComm: ``comm`` (its duplicated communicator, every rank on
    one node), ``segment_bytes`` (data bytes per rank and step, None: SEGMENT_BYTES, or
    OVERSUBSCRIBED_SEGMENT_BYTES with more ranks than cores; rounded up to a multiple of ``64 * size``),
    ``timeout`` (seconds without progress before TimeoutError; None waits forever). A node-level transport
    (the shared-memory phases of a call across nodes, torus/schedules/phases.py) runs on a sub-communicator:
    ``members`` gives its ranks' numbers in errors (default: their ranks in ``comm``), ``host_ranks`` the
    ranks on this machine, for the spin rule (default ``size``)."""

    def __init__(self, comm: MPI.Intracomm, rank: int, size: int, segment_bytes: int | None,
                 timeout: float | None, members=None, host_ranks: int | None = None):
        self.comm, self.rank, self.size, self.timeout = comm, rank, size, timeout
        self.members = tuple(range(size)) if members is None else tuple(members)
        own_cores = (host_ranks or size) <= (os.cpu_count() or 1)
        self.spin = SPIN_POLLS if own_cores else -knobs.read("TORUS_SHM_YIELDS")
        seg = segment_bytes or (SEGMENT_BYTES if own_cores else OVERSUBSCRIBED_SEGMENT_BYTES)
        line = 64 * size
        self.slot_bytes = -(-seg // line) * line
        self._win: MPI.Win | None = None
        self._bases = np.zeros(0, np.int64)
        self._seq = 0
        self._broken = ""
        self._calls: dict = {}  # call shape -> what _prepare decided for it
        self._freed: set = set()  # addresses of alloc arrays freed since (a later alloc may reuse one)
        self._buffers: dict = {}  # address of an alloc buffer -> (window, every rank's address, nbytes, index)
        self._allocs = 0  # alloc buffers made so far: the next one's index

    def _barrier(self, what: str, doing: str) -> None:
        """A barrier bounded by the stall timeout, before a blocking MPI window call (so a rank that never
        comes is a TimeoutError, not a hang inside MPI)."""
        faults.wait(self.comm.Ibarrier(), self.timeout, lambda: (
            f"{what} on rank {self.members[self.rank]}: no progress for {self.timeout:g} s {doing} (some rank "
            "never made this call); abort the job"))

    def _open(self, what: str) -> None:
        rank, size = self.members[self.rank], self.size
        self._barrier(what, "setting up the shared-memory window")
        shared = MPI.Intracomm(self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank))  # same handle, typed
        if shared.Get_size() != size:
            n = shared.Get_size()
            shared.Free()
            raise ValueError(f"{what} on rank {rank}: algorithm 'shm' needs every rank on one node; this node "
                             f"holds {n} of the {size} ranks (use ring, hierarchical or torus2d)")
        region = _pages(_shm.FLAG_BYTES + 2 * (_shm.HEADER_BYTES + self.slot_bytes))
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        try:
            win = MPI.Win.Allocate_shared(region, 1, info, comm=shared)
        finally:
            info.Free()
            shared.Free()
        win.tomemory()[:_shm.FLAG_BYTES] = bytes(_shm.FLAG_BYTES)  # sequence numbers start at 0
        self._bases = np.array([win.Shared_query(q)[0].address for q in range(size)], np.int64)
        self._win = win
        self.comm.Barrier()  # every rank's flags are zero before anyone looks at them
        faults.at_exit(self, functools.partial(_shm.mark_left, int(self._bases[self.rank])), self._left)

    def _left(self) -> str:
        """The peers whose Python has exited (their mark in the window), as "rank 1" / "ranks 1, 3", or ""."""
        gone = [self.members[q] for q in _shm.left_ranks(self._bases, self.rank)]
        return agreement.ranks_text(gone) if gone else ""

    def _prepare(self, collective: str, out: np.ndarray, counts, op: str, window):
        """What a call shape needs, decided once: (mode, counts, displs, segment in elements, kernel kind,
        op code, the 32-bit signature the peers compare: mode, dtype, op, chunks and slot size)."""
        mode = _MODE[collective] if window is None else _WINDOW_ALLREDUCE + window[3]
        if mode == _shm.ALLREDUCE and self.size > 1 and out.nbytes <= min(WHOLE_MAX_BYTES, self.slot_bytes):
            mode = _shm.ALLREDUCE_WHOLE
        if counts is None:
            counts = chunks(out.size, self.size)[0]
        c, d = np.array(counts, np.int64), np.array(displacements(counts), np.int64)
        kind = _reduce.kind(out)
        seg = self.slot_bytes // out.itemsize // (1 if mode == _shm.ALLGATHER else self.size)
        sig = zlib.crc32(c.tobytes(), zlib.crc32(self.slot_bytes.to_bytes(8, "little"),
                                                 (mode << 16) | (kind << 8) | OPS.index(op)))
        return mode, c, d, seg, kind, OP_CODE[op], sig

    @property
    def is_open(self) -> bool:
        """The window is set up (every rank's is: set-up is collective)."""
        return self._win is not None

    def announce_error(self, check: bool) -> None:
        """This rank rejected its own arguments to a call the others may run over shared memory: its header
        at the next step says so (they raise agreement.PeerRejected). That step is then spent on every rank
        (``skip_step``); with ``check`` off nothing synchronises the ranks after it, so the transport refuses
        further calls instead."""
        if self._win is None or self._broken:
            return
        _shm.announce(int(self._bases[self.rank]), self.slot_bytes, self._seq, _shm.ERROR_SIG)
        self.skip_step(check, "this rank rejected its own arguments")

    def announce_other(self) -> bool:
        """This rank runs another algorithm than shm in a call with the argument check on: its header at the
        next step says so, so that peers running this call over shared memory fail at once (StepMismatch,
        then the argument all-gather, which this rank runs too, names the algorithms) instead of waiting out
        the stall timeout. Every rank then spends that step: this one here, those running shm at their
        first step's join, those running another algorithm here too. Returns whether it did (the window is
        open). Safe only with the check on: its all-gather keeps any rank from announcing again before every
        peer has finished reading this header buffer's previous use."""
        if self._win is None or self._broken:
            return False
        _shm.announce(int(self._bases[self.rank]), self.slot_bytes, self._seq, _shm.OTHER_SIG)
        self._seq += 1
        return True

    def skip_step(self, check: bool, why: str) -> None:
        """A peer's argument error took the next step (the all-gather of its report, completed with ``check``
        on, is what orders every rank's later writes after the others' reads); without ``check``, refuse."""
        if self._win is None:
            return
        if check:
            self._seq += 1
        else:
            self._broken = self._broken or why

    def run(self, what: str, collective: str, src: np.ndarray, out: np.ndarray, counts, op: str,
            scale: float, check: bool) -> None:
        """One collective (``collective``: allreduce, reduce_scatter, allgather; ``what`` names it in errors)
        from host ``src`` into host ``out`` (1-D, same dtype; may be the same array): all-reduce ``src`` and
        ``out`` hold every element; reduce-scatter ``src`` every block and ``out`` this rank's; all-gather
        ``src`` this rank's block and ``out`` every block, this rank's already in place. ``counts``: the
        blocks (None for all-reduce). ``scale`` multiplies the reduced result (avg). ``check``: the
        TorusComm's argument check is on (a peer that rejected its own arguments then posted its report).

        Raises TimeoutError (a peer stalled: step and peer named), MismatchError (a peer ran another call;
        agreement.PeerRejected: a peer rejected its own arguments),
        TorusError (the transport failed before), ValueError (the ranks span several nodes)."""
        if self._broken:
            raise TorusError(f"{what} on rank {self.members[self.rank]}: the shared-memory transport is unusable "
                             f"after an earlier failure ({self._broken}); abort the job")
        if self._win is None:
            self._open(what)
        window = (self._buffers.get(out.__array_interface__["data"][0])
                  if self._buffers and src is out and collective == "allreduce" else None)
        if window is not None and window[2] != out.nbytes:
            window = None
        key = (collective, out.dtype, op, out.size if counts is None else tuple(counts),
               None if window is None else window[3])
        call = self._calls.get(key)
        if call is None:
            if len(self._calls) >= 256:
                self._calls.clear()
            call = self._calls[key] = self._prepare(collective, out, counts, op, window)
        mode, c, d, seg, kind, opcode, sig = call
        if window is not None:  # the caller's buffer lives in shared memory
            (status, step, peer), nsteps = _shm.run_window(
                self._bases, window[1], self.rank, c, d, self.slot_bytes, kind, out.itemsize, opcode, scale,
                kernels.get_num_threads(), self.timeout or 0.0, self.spin, self._seq, sig), 2
        elif mode == _shm.ALLREDUCE_WHOLE:
            status, step, peer, nsteps = _shm.run_whole(
                self._bases, self.rank, src, out, self.slot_bytes, kind, opcode, scale, kernels.get_num_threads(),
                self.timeout or 0.0, self.spin, self._seq, sig)
        else:
            status, step, peer, nsteps = _shm.run(
                self._bases, self.rank, src, out, c, d, seg, self.slot_bytes // self.size, self.slot_bytes,
                mode, kind, opcode, scale, kernels.get_num_threads(), self.timeout or 0.0, self.spin, self._seq,
                sig, src is not out and out.nbytes >= STREAM_MIN_BYTES)
        if status == _shm.DONE:
            self._seq += nsteps
            return
        me, who = self.members[self.rank], self.members[peer]
        if status == _shm.PEER_ERROR and step == 0:
            if check:  # complete the all-gather that rank posted with its report (agreement.reports_errors)
                agreement.join(self.comm, self.rank, self.size, self.timeout, what)
            self.skip_step(check, f"rank {who} rejected its own arguments")
            raise agreement.PeerRejected(f"{what} on rank {me}: rank {who} rejected its own arguments "
                                         "to this call (see the error there)")
        if status in (_shm.MISMATCH, _shm.PEER_ERROR, _shm.PEER_OTHER):
            message = (f"{what} on rank {me}: rank {who} runs this call with another algorithm than shm (step "
                       f"{step + 1}/{nsteps})" if status == _shm.PEER_OTHER else
                       f"{what} on rank {me}: rank {who} called a different collective, dtype, op or counts (or "
                       f"a buffer from another alloc) over shared memory at step {step + 1}/{nsteps}")
            if step == 0 and status in (_shm.MISMATCH, _shm.PEER_OTHER):
                # Every rank fails at this step's join (each has a peer whose header differs from its own), and
                # none has read a peer's data: spending the step on every rank keeps the counters equal.
                self._seq += 1
                raise StepMismatch(message)
            self._broken = f"rank {who} made a different call"
            raise MismatchError(message)
        if status == _shm.PEER_LEFT:
            self._broken = f"rank {who} left the job"
            faults.stalled()
            raise TorusTimeout(f"{what} on rank {me}: rank {who} {faults.PYTHON_EXITED} at step "
                               f"{step + 1}/{nsteps} without this call's data, which it never made: every rank "
                               "must make the same collective calls; abort the job")
        waited = "copy in its input" if status == _shm.STALLED_COPY else "publish its reduced chunk"
        self._broken = f"rank {who} stalled"
        faults.stalled()
        raise TorusTimeout(f"{what} on rank {me}: no progress for {self.timeout:g} s at step "
                           f"{step + 1}/{nsteps} waiting on rank {who} of the shared-memory window to {waited} "
                           "(a peer died, stalled or called a different collective); the communicator is "
                           "unusable now, abort the job")

    def alloc(self, what: str, count: int, dtype, nodes: int) -> np.ndarray:
        """``count`` elements of ``dtype`` (uninitialised) in a new shared window of the node (collective):
        an in-place all-reduce of exactly this array reads the peers' data where it lies (no copy in).
        ``nodes``: how many nodes the ranks span (refused unless 1)."""
        dtype = np.dtype(dtype)
        if dtype not in DTYPES:
            raise TypeError(f"{what} on rank {self.rank}: dtype {dtype} is not one of "
                            f"{', '.join(str(d) for d in DTYPES)}")
        if not isinstance(count, (int, np.integer)):
            raise TypeError(f"{what} on rank {self.rank}: count must be an integer, got {count!r}")
        if count < 0:
            raise ValueError(f"{what} on rank {self.rank}: count {count} is negative")
        if nodes > 1:
            raise ValueError(f"{what} on rank {self.rank}: shared memory needs every rank on one node; these "
                             f"{self.size} ranks are on {nodes} nodes")
        count = int(count)
        self._agree(what, count, dtype, self._allocs)
        if self._win is None:
            self._open(what)
        nbytes = count * dtype.itemsize
        if self.size == 1:  # nobody to share with: numpy's own memory, valid as long as the array lives
            win, array = None, np.empty(count, dtype)
            data = np.array([array.ctypes.data], np.int64)
        else:
            win, data, array = self._window(what, nbytes, count, dtype)
        self._buffers[array.ctypes.data] = (win, data, nbytes, self._allocs, weakref.ref(array))
        self._freed.discard(array.ctypes.data)
        self._allocs += 1
        return array

    def _window(self, what: str, nbytes: int, count: int, dtype) -> tuple:
        """A shared window of ``nbytes`` per rank (whole pages, each rank's its own): (window, every rank's
        address, this rank's part as ``count`` elements of ``dtype``)."""
        self._check_room(what, _pages(nbytes))
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        try:
            win = MPI.Win.Allocate_shared(_pages(nbytes), 1, info, comm=self.comm)
        finally:
            info.Free()
        data = np.array([win.Shared_query(q)[0].address for q in range(self.size)], np.int64)
        return win, data, np.frombuffer(win.tomemory(), dtype, count)  # type: ignore[call-overload]

    def _check_room(self, what: str, part: int) -> None:
        """Refuse (MemoryError on every rank, collective) a window of ``part`` bytes per rank that the node's
        /dev/shm cannot hold: MPI maps shared windows from files there, which a tmpfs creates sparse, so an
        overfull one is a SIGBUS at the first touch, not an allocation error (Docker's default is 64 MiB)."""
        try:
            st = os.statvfs(SHM_DIR)
            free = st.f_bavail * st.f_frsize
        except OSError:  # no /dev/shm: MPI maps its windows elsewhere, nothing to check
            free = None
        need = part * self.size
        fits = self.comm.allreduce(int(free is None or free >= need + SHM_HEADROOM_BYTES), op=MPI.MIN)
        if not fits:
            have = "unknown" if free is None else f"{free / 2**20:.0f} MiB"
            raise MemoryError(f"{what} on rank {self.rank}: a shared buffer of {part} bytes on each of the "
                              f"{self.size} ranks needs {need / 2**20:.0f} MiB of {SHM_DIR}, which has {have} free "
                              f"on some rank's node (enlarge it, e.g. docker run --shm-size=2g, or all-reduce an "
                              f"ordinary array)")

    def release(self, what: str, array: np.ndarray) -> None:
        """Free ``alloc``'s ``array`` (collective: every rank releases its own, in the same order); the
        array must not be used after. Raises ValueError for an array ``alloc`` did not return."""
        found = self._buffers.get(array.ctypes.data)
        if found is None and array.ctypes.data in self._freed:
            raise ValueError(f"{what} on rank {self.rank}: this array was freed already (by an earlier free_alloc)")
        if found is None or found[2] != array.nbytes:
            raise ValueError(f"{what} on rank {self.rank}: not an array from TorusComm.alloc (or a view of one)")
        self._agree(what, array.size, array.dtype, found[3])
        del self._buffers[array.ctypes.data]
        self._freed.add(array.ctypes.data)
        self._free_window(found)

    @staticmethod
    def _free_window(found: tuple) -> None:
        win, _, nbytes, _, ref = found
        array = ref()
        if array is not None:
            array.flags.writeable = False  # a write into it (new gradients, an in-place call) is an error, not a crash
        if win is None:
            return
        win.Free()
        if array is not None:
            _cover(array, _pages(nbytes))

    def _agree(self, what: str, count: int, dtype, index: int) -> None:
        """Every rank makes this same ``alloc`` / ``free_alloc`` (``what``): of ``count`` elements of
        ``dtype``, the ``index``-th buffer alloc made (alloc: the one it makes now). An all-gather bounded by
        the stall timeout, in the row layout of agreement.SIGNATURE (a rank in another call's argument check
        meanwhile sees "collective" differ, and so do we). Raises MismatchError on every rank naming what
        differs (a free in another order: "which buffer"), TimeoutError when some rank never comes; before
        any window call, so the buffers and the transport stay as they were."""
        mine = np.zeros(len(agreement.SIGNATURE), np.int64)
        mine[:5] = (agreement.COLLECTIVES.index(what), 0, DTYPE_CODE[np.dtype(dtype)], count,
                    ALGORITHMS.index("shm"))
        mine[7] = index  # in the recvcounts column (a peer in a collective's check sees it differ there too)
        every = np.empty((self.size, mine.size), np.int64)
        faults.wait(self.comm.Iallgather(mine, every), self.timeout, lambda: (
            f"{what} on rank {self.members[self.rank]}: no progress for {self.timeout:g} s waiting for every "
            f"rank's {what} (some rank never made this call, or made another); abort the job"))
        parts = agreement.disagreements(every, {
            0: ("the call", agreement.COLLECTIVES.__getitem__), 2: ("dtype", agreement.DTYPE_NAMES.__getitem__),
            3: ("count", str), 7: ("which buffer", lambda i: f"the buffer of alloc call #{i + 1}")})
        if parts:
            raise MismatchError(f"{what} on rank {self.members[self.rank]}: ranks disagree on " + ", ".join(parts))

    def free(self) -> None:
        """Release the window and every ``alloc`` buffer (collective over the node's ranks, when set up)."""
        for found in self._buffers.values():
            self._free_window(found)
        self._buffers.clear()
        if self._win is not None:
            faults.cancel_at_exit(self)
            self._win.Free()
            self._win = None
