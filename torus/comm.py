"""TorusComm: an mpi4py intracommunicator seen as a periodic X x Y grid, with ring, hierarchical, 2D-torus
and native reduce-scatter, all-gather and all-reduce.

Buffers are C-contiguous arrays of dtype float16, bfloat16, float32, float64, int32 or int64, either numpy
arrays (host memory) or GPU arrays (CuPy arrays, numba device arrays: objects with ``__cuda_array_interface__``
and numpy's ``dtype``/``size``/``shape``/``reshape``; wrap a PyTorch CUDA tensor with ``cupy.asarray``, no
copy), sendbuf and recvbuf of the same kind. From 16 MiB GPU buffers stay on the GPU and are reduced there
(Numba-CUDA kernels), each message staged through a pinned host mirror (``torus/algorithms/staged.py``);
smaller ones are copied to pinned host memory, reduced there and copied back (``gpu_reduce`` below). Either way
the MPI need not be CUDA-aware. One GPU per rank: the arrays must live on numba's current device (select it per
rank before the first call, e.g. ``numba.cuda.select_device(local_rank)`` or ``CUDA_VISIBLE_DEVICES``); pinned
staging memory grows to the largest buffer seen and is kept for the TorusComm's life. Counts are in elements.
Every argument is checked on the calling rank before any message is sent; a bad one raises ``ValueError`` or
``TypeError`` naming the operation and the rank. With ``check=True`` (the default; ``TORUS_CHECK=0`` turns it
off) each call first all-gathers a 64-byte signature (collective, op, dtype, count, algorithm, segment size,
grid), so ranks that disagree all raise ``torus.errors.MismatchError`` instead of hanging or summing garbage:
one extra small ``MPI_Allgather`` per call (a few microseconds at 2 ranks, tens at 4 oversubscribed ranks).
A rank whose own arguments are bad raises its ValueError/TypeError at once and (check on) posts its share of
that all-gather marked "argument error", so the others raise MismatchError naming it instead of waiting.
"""
from __future__ import annotations

import functools
import os
import zlib

import numpy as np
from mpi4py import MPI

from torus import device, faults, kernels
from torus.algorithms import hierarchical, native, ring, staged, torus2d
from torus.algorithms.executor import Executor
from torus.errors import MismatchError
from torus.ops import DTYPE_CODE, OPS, avg_factors, check_op_dtype
from torus.partition import displacements
from torus.select import ALGORITHMS, choose

_COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")
# GPU buffers from this size (bytes) are reduced on the GPU by default: measured on an H200 with a host MPI,
# per-segment staging plus GPU reduction ties whole-buffer host staging at 16 MiB and wins above (see
# TorusComm's gpu_reduce).
GPU_REDUCE_MIN_BYTES = 16 << 20
_SIGNATURE = ("collective", "op", "dtype", "count", "algorithm", "segment_bytes", "grid", "recvcounts",
              "argument error")
_ERROR = len(_SIGNATURE) - 1  # the signature field that says "this rank rejected its own arguments"


def _collective(method):
    """Make a rank whose arguments fail their local check tell the others (with ``check`` on).

    The error is raised on this rank at once, as before; in addition this rank posts its share of the
    signature all-gather marked "argument error", so every other rank raises MismatchError naming it
    instead of waiting for the stall timeout. The all-gather is completed at this TorusComm's next call."""
    what = method.__name__

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self._agreeing = False
        try:
            return method(self, *args, **kwargs)
        except (ValueError, TypeError):
            if self.check and not self._agreeing:
                self._announce_error(what)
            raise
    return wrapper


def _ranks(ranks: list) -> str:
    """``[0, 1, 2, 5]`` -> ``'ranks 0-2, 5'``: short at any scale."""
    runs, lo = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append(str(lo) if lo == a else f"{lo}-{a}")
            lo = b
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def _prescale(buf, pre: float) -> None:
    """Scale the working copy of this rank's input by the avg pre-factor (``ops.avg_factors``) before any
    message leaves: partial sums then cannot overflow where the mean fits."""
    if pre != 1.0 and buf.size:
        kernels.scale(buf, pre)


