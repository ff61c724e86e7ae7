"""TorusComm: an mpi4py intracommunicator seen as a periodic X x Y grid, with ring, hierarchical, 2D-torus,
native and (ranks on one node) shared-memory reduce-scatter, all-gather and all-reduce.

Buffers are C-contiguous numpy arrays or GPU arrays (``__cuda_array_interface__``: CuPy, numba; wrap a
PyTorch CUDA tensor with ``cupy.asarray``) of float16, bfloat16, float32, float64, int32 or int64, sendbuf and
recvbuf of the same kind; counts in elements. GPU arrays must live on numba's current device (one GPU per
rank); the MPI need not be CUDA-aware (see ``gpu_reduce``). Every call: resolve and check the buffers on the
calling rank (torus/buffers.py: ValueError/TypeError naming the operation and rank, before any message),
choose the algorithm (torus/select.py), agree across ranks (torus/agreement.py: MismatchError), then one path:
stage in, one direct call (MPI's own collective, or the shared-memory transport of torus/runtime/shm.py) or
the compiled plan, stage out.
"""
from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from torus import agreement, buffers, kernels
from torus.ops import DTYPES, avg_factors
from torus.runtime import memory
from torus.runtime.executor import Executor
from torus.runtime.shm import SharedMemory
from torus.schedules.build import build, effective
from torus.select import ALGORITHMS, choose
from torus.topology import Topology, node_indices

# GPU buffers from this size (bytes) are reduced on the GPU by default (see gpu_reduce, bench/README.md).
GPU_REDUCE_MIN_BYTES = 16 << 20


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
        Pipelining unit in bytes (default 1 MiB, ``TORUS_SEGMENT_BYTES``); must be equal on all ranks. The
        shared-memory transport moves this many bytes per rank and step (when neither is given: 256 KiB, or
        1 MiB with more ranks than cores; ``torus.runtime.shm``), through a window of about twice that per
        rank set up at the first ``algorithm="shm"`` call (collective).
    check : bool
        Agree on every call's arguments across ranks before moving data (default on, ``TORUS_CHECK=0``).
    timeout : float or None
        Seconds a collective may wait without progress before raising ``torus.errors.TimeoutError``
        (default 600, ``TORUS_TIMEOUT``; 0 or None waits forever).
    gpu_reduce : bool or None
        GPU buffers only. True: the buffer stays on the GPU, every message is staged through a pinned host
        mirror and reduced on the GPU by the Numba-CUDA kernels (``torus/runtime/memory.py``). False: the
        whole buffer is copied to pinned host memory, reduced there by the host schedule and kernels, and
        copied back. None (default; ``TORUS_GPU_REDUCE=1``/``0`` force it): True from ``GPU_REDUCE_MIN_BYTES``
        (16 MiB) up, where the two measured level (bench/README.md, "On a GPU"). Same results to the bit
        either way, and the same messages, so ranks may differ.
    threads : "auto", int or None
        OpenMP threads of the host kernels, a process-wide setting (``torus.kernels.set_num_threads``).
        "auto" (default): the CPUs divided by the ranks on this node, unless ``TORUS_NUM_THREADS`` is set; an
        int: that many; None: leave the setting as it is (e.g. when the application manages threads).

    Memory: calls keep their working buffers for the next call (a fresh allocation would cost page faults
    every step), growing only: one step's incoming data (all-reduce: ``count / size`` elements for the ring,
    ``count / X`` for the 2D torus, ``count / Y`` when ``X`` is 1), a full-size working copy for
    reduce-scatter, pinned host and device mirrors for GPU buffers; :meth:`free_buffers` releases them.

    Raises ``ValueError`` when ``dims`` does not multiply to the size. Collective: every rank constructs it.
    """

    def __init__(self, comm: MPI.Intracomm | None = None, dims=None, *, ranks_per_node: int | None = None,
                 segment_bytes: int | None = None, check: bool | None = None, timeout: float | None = -1.0,
                 gpu_reduce: bool | None = None, threads: int | str | None = "auto"):
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
        rpn = ranks_per_node or int(_env_float("TORUS_RANKS_PER_NODE", 0))
        if rpn:
            self.topology = Topology.emulated(rank, size, (X, Y), rpn)
        else:  # a node is the ranks sharing memory, known by its lowest rank
            shared = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
            lowest = shared.allreduce(rank, op=MPI.MIN)
            shared.Free()
            self.topology = Topology(rank, size, (X, Y), node_indices(self.comm.allgather(lowest)))
        t = self.topology
        self.coords, self.node, self.nodes = t.coords, t.node, t.nodes
        self.local_rank, self.local_size = t.local_rank, t.local_size
        self.row_comm, self.col_comm, self.local_comm, self.cross_comm = (
            self.comm.Split(*t.split(name)) for name in ("row", "col", "local", "cross"))
        if threads == "auto" and "TORUS_NUM_THREADS" not in os.environ:
            kernels.set_num_threads((os.cpu_count() or 1) // self.local_size)
        elif threads not in ("auto", None):
            kernels.set_num_threads(int(threads))
        comms = {"world": self.comm, "row": self.row_comm, "col": self.col_comm,
                 "local": self.local_comm, "cross": self.cross_comm}
        self._executor = Executor(comms, rank, seg, timeout or None)
        given = segment_bytes or os.environ.get("TORUS_SEGMENT_BYTES")
        self._shm = SharedMemory(self.comm, rank, size, seg if given else None, timeout or None)
        # Algorithms that run as one call on the whole buffers (no compiled plan): (name, spec, placement,
        # out, op, scale) -> None, the result in ``out`` (reduce-scatter) or ``placement.work``.
        self._direct = {"native": self._run_native, "shm": self._run_shm}
        self._plans: dict = {}
        self._auto: dict = {}
        self._agreeing = False
        self._announcements: list = []  # error reports posted and not yet completed (agreement.py)

    def _algorithm(self, what: str, algorithm: str, nbytes: int, in_place: bool) -> str:
        if algorithm == "auto":
            # Memoized per (collective, nbytes, placement): the table costs about a tenth of a small native
            # call. TORUS_ALGO is therefore read when a size is first seen, not on every call.
            key = (what, nbytes, in_place)
            algo = self._auto.get(key)
            if algo is None:
                if len(self._auto) >= 4096:
                    self._auto.clear()
                algo = self._auto[key] = choose(what, nbytes, self.size, self.dims, in_place,
                                                   self.topology.nodes == 1)
        elif algorithm not in ALGORITHMS:
            buffers.fail(what, self.rank, ValueError, f"unknown algorithm {algorithm!r}; expected auto or one "
                                                      f"of {', '.join(ALGORITHMS)}")
        else:
            algo = algorithm
        if algo == "shm" and self.topology.nodes > 1:
            buffers.fail(what, self.rank, ValueError, f"algorithm 'shm' needs every rank on one node; these "
                                                      f"{self.size} ranks are on {self.topology.nodes} nodes "
                                                      "(use ring, hierarchical or torus2d)")
        return effective(what, algo, self.topology)

    def _plan(self, what: str, algo: str, counts, itemsize: int):
        """The compiled plan of one call, cached: training repeats the same few shapes every step, and a
        plan is a pure function of (collective, algorithm, counts, itemsize) on a given rank and grid."""
        key = (what, algo, counts, itemsize)
        compiled = self._plans.get(key)
        if compiled is None:
            if len(self._plans) >= 256:  # bounded: a sweep over many sizes must not grow without limit
                self._plans.clear()
            total = counts if isinstance(counts, int) else sum(counts)
            compiled = self._plans[key] = self._executor.compile(build(what, algo, self.topology, counts),
                                                                 itemsize, total)
        return compiled

    def _buffer(self, kind: str, name: str, count: int, dtype):
        if kind == "host":
            return self._executor.buffer(name, count * dtype.itemsize).view(dtype)
        if kind == "pinned":
            return memory.pinned(self._executor, name, count * dtype.itemsize).view(dtype)
        return memory.device_buffer(self._executor, name, count, dtype)

    def _call(self, spec, sendbuf, recvbuf, op: str, algorithm: str, recvcounts=None):
        """Resolve, choose, agree and run one call; returns what the collective returns."""
        p = buffers.resolve(spec, self.rank, self.size, sendbuf, recvbuf, op, recvcounts)
        algo = self._algorithm(spec.name, algorithm, p.count * p.dtype.itemsize, p.in_place)
        self._agreeing = True  # from here on an error is the communication's, not this rank's arguments
        # Over shared memory the signature rides in every step's header (torus/runtime/shm.py), so once the
        # window is open the separate all-gather is skipped (what that misses: torus/agreement.py).
        agreement.finish(self._announcements, self.rank, self._executor.timeout, spec.name)
        if self.check and not (algo == "shm" and self._shm.is_open):
            try:
                agreement.agree(self.comm, self.rank, self.size, self._executor.timeout, spec.name, algo, op,
                                p.dtype, p.count, p.counts, self.segment_bytes, self.dims[0])
            except agreement.PeerRejected:
                self._shm.skip_step(True, "")  # that rank spent a shared-memory step on its report
                raise
        pre, scale = avg_factors(p.dtype, self.size) if op == "avg" else (1.0, 1.0)
        memory = p.memory
        direct = self._direct.get(algo)
        if memory == "device" and (direct is not None or not self._on_gpu(p.count * p.dtype.itemsize)):
            memory = "staged"
        buffers.bind(p, spec, memory, self._buffer, lazy_ok=algo != "native" and pre == 1.0)
        buffers.stage_in(p, spec)
        if pre != 1.0 and p.count:  # avg: pre-scale so partial sums cannot overflow (ops.avg_factors)
            kernels.scale(p.work, pre)
        name = f"{spec.name}({algo})"
        if direct is not None:
            out = p.out if memory == "host" or p.out is None else self._buffer("pinned", "stage out",
                                                                              p.out.size, p.dtype)
            direct(name, spec, p, out, op, scale)
            result = out if spec.output_own else p.work
        else:
            plan = self._plan(spec.name, algo, p.count if p.counts is None else tuple(p.counts),
                              p.dtype.itemsize)
            if memory == "device":
                self._executor.run_device(name, plan, p.work, op, scale)
            else:
                self._executor.run(name, plan, p.work, op, scale, p.src if p.lazy else None,
                                   (p.own.start, p.own.stop) if spec.output_own else None)
            result = p.work[p.own] if spec.output_own else p.work
        buffers.stage_out(p, spec, result)
        return p.result

    def _run_native(self, name: str, spec, p, out, op: str, scale: float) -> None:
        spec.native(self.comm, p.work, out, p.counts, p.displs, op, scale)

    def _run_shm(self, name: str, spec, p, out, op: str, scale: float) -> None:
        src = p.src if p.lazy else p.work[p.own] if spec.input_own else p.work
        self._shm.run(name, spec.name, src, out if spec.output_own else p.work, p.counts, op, scale, self.check)

    def _on_gpu(self, nbytes: int) -> bool:
        """Reduce device arrays on the GPU (staged per message) rather than on the host (``gpu_reduce``)."""
        return self.gpu_reduce if self.gpu_reduce is not None else nbytes >= GPU_REDUCE_MIN_BYTES

    @agreement.reports_errors
    def allreduce(self, sendbuf, recvbuf=None, *, op: str = "sum", algorithm: str = "auto"):
        """All-reduce: every rank ends with ``op`` over all ranks' buffers, elementwise.

        sendbuf: any shape, ``count`` elements; or ``MPI.IN_PLACE`` (then ``recvbuf`` is input and output).
        recvbuf: ``count`` elements of the same dtype (any shape), or None to allocate ``empty_like(sendbuf)``.
        Returns recvbuf. Every rank's result is bitwise identical for every algorithm (each element is
        reduced once, on its owner, and copied to the others). ``op="avg"`` does not overflow where the mean
        fits (torus.ops.avg_factors). Raises ValueError/TypeError on bad input and MismatchError when ranks
        disagree; see the class docstring.
        """
        return self._call(buffers.ALLREDUCE, sendbuf, recvbuf, op, algorithm)

    @agreement.reports_errors
    def reduce_scatter(self, sendbuf, recvbuf=None, *, recvcounts=None, op: str = "sum",
                       algorithm: str = "auto"):
        """Reduce-scatter: block ``rank`` of the elementwise reduction lands on rank ``rank``.

        sendbuf: ``sum(recvcounts)`` elements (block form: ``size * recvcount``, with ``recvcounts=None``);
        block ``i`` starts at ``sum(recvcounts[:i])``. recvbuf: ``recvcounts[rank]`` elements, or None.
        In place (``sendbuf=MPI.IN_PLACE``): recvbuf holds all ``sum(recvcounts)`` elements; the result is
        written into its block ``rank`` and every element outside that block is left untouched.
        Returns the result block (recvbuf, or its block view when in place).
        """
        return self._call(buffers.REDUCE_SCATTER, sendbuf, recvbuf, op, algorithm, recvcounts)

    @agreement.reports_errors
    def allgather(self, sendbuf, recvbuf=None, *, recvcounts=None, algorithm: str = "auto"):
        """All-gather: every rank ends with every rank's block, in rank order.

        sendbuf: ``recvcounts[rank]`` elements (block form: ``count`` on every rank with recvcounts None).
        recvbuf: ``sum(recvcounts)`` elements, or None. In place (``sendbuf=MPI.IN_PLACE``): recvbuf's block
        ``rank`` already holds this rank's data. Returns recvbuf.
        """
        return self._call(buffers.ALLGATHER, sendbuf, recvbuf, "sum", algorithm, recvcounts)

    def alloc(self, count: int, dtype=np.float32) -> np.ndarray:
        """A 1-D numpy array of ``count`` elements of ``dtype`` (uninitialised) that lives in shared memory:
        an in-place all-reduce of exactly this array (``allreduce(MPI.IN_PLACE, a)`` with ``algorithm`` "shm",
        or "auto" where it picks shm) reduces straight from the peers' arrays, with no copy in (the fused
        gradient buffer of a training step is the use). Collective: every rank calls it, with the same count
        and dtype, in the same order; every rank on one node. Valid until :meth:`Free`; any other call on it
        (a slice, out of place, reduce-scatter) takes the ordinary path.

        Raises ValueError when the ranks span several nodes or ``count`` is negative, TypeError for a dtype
        torus does not reduce."""
        dt = np.dtype(dtype)
        if dt not in DTYPES:
            buffers.fail("alloc", self.rank, TypeError, f"dtype {dt} is not one of "
                                                        f"{', '.join(str(d) for d in DTYPES)}")
        if count < 0:
            buffers.fail("alloc", self.rank, ValueError, f"count {count} is negative")
        if self.topology.nodes > 1:
            buffers.fail("alloc", self.rank, ValueError, f"shared memory needs every rank on one node; these "
                                                         f"{self.size} ranks are on {self.topology.nodes} nodes")
        return self._shm.alloc("alloc", int(count), dt)

    def free_buffers(self) -> None:
        """Release the working buffers kept between calls (see the class docstring); the next call allocates
        what it needs again. Local: ranks need not call it together."""
        self._executor.free()

    def Free(self) -> None:
        """Release the duplicated communicators (collective)."""
        agreement.finish(self._announcements, self.rank, self._executor.timeout, "Free")
        self._shm.free()
        for c in (self.row_comm, self.col_comm, self.local_comm, self.cross_comm, self.comm):
            c.Free()

    def __repr__(self) -> str:
        X, Y = self.dims
        return f"TorusComm(rank={self.rank}, size={self.size}, dims={X}x{Y}, coords={self.coords})"