def _env_float(name: str, default):
    value = os.environ.get(name, "")
    return float(value) if value else default


class TorusComm:
    """A communicator arranged as a periodic ``X x Y`` grid (``X`` ranks along a row).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        The ranks to use (default ``MPI.COMM_WORLD``). It is duplicated, so torus messages never match the
        caller's.
    dims : (int, int), optional
        ``(X, Y)`` with ``X * Y == comm.size``; ``None`` lets ``MPI.Compute_dims`` choose.
    ranks_per_node : int, optional
        Emulate nodes of this many consecutive ranks for the hierarchical schedule (default: the real nodes,
        ``MPI.COMM_TYPE_SHARED``; environment ``TORUS_RANKS_PER_NODE``).
    segment_bytes : int
        Pipelining unit in bytes (default 1 MiB, ``TORUS_SEGMENT_BYTES``); must be equal on all ranks.
    check : bool
        Agree on every call's arguments across ranks before moving data (default on, ``TORUS_CHECK=0``).
    timeout : float or None
        Seconds a collective may wait without progress before raising ``torus.errors.TimeoutError``
        (default 600, ``TORUS_TIMEOUT``; 0 or None waits forever).
    gpu_reduce : bool or None
        GPU buffers only. True: the buffer stays on the GPU, every message is staged through a pinned host
        mirror and reduced on the GPU by the Numba-CUDA kernels (``torus/algorithms/staged.py``). False: the
        whole buffer is copied to pinned host memory, reduced there by the host schedule and kernels, and
        copied back. None (default; ``TORUS_GPU_REDUCE=1``/``0`` force it): True from ``GPU_REDUCE_MIN_BYTES``
        (16 MiB) up. Same results to the bit either way, and the same messages, so ranks may differ. Measured
        on an H200 with a host MPI, 2 ranks (bench/README.md): on GPU 0.48-0.52x MPI_Allreduce's time from
        64 MiB against 0.63-0.68x off; level at 16 MiB; below, off wins (a kernel launch costs 100-250 us).

    Memory: calls keep their working buffers for the next call (training repeats the same sizes, and a
    fresh allocation would cost page faults every step), growing only: the incoming data of one step
    (all-reduce: ``count / size`` elements for the ring, ``count / X`` for the 2D torus, or ``count / Y``
    when ``X`` is 1), a full-size working copy for reduce-scatter, pinned host and device mirrors for GPU
    buffers. :meth:`free_buffers` releases them.

    Raises ``ValueError`` when ``dims`` does not multiply to the size. Collective: every rank of ``comm``
    must construct it together.
    """

    def __init__(self, comm: MPI.Intracomm | None = None, dims=None, *, ranks_per_node: int | None = None,
                 segment_bytes: int | None = None, check: bool | None = None, timeout: float | None = -1.0,
                 gpu_reduce: bool | None = None):
        base = MPI.COMM_WORLD if comm is None else comm
        rank, size = base.Get_rank(), base.Get_size()
        if dims is None:
            Y, X = MPI.Compute_dims(size, 2)  # Compute_dims sorts descending; rows are the shorter side
        else:
            X, Y = (int(d) for d in dims)
            if X < 1 or Y < 1 or X * Y != size:
                raise ValueError(f"TorusComm on rank {rank}: dims {X}x{Y} do not multiply to the "
                                 f"communicator size {size}")
        seg = int(segment_bytes or _env_float("TORUS_SEGMENT_BYTES", 1 << 20))
        if not 1 <= seg < 1 << 31:
            raise ValueError(f"TorusComm on rank {rank}: segment_bytes {seg} outside [1, 2**31)")
        if timeout is not None and timeout < 0:
            timeout = _env_float("TORUS_TIMEOUT", 600.0)
        self.comm = base.Dup()
        self.rank, self.size, self.dims = rank, size, (X, Y)
        self.segment_bytes = seg
        self.check = (os.environ.get("TORUS_CHECK", "1") != "0") if check is None else bool(check)
        forced = os.environ.get("TORUS_GPU_REDUCE", "")
        self.gpu_reduce = bool(gpu_reduce) if gpu_reduce is not None else (
            None if forced not in ("0", "1") else forced == "1")
        # Row-major Cartesian grid: coords (y, x), rank = y * X + x; periodic in both directions.
        self.cart = self.comm.Create_cart([Y, X], periods=[True, True], reorder=False)
        y, x = self.cart.Get_coords(rank)
        self.coords = (x, y)
        self.row_comm = self.cart.Sub([False, True])
        self.col_comm = self.cart.Sub([True, False])
        rpn = ranks_per_node or int(_env_float("TORUS_RANKS_PER_NODE", 0))
        if rpn:
            self.local_comm = self.comm.Split(rank // rpn, rank)
        else:
            self.local_comm = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        self.local_rank, self.local_size = self.local_comm.Get_rank(), self.local_comm.Get_size()
        self.cross_comm = self.comm.Split(self.local_rank, rank)
        # Nodes may differ in size (emulated nodes that do not divide the size); then a rank's own cross
        # communicator is smaller than the number of nodes, so count the leaders and ask the leader.
        self.node = self.local_comm.bcast(self.cross_comm.Get_rank(), root=0)
        self.nodes = self.comm.allreduce(int(self.local_rank == 0))
        self._max_local = self.comm.allreduce(self.local_size, op=MPI.MAX)
        regular = (rank == self.node * self.local_size + self.local_rank
                   and self.nodes * self.local_size == size)
        self._node_grid = bool(self.comm.allreduce(regular, op=MPI.LAND))
        if "TORUS_NUM_THREADS" not in os.environ:
            kernels.set_num_threads((os.cpu_count() or 1) // self.local_size)
        comms = {"world": self.comm, "row": self.row_comm, "col": self.col_comm,
                 "local": self.local_comm, "cross": self.cross_comm}
        self._executor = Executor(comms, rank, seg, timeout or None)
        self._plans: dict = {}
        self._auto: dict = {}
        self._agreeing = False
        self._announcements: list = []  # error reports posted and not yet completed (see _collective)

    # ------------------------------------------------------------------ argument normalisation
    def _fail(self, what: str, exc, msg: str):
        raise exc(f"{what} on rank {self.rank}: {msg}")

    def _array(self, what: str, name: str, buf, writable: bool):
        if buf is None or buf is MPI.IN_PLACE:
            self._fail(what, ValueError, f"{name} is required")
        if not isinstance(buf, np.ndarray):
            if device.is_device(buf):
                try:
                    why = device.problem(buf, writable)
                except Exception as exc:  # no CUDA driver, numba-cuda missing, a foreign context, ...
                    self._fail(what, TypeError, f"{name} is a GPU array, but numba.cuda cannot use it here "
                                                f"({type(exc).__name__}: {str(exc).strip()})")
                if why:
                    self._fail(what, ValueError, f"{name} (device array) {why}")
                return buf
            self._fail(what, TypeError, f"{name} must be a numpy or GPU array, got {type(buf).__name__}")
        if not buf.flags.c_contiguous:
            self._fail(what, ValueError, f"{name} is not C-contiguous (pass np.ascontiguousarray(...))")
        if writable and not buf.flags.writeable:
            self._fail(what, ValueError, f"{name} is read-only")
        return buf

    def _prepare(self, what: str, sendbuf, recvbuf, op: str, expected):
        """Validate; return (sendbuf or None when in place, recvbuf, dtype).

        ``expected(n)`` is the element count recvbuf must have when sendbuf has ``n`` elements."""
        in_place = sendbuf is MPI.IN_PLACE or (sendbuf is not None and sendbuf is recvbuf)
        if in_place:
            recvbuf = self._array(what, "recvbuf (in place)", recvbuf, True)
            return None, recvbuf, check_op_dtype(what, self.rank, op, recvbuf.dtype)
        sendbuf = self._array(what, "sendbuf", sendbuf, False)
        dt = check_op_dtype(what, self.rank, op, sendbuf.dtype)
        n = expected(sendbuf.size)
        on_device = device.is_device(sendbuf)
        if recvbuf is None:
            shape = sendbuf.shape if what == "allreduce" else (n,)
            recvbuf = device.empty(sendbuf, shape, dt) if on_device else np.empty(shape, dt)
            return sendbuf, recvbuf, dt
        recvbuf = self._array(what, "recvbuf", recvbuf, True)
        if device.is_device(recvbuf) != on_device:
            where = ("GPU", "host") if on_device else ("host", "GPU")
            self._fail(what, TypeError, f"sendbuf is in {where[0]} memory and recvbuf in {where[1]} memory; "
                                        "pass both on the host or both on the GPU")
        if recvbuf.dtype != dt:
            self._fail(what, TypeError, f"recvbuf dtype {recvbuf.dtype} differs from sendbuf dtype {dt}")
        if recvbuf.size != n:
            self._fail(what, ValueError, f"recvbuf has {recvbuf.size} elements, expected {n}")
        if device.overlap(sendbuf, recvbuf) if on_device else np.may_share_memory(sendbuf, recvbuf):
            self._fail(what, ValueError, "sendbuf and recvbuf overlap without being the same buffer "
                                         "(use MPI.IN_PLACE)")
        return sendbuf, recvbuf, dt

    def _algorithm(self, what: str, algorithm: str, nbytes: int, in_place: bool) -> str:
        if algorithm == "auto":
            # Memoized per (collective, nbytes, placement): the table costs ~1 us, a tenth of a small native
            # call. TORUS_ALGO is therefore read when a size is first seen, not on every call.
            key = (what, nbytes, in_place)
            algo = self._auto.get(key)
            if algo is None:
                if len(self._auto) >= 4096:
                    self._auto.clear()
                algo = self._auto[key] = choose(what, nbytes, self.size, self.dims, in_place)
            return algo
        if algorithm not in ALGORITHMS:
            self._fail(what, ValueError, f"unknown algorithm {algorithm!r}; expected auto or one of "
                                         f"{', '.join(ALGORITHMS)}")
        return algorithm

    def _agree(self, what: str, algo: str, op: str, dt, count: int, recvcounts) -> None:
        """All-gather a signature of the call; every rank raises the same MismatchError if any differ.

        The all-gather is non-blocking and waited on with the stall timeout, so a rank that never calls (or
        died) turns into ``TimeoutError`` here rather than a hang before the first data message.

        Cost (on whenever ``check`` is, the default): one 64-byte all-gather per call. Measured per call,
        median, 2 ranks on 2 cores: a 4-byte ``MPI_Allreduce`` 2.9 us, this check 8.6 us, a native 4-byte
        ``allreduce`` 5.9 us without it and 15 us with it; at 4 ranks oversubscribed the check costs about one
        more small-collective latency (ms there, set by the OS scheduler). Negligible beside a gradient
        all-reduce; ``check=False`` (``TORUS_CHECK=0``) skips it for latency-bound loops.

        A rank whose own argument check failed (ValueError/TypeError before this point) sends a signature
        marked "argument error" instead (see ``_collective``): every other rank raises MismatchError naming
        it, at once, while it raises its own error.

        Not caught: anything with ``check=False`` (ranks that disagree then hang until the stall timeout, fail
        in MPI with a truncation error, or silently combine mismatched data, e.g. sum on one rank and max on
        another); a rank that never calls or died (the others get ``TimeoutError`` after ``timeout`` s);
        differing buffer contents; ranks calling collectives on different TorusComm objects in different
        orders (also a timeout)."""
        self._agreeing = True
        self._finish_announcements(what)
        crc = zlib.crc32(np.asarray(recvcounts, np.int64).tobytes()) if recvcounts is not None else 0
        mine = np.array([_COLLECTIVES.index(what), OPS.index(op), DTYPE_CODE[dt], count,
                         ALGORITHMS.index(algo), self.segment_bytes, self.dims[0], crc, 0], np.int64)
        every = np.empty((self.size, mine.size), np.int64)
        timeout = self._executor.timeout
        faults.wait(self.comm.Iallgather(mine, every), timeout, lambda: (
            f"{what}({algo}) on rank {self.rank}: no progress for {timeout:g} s in the argument check (the "
            f"all-gather of every rank's call signature): some rank did not call {what}, died or is stuck; "
            "the communicator is unusable now, abort the job"))
        failed = np.nonzero(every[:, _ERROR])[0]
        if failed.size:
            who = _ranks([int(r) for r in failed])
            whose = "its" if failed.size == 1 else "their"
            raise MismatchError(f"{what}({algo}) on rank {self.rank}: {who} rejected {whose} own arguments to "
                                "this call (see the error there); no data was moved")
        bad = np.nonzero((every != every[0]).any(axis=0))[0]
        if bad.size == 0:
            return
        dtypes = [str(d) for d in DTYPE_CODE]
        decode = {0: _COLLECTIVES.__getitem__, 1: OPS.__getitem__, 2: dtypes.__getitem__,
                  4: ALGORITHMS.__getitem__, 6: lambda x: f"{x}x{self.size // x}", 7: lambda c: f"crc32 {c:08x}"}
        parts = []
        for f in bad:
            groups: dict = {}
            for r, v in enumerate(every[:, f]):
                groups.setdefault(int(v), []).append(r)
            shown = "; ".join(f"{_ranks(rs)} {'has' if len(rs) == 1 else 'have'} {decode.get(f, str)(v)}"
                              for v, rs in groups.items())
            parts.append(f"{_SIGNATURE[f]} ({shown})")
        raise MismatchError(f"{what}({algo}) on rank {self.rank}: ranks disagree on " + ", ".join(parts))

    def _announce_error(self, what: str) -> None:
        """Post this rank's share of the signature all-gather marked "argument error" (see ``_collective``);
        not waited for here, so the local error is raised at once even if the others never call."""
        mine = np.full(len(_SIGNATURE), -1, np.int64)
        mine[0], mine[_ERROR] = _COLLECTIVES.index(what), 1
        every = np.empty((self.size, mine.size), np.int64)
        self._announcements.append((self.comm.Iallgather(mine, every), mine, every))

    def _finish_announcements(self, what: str) -> None:
        """Complete earlier error announcements before the next all-gather on the same communicator."""
        timeout = self._executor.timeout
        while self._announcements:
            req = self._announcements.pop(0)[0]
            faults.wait(req, timeout, lambda: (
                f"{what} on rank {self.rank}: no progress for {timeout:g} s completing the report of this "
                "rank's earlier argument error: some rank never made that call; abort the job"))

    # ------------------------------------------------------------------ plans
    def _plan(self, what: str, algo: str, counts, itemsize: int):
        """The compiled plan of one call, cached: training repeats the same few shapes every step, and a
        plan is a pure function of (collective, algorithm, counts, itemsize) on a given rank and grid.
        ``counts``: the element count (allreduce) or the tuple of per-rank block counts."""
        key = (what, algo, counts, itemsize)
        compiled = self._plans.get(key)
        if compiled is None:
            if len(self._plans) >= 256:  # bounded: a sweep over many sizes must not grow without limit
                self._plans.clear()
            total = counts if isinstance(counts, int) else sum(counts)
            compiled = self._plans[key] = self._executor.compile(self._build(what, algo, counts), itemsize,
                                                                 total)
        return compiled

    def _build(self, what: str, algo: str, counts):
        (x, y), (X, Y) = self.coords, self.dims
        local = (self.local_rank, self.local_size, self.node, self.nodes)
        if what == "allreduce":
            if algo == "ring":
                return ring.allreduce("world", self.rank, self.size, counts)
            if algo == "torus2d":
                return torus2d.allreduce(x, y, X, Y, counts)
            return hierarchical.allreduce(*local, counts, self._max_local)
        displs = displacements(counts)
        if algo == "ring":
            schedule = ring.reduce_scatter if what == "reduce_scatter" else ring.allgather
            return schedule("world", self.rank, self.size, counts, displs)
        module = torus2d if algo == "torus2d" else hierarchical
        schedule = module.reduce_scatter if what == "reduce_scatter" else module.allgather
        return schedule(*((x, y, X, Y) if algo == "torus2d" else local), counts, displs)

    # ------------------------------------------------------------------ collectives
    @_collective
    def allreduce(self, sendbuf, recvbuf=None, *, op: str = "sum", algorithm: str = "auto"):
        """All-reduce: every rank ends with ``op`` over all ranks' buffers, elementwise.

        sendbuf: any shape, ``count`` elements; or ``MPI.IN_PLACE`` (then ``recvbuf`` is input and output).
        recvbuf: ``count`` elements of the same dtype (any shape), or None to allocate ``empty_like(sendbuf)``.
        Returns recvbuf. Every rank's result is bitwise identical for every algorithm (each element is
        reduced once, on its owner, and copied to the others). Raises ValueError/TypeError on bad input and
        MismatchError when ranks disagree; see the class docstring.
        """
        what = "allreduce"
        sendbuf, recvbuf, dt = self._prepare(what, sendbuf, recvbuf, op, lambda n: n)
        count = recvbuf.size
        algo = self._algorithm(what, algorithm, count * dt.itemsize, sendbuf is None)
        if self.check:
            self._agree(what, algo, op, dt, count, None)
        pre, scale = avg_factors(dt, self.size) if op == "avg" else (1.0, 1.0)
        if device.is_device(recvbuf):
            buf = device.view(recvbuf).reshape(-1)
            src = buf if sendbuf is None else device.view(sendbuf).reshape(-1)
            if algo == "native" or not self._on_gpu(buf):
                host = self._stage("stage", src)
                _prescale(host, pre)
                if algo == "native":
                    native.allreduce(self.comm, host, op, scale)
                else:
                    self._executor.run(f"{what}({algo})", self._plan(what, algo, count, dt.itemsize), host, op,
                                       scale)
                device.copy(buf, host)
            else:
                if sendbuf is not None:
                    device.copy(buf, src)
                _prescale(buf, pre)
                staged.run(self._executor, f"{what}({algo})", self._plan(what, algo, count, dt.itemsize),
                           buf, op, scale)
            return recvbuf
        buf = recvbuf.reshape(-1)
        if sendbuf is not None and (algo == "native" or pre != 1.0):
            np.copyto(buf, sendbuf.reshape(-1))
            sendbuf = None
        _prescale(buf, pre)
        if algo == "native":
            native.allreduce(self.comm, buf, op, scale)
            return recvbuf
        # Out of place the schedule reads sendbuf directly (no copy into recvbuf first; see executor.py).
        self._executor.run(f"{what}({algo})", self._plan(what, algo, count, dt.itemsize), buf, op, scale,
                           None if sendbuf is None else sendbuf.reshape(-1))
        return recvbuf

    def free_buffers(self) -> None:
        """Release the working buffers kept between calls (see the class docstring); the next call allocates
        what it needs again. Local: ranks need not call it together."""
        self._executor.free()

    def _on_gpu(self, buf) -> bool:
        """Reduce device array ``buf`` on the GPU (staged.run) rather than on the host (see ``gpu_reduce``)."""
        return self.gpu_reduce if self.gpu_reduce is not None else buf.nbytes >= GPU_REDUCE_MIN_BYTES

    def _stage(self, name: str, src):
        """A pinned host copy of device array ``src`` (1-D), in memory reused across calls."""
        host = staged.pinned(self._executor, name, src.nbytes).view(src.dtype)
        device.copy(host, src)
        return host

    def _counts(self, what: str, recvcounts, block: int):
        if recvcounts is None:
            return [block] * self.size
        counts = [int(c) for c in recvcounts]
        if len(counts) != self.size or min(counts) < 0:
            self._fail(what, ValueError, f"recvcounts needs {self.size} non-negative counts, got {recvcounts!r}")
        return counts

    @_collective
    def reduce_scatter(self, sendbuf, recvbuf=None, *, recvcounts=None, op: str = "sum",
                       algorithm: str = "auto"):
        """Reduce-scatter: block ``rank`` of the elementwise reduction lands on rank ``rank``.

        sendbuf: ``sum(recvcounts)`` elements (block form: ``size * recvcount``, with ``recvcounts=None``);
        block ``i`` starts at ``sum(recvcounts[:i])``. recvbuf: ``recvcounts[rank]`` elements, or None.
        In place (``sendbuf=MPI.IN_PLACE``): recvbuf holds all ``sum(recvcounts)`` elements; the result is
        written into its block ``rank`` and every element outside that block is left untouched.
        Returns the result block (recvbuf, or its block view when in place).
        """
        what = "reduce_scatter"
        in_place = sendbuf is MPI.IN_PLACE or (sendbuf is not None and sendbuf is recvbuf)
        full = recvbuf if in_place else sendbuf
        total = getattr(full, "size", 0) if full is not None and full is not MPI.IN_PLACE else 0
        if recvcounts is None and total % self.size:
            self._fail(what, ValueError, f"{total} elements do not split into {self.size} equal blocks; "
                                         "pass recvcounts")
        counts = self._counts(what, recvcounts, total // self.size)
        displs = displacements(counts)
        sendbuf, recvbuf, dt = self._prepare(
            what, sendbuf, recvbuf, op,
            lambda n: counts[self.rank] if sum(counts) == n else self._fail(
                what, ValueError, f"sendbuf has {n} elements, recvcounts sum to {sum(counts)}"))
        if in_place and recvbuf.size != sum(counts):
            self._fail(what, ValueError, f"recvbuf (in place) has {recvbuf.size} elements, recvcounts sum "
                                         f"to {sum(counts)}")
        algo = self._algorithm(what, algorithm, sum(counts) * dt.itemsize, sendbuf is None)
        if algo == "hierarchical" and not self._node_grid:
            algo = "ring"
        if self.check:
            self._agree(what, algo, op, dt, sum(counts), counts)
        lo, hi = displs[self.rank], displs[self.rank] + counts[self.rank]
        pre, scale = avg_factors(dt, self.size) if op == "avg" else (1.0, 1.0)
        if device.is_device(recvbuf):
            src = device.view(recvbuf if in_place else sendbuf).reshape(-1)
            out = device.view(recvbuf).reshape(-1)
            out = out[lo:hi] if in_place else out
            if algo == "native" or not self._on_gpu(src):  # reduce on the host, in pinned memory
                host = self._stage("stage", src)
                _prescale(host, pre)
                if algo == "native":
                    hout = staged.pinned(self._executor, "stage out", out.nbytes).view(dt)
                    native.reduce_scatter(self.comm, host, hout, counts, op, scale)
                else:
                    self._executor.run(f"{what}({algo})", self._plan(what, algo, tuple(counts), dt.itemsize),
                                       host, op, scale)
                    hout = host[lo:hi]
                device.copy(out, hout)
            else:
                work = staged.device_buffer(self._executor, "work", src.size, dt)
                device.copy(work, src)
                _prescale(work, pre)
                staged.run(self._executor, f"{what}({algo})", self._plan(what, algo, tuple(counts),
                                                                         dt.itemsize), work, op, scale)
                device.copy(out, work[lo:hi])
            return recvbuf.reshape(-1)[lo:hi] if in_place else recvbuf
        src = (recvbuf if in_place else sendbuf).reshape(-1)
        out = recvbuf.reshape(-1)[lo:hi] if in_place else recvbuf.reshape(-1)
        # The schedules write into a reusable working buffer and read the input from src (never written), so
        # sendbuf (and, in place, every block but ours) stays untouched without copying it first.
        work = self._executor.buffer("work", src.nbytes).view(dt)
        if algo == "native" or pre != 1.0:
            np.copyto(work, src)
            _prescale(work, pre)
            src = None
        if algo == "native":
            native.reduce_scatter(self.comm, work, out, counts, op, scale)
        else:
            self._executor.run(f"{what}({algo})", self._plan(what, algo, tuple(counts), dt.itemsize), work,
                               op, scale, src, (lo, hi))
            np.copyto(out, work[lo:hi])
        return out if in_place else recvbuf

    @_collective
    def allgather(self, sendbuf, recvbuf=None, *, recvcounts=None, algorithm: str = "auto"):
        """All-gather: every rank ends with every rank's block, in rank order.

        sendbuf: ``recvcounts[rank]`` elements (block form: ``count`` on every rank with recvcounts None).
        recvbuf: ``sum(recvcounts)`` elements, or None. In place (``sendbuf=MPI.IN_PLACE``): recvbuf's block
        ``rank`` already holds this rank's data. Returns recvbuf.
        """
        what = "allgather"
        in_place = sendbuf is MPI.IN_PLACE or (sendbuf is not None and sendbuf is recvbuf)
        if in_place:
            recvbuf = self._array(what, "recvbuf (in place)", recvbuf, True)
            if recvcounts is None and recvbuf.size % self.size:
                self._fail(what, ValueError, f"recvbuf has {recvbuf.size} elements, not a multiple of "
                                             f"{self.size}; pass recvcounts")
            counts = self._counts(what, recvcounts, recvbuf.size // self.size)
        else:
            sendbuf = self._array(what, "sendbuf", sendbuf, False)
            counts = self._counts(what, recvcounts, sendbuf.size)
            if sendbuf.size != counts[self.rank]:
                self._fail(what, ValueError, f"sendbuf has {sendbuf.size} elements, recvcounts[{self.rank}] "
                                             f"is {counts[self.rank]}")
        displs = displacements(counts)
        sendbuf, recvbuf, dt = self._prepare(what, MPI.IN_PLACE if in_place else sendbuf, recvbuf, "sum",
                                             lambda n: sum(counts))
        if recvbuf.size != sum(counts):
            self._fail(what, ValueError, f"recvbuf has {recvbuf.size} elements, expected {sum(counts)}")
        algo = self._algorithm(what, algorithm, sum(counts) * dt.itemsize, sendbuf is None)
        if algo == "hierarchical" and not self._node_grid:
            algo = "ring"
        if self.check:
            self._agree(what, algo, "sum", dt, sum(counts), counts)
        mine = slice(displs[self.rank], displs[self.rank] + counts[self.rank])
        if device.is_device(recvbuf):
            buf = device.view(recvbuf).reshape(-1)
            own = buf[mine] if sendbuf is None else device.view(sendbuf).reshape(-1)
            if algo == "native" or not self._on_gpu(buf):  # gather in pinned host memory
                host = staged.pinned(self._executor, "stage", buf.nbytes).view(dt)
                device.copy(host[mine], own)
                if algo == "native":
                    native.allgather(self.comm, host, counts, displs)
                else:
                    self._executor.run(f"{what}({algo})", self._plan(what, algo, tuple(counts), dt.itemsize),
                                       host, "sum", 1.0)
                device.copy(buf, host)
                return recvbuf
            if sendbuf is not None:
                device.copy(buf[mine], own)
            staged.run(self._executor, f"{what}({algo})", self._plan(what, algo, tuple(counts), dt.itemsize),
                       buf, "sum", 1.0)
            return recvbuf
        buf = recvbuf.reshape(-1)
        if sendbuf is not None:
            np.copyto(buf[mine], sendbuf.reshape(-1))
        if algo == "native":
            native.allgather(self.comm, buf, counts, displs)
            return recvbuf
        self._executor.run(f"{what}({algo})", self._plan(what, algo, tuple(counts), dt.itemsize), buf, "sum",
                           1.0)
        return recvbuf

    def Free(self) -> None:
        """Release the duplicated communicators (collective)."""
        self._finish_announcements("Free")
        for c in (self.row_comm, self.col_comm, self.local_comm, self.cross_comm, self.cart, self.comm):
            c.Free()

    def __repr__(self) -> str:
        X, Y = self.dims
        return f"TorusComm(rank={self.rank}, size={self.size}, dims={X}x{Y}, coords={self.coords})"
