"""TorusComm: an mpi4py intracommunicator seen as a periodic X x Y grid, with ring, hierarchical, 2D-torus,
Swing, native and (ranks on one node) shared-memory reduce-scatter, all-gather and all-reduce.

Buffers are C-contiguous numpy arrays or GPU arrays (``__cuda_array_interface__``: CuPy, numba; wrap a
PyTorch CUDA tensor with ``cupy.asarray``) of float16, bfloat16, float32, float64, int32 or int64, sendbuf and
recvbuf of the same kind; counts in elements. GPU arrays must live on numba's current device (one GPU per
rank); the MPI need not be CUDA-aware (see ``gpu_reduce``). Every call: resolve and check the buffers on the
calling rank (torus/buffers.py: ValueError/TypeError naming the operation and rank, before any message),
choose the algorithm (torus/select.py), agree across ranks (torus/agreement.py: MismatchError), then one path:
stage in, one direct call (MPI's own collective, or the shared-memory transport of torus/runtime/shm.py) or
the compiled phases (one plan; across nodes, shared-memory phases within the nodes and a plan between them:
torus/schedules/phases.py), stage out.
"""
from __future__ import annotations

import functools
import os

import numpy as np
from mpi4py import MPI

from torus import agreement, buffers, kernels, knobs, link, options, recorder
from torus.errors import TimeoutError as TorusTimeout
from torus.errors import TorusError
from torus.runtime import memory
from torus.runtime.executor import Executor
from torus.runtime.shm import SharedMemory, StepMismatch
from torus.select import Nodes, choose
from torus.shapes import Shapes

# GPU buffers from this size (bytes) are reduced on the GPU by default (see gpu_reduce, bench/gpu/README.md).
GPU_REDUCE_MIN_BYTES = 16 << 20


_MPI_OPS = ((MPI.SUM, "sum"), (MPI.MIN, "min"), (MPI.MAX, "max"), (MPI.PROD, "prod"))  # MPI.Op is unhashable


class TorusComm:
    """A communicator arranged as a periodic ``X x Y`` grid (``X`` ranks along a row).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        The ranks to use (default ``MPI.COMM_WORLD``). It is duplicated, so torus messages never match the
        caller's.
    dims : (int, int), optional
        ``(X, Y)`` with ``X * Y == comm.size``. ``None``: one axis along the nodes where they are equal and
        placed in blocks (rows are the nodes: ``(ranks per node, nodes)``) or round robin (columns are the
        nodes), so that only ``1/X`` (``1/Y``) of an all-reduce's buffer crosses them
        (``torus.topology.node_dims``); otherwise, and on one node, ``MPI.Compute_dims``'s squarest grid.
    ranks_per_node : int, optional
        Emulate nodes of this many consecutive ranks for the hierarchical schedule (default: the real nodes,
        ``MPI.COMM_TYPE_SHARED``; environment ``TORUS_RANKS_PER_NODE``).
    segment_bytes : int
        Pipelining unit in bytes (default 1 MiB on one node, 256 KiB across nodes, ``TORUS_SEGMENT_BYTES``;
        the shm transport's own default: ``torus.runtime.shm.SEGMENT_BYTES``); equal on all ranks.
    check : bool
        Agree on every call's arguments across ranks before moving data (default on, ``TORUS_CHECK=0``).
    timeout : float or None
        Seconds a collective may wait without progress before raising ``torus.errors.TimeoutError``
        (default 600, ``TORUS_TIMEOUT``; 0 or None waits forever).
    gpu_reduce : bool or None
        GPU buffers only: reduce on the GPU, messages staged through pinned host memory (True), or on the
        host (False); None (default, ``TORUS_GPU_REDUCE``): True from ``GPU_REDUCE_MIN_BYTES``. Same bits
        either way, so ranks may differ.
    link_gbits : float, optional
        Gbit/s of one node's link (one direction), for ``algorithm="auto"`` across nodes
        (``TORUS_LINK_GBITS``); default: measured here, once, by a short exchange between the leaders of
        nodes 0 and 1 (torus/link.py). Unused on one node and on emulated
        nodes (``ranks_per_node``), where ``auto`` keeps the one-node table.
    shm_phases : bool
        Across nodes, run the phases of hierarchical and torus2d that lie within a node over shared memory
        (torus/schedules/phases.py; default on, ``TORUS_SHM_PHASES``); equal on every rank. Bitwise identical
        on every rank either way, not always bitwise equal between the two.
    threads : "auto", int or None
        OpenMP threads of the host kernels, process-wide (``torus.kernels.set_num_threads``): "auto" (default)
        the CPUs divided by the ranks on this machine, unless ``TORUS_NUM_THREADS`` is set; None leaves it.

    Calls keep their working buffers for the next call (a fresh allocation would cost page faults every step),
    growing only; :meth:`free_buffers` releases them. Every argument in full: docs/api.md.

    Raises ``ValueError`` when ``dims`` does not multiply to the size. Collective: every rank constructs it.
    """

    def __init__(self, comm: MPI.Intracomm | None = None, dims=None, *, ranks_per_node: int | None = None,
                 segment_bytes: int | None = None, check: bool | None = None, timeout: float | None = -1.0,
                 gpu_reduce: bool | None = None, threads: int | str | None = "auto",
                 link_gbits: float | None = None, shm_phases: bool | None = None):
        options.launched_alone()
        base = MPI.COMM_WORLD if comm is None else comm
        rank, size = base.Get_rank(), base.Get_size()
        o = options.resolve(rank, size, dims, segment_bytes, check, timeout, gpu_reduce, link_gbits,
                            ranks_per_node, shm_phases)
        self.comm = base.Dup()
        self.rank, self.size, self.check, self.gpu_reduce = rank, size, o.check, o.gpu_reduce
        self.topology = t = options.discover(self.comm, o)
        self.dims, self.segment_bytes = t.dims, o.segment_for(t)
        self.coords, self.node, self.nodes = t.coords, t.node, t.nodes
        self.local_rank, self.local_size = t.local_rank, t.local_size
        self.row_comm, self.col_comm, self.local_comm, self.cross_comm = (
            self.comm.Split(*t.split(name)) for name in ("row", "col", "local", "cross"))
        # the ranks that share this rank's CPUs: its node's, or more where nodes share a machine (collective)
        on_machine = options.machine_ranks(self.comm) if t.nodes > 1 else t.local_size
        if threads == "auto" and not knobs.is_set("TORUS_NUM_THREADS"):
            kernels.set_num_threads((os.cpu_count() or 1) // max(on_machine, t.local_size))
        elif threads not in ("auto", None):
            kernels.set_num_threads(int(threads))
        comms: dict = {"world": self.comm, "row": self.row_comm, "col": self.col_comm,  # Split's are Intracomms
                       "local": self.local_comm, "cross": self.cross_comm}
        self._shm = SharedMemory(self.comm, rank, size, o.segment_bytes or None, o.timeout)
        # Node-level transports for the shared-memory phases across nodes (a window each, set up at first use);
        # node_memory is collective whatever this rank's shm_phases, so that ranks that differ in it reach the
        # argument check (which names it) rather than hang here
        machine = (options.node_memory(self.comm, self.local_comm, t, bool(o.ranks_per_node), on_machine)
                   if t.nodes > 1 else None)
        self._node_shm = {} if machine is None or not o.shm_phases else {
            name: SharedMemory(comms[name], comms[name].Get_rank(), comms[name].Get_size(),
                               o.segment_bytes or None, o.timeout, t.members(name), machine)
            for name in ("local", "row", "col")}
        self._executor = Executor(comms, rank, self.segment_bytes, o.timeout, self._node_shm)
        self._buffer = functools.partial(memory.buffer, self._executor)  # (kind, name, count, dtype) -> array
        self._across = not o.ranks_per_node and t.nodes > 1  # real nodes: auto's multi-node rule applies
        # measured here, where every rank is known to take part (see link.for_nodes)
        self._link_gbits = link.for_nodes(self.comm, t, o.link_gbits, o.timeout) if self._across else o.link_gbits
        # Algorithms that run as one call on the whole buffers (no compiled plan): (name, spec, placement,
        # out, op, scale) -> None, the result in ``out`` (reduce-scatter) or ``placement.work``.
        self._direct = {"native": self._run_native, "shm": self._run_shm}
        self._shapes = Shapes(t, self.segment_bytes, self.auto_choice, bool(self._node_shm),
                              self._link_gbits if t.nodes > 1 else None)
        self._agreeing = False
        self._announcements: list = []  # error reports posted and not yet completed (agreement.py)
        self._released = False  # Free was called
        self._options = o
        # collective: the id that names it in every rank's dump
        self.recorder = recorder.Recorder(self.comm, node=self.node)

    def auto_choice(self, collective: str, nbytes: int, in_place: bool = False) -> str:
        """What ``algorithm="auto"`` runs for ``collective`` on ``nbytes`` bytes (torus/select.py), before the
        hierarchical fallback of ``effective``: on real nodes (not ``ranks_per_node``'s emulated ones) the
        multi-node rule with ``link_gbits``, else the one-node table. Local."""
        across = None
        if self._across and self._link_gbits is not None:  # set whenever _across is (measured if not told)
            t = self.topology
            across = Nodes(t.nodes, t.max_local, t.node_axis, self._link_gbits)
        return choose(collective, nbytes, self.size, self.dims, in_place, across, self.topology.nodes == 1)

    @property
    def link_gbits(self) -> float | None:
        """Gbit/s of the link between nodes as ``auto`` uses it: told, or measured when this TorusComm was
        made; None on one node or emulated nodes when not told."""
        return self._link_gbits

    @property
    def shm_phases(self) -> bool:
        """True when calls across nodes run their node-level phases over shared memory (``shm_phases`` on,
        several nodes, each node's ranks sharing memory; which calls: torus/schedules/phases.py)."""
        return bool(self._node_shm)

    def _call(self, spec, sendbuf, recvbuf, op: str, algorithm: str, recvcounts=None):
        """Resolve, choose, agree and run one call; returns what the collective returns. The flight recorder
        (torus/recorder.py) holds the call from its choice on; a stall timeout dumps it."""
        self._usable(spec.name)
        if isinstance(op, MPI.Op):  # mpi4py's habit: MPI.SUM etc. name the same reductions
            op = next((name for mpi_op, name in _MPI_OPS if op == mpi_op), op)
        p = buffers.resolve(spec, self.rank, self.size, sendbuf, recvbuf, op, recvcounts)
        algo, phased, mine, pre, scale = self._shapes.get(spec.name, algorithm, op, p)
        if not self.recorder.capacity:
            return self._run(spec, p, op, algo, phased, mine, pre, scale)
        record = self.recorder.begin(spec.name, p.count, p.dtype, algo)
        try:
            result = self._run(spec, p, op, algo, phased, mine, pre, scale)
        except BaseException as exc:
            recorder.fail(record, exc)
            if isinstance(exc, TorusTimeout):
                recorder.on_stall(self.recorder, exc)
            raise
        recorder.end(record)
        return result

    def _run(self, spec, p, op: str, algo: str, phased, mine, pre, scale):
        """Agree and run one resolved call (``p``: its placement; ``algo`` etc.: Shapes.get's choice)."""
        self._agreeing = True  # from here on an error is the communication's, not this rank's arguments
        # Over shared memory the signature rides in every step's header (torus/runtime/shm.py), so once the
        # window is open the separate all-gather is skipped (what that misses: torus/agreement.py).
        agreement.finish(self._announcements, self.rank, self._executor.timeout, spec.name)
        if self.check and not (algo == "shm" and self._shm.is_open):
            # Peers that run this call over shared memory learn of another algorithm here at once.
            other = algo != "shm" and self._shm.announce_other()
            try:
                agreement.agree(self.comm, self.rank, self.size, self._executor.timeout, spec.name, algo, mine,
                                p.counts)
            except agreement.PeerRejected:
                if not other:  # that rank spent a shared-memory step on its report (so did we, announcing)
                    self._shm.skip_step(True, "")
                raise
        kind = p.memory
        direct = self._direct.get(algo)
        if kind == "device" and (direct is not None or not self._on_gpu(p.count * p.dtype.itemsize)):
            kind = "staged"
        buffers.bind(p, spec, kind, self._buffer, lazy_ok=algo != "native" and pre == 1.0)
        buffers.stage_in(p, spec)
        if pre != 1.0 and p.count:  # avg: pre-scale so partial sums cannot overflow (ops.avg_factors)
            kernels.scale(p.work, pre)
        name = f"{spec.name}({algo})"
        if direct is not None:
            out = p.out if kind == "host" or p.out is None else self._buffer("pinned", "stage out",
                                                                              p.out.size, p.dtype)
            try:
                direct(name, spec, p, out, op, scale)
            except StepMismatch:
                if self.check:  # every rank is here: say which argument differs (MismatchError)
                    agreement.agree(self.comm, self.rank, self.size, self._executor.timeout, spec.name, algo,
                                    mine, p.counts)
                raise
            result = out if spec.output_own else p.work
        else:
            counts = p.count if p.counts is None else tuple(p.counts)
            phases = self._executor.phases(spec.name, algo, self.topology, counts, p.dtype.itemsize, phased)
            if kind == "device":
                self._executor.run_phases_device(name, phases, p.work, op, scale, self.check)
            else:
                self._executor.run_phases(name, phases, p.work, op, scale, p.src if p.lazy else None, self.check)
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

        sendbuf: any shape, C-contiguous, ``count`` elements; or ``MPI.IN_PLACE`` (then ``recvbuf`` is input
        and output). recvbuf: ``count`` elements of the same dtype (any shape, C-contiguous, writable), or None
        to allocate ``empty_like(sendbuf)``. Returns recvbuf. Every rank's result is bitwise identical for
        every algorithm (each element is reduced once, on its owner, and copied to the others). ``op``: "sum",
        "avg", "min", "max" or "prod" (mpi4py's MPI.SUM, MPI.MIN, MPI.MAX, MPI.PROD too, in every collective).
        ``op="avg"`` (floating dtypes only: for integers it is a TypeError, use "sum" and divide) does not
        overflow where the mean fits (torus.ops.avg_factors). Raises ValueError/TypeError on bad input and
        MismatchError when ranks disagree; see the class docstring.
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
        and dtype, in the same order; every rank on one node. Valid until :meth:`free_alloc`; any other call on it
        (a slice, out of place, reduce-scatter) takes the ordinary path.

        Raises ValueError when the ranks span several nodes or ``count`` is negative, TypeError for a dtype
        torus does not reduce or a ``count`` that is not an integer, MemoryError (on every rank) when the
        node's /dev/shm cannot hold it, MismatchError (every rank) when ranks pass another count or dtype,
        TimeoutError when some rank does not call it within the stall timeout."""
        self._usable("alloc")
        return self._shm.alloc("alloc", count, dtype, self.topology.nodes)

    def free_alloc(self, array: np.ndarray) -> None:
        """Release an array from :meth:`alloc` (collective, as ``alloc``: every rank its own array, in the same
        order); writes to it afterwards are a ValueError (it is made read-only; a write through a view made
        before is a crash), reads see zeros (one rank alone: the last values). Raises
        ValueError for any other array (a view included) or one freed already, MismatchError (every rank,
        nothing freed) when ranks free different buffers (another order), TimeoutError when some rank does
        not call it within the stall timeout."""
        self._usable("free_alloc")
        self._shm.release("free_alloc", array)

    def free_buffers(self) -> None:
        """Release the working buffers kept between calls (see the class docstring); the next call allocates
        what it needs again. Local: ranks need not call it together."""
        self._executor.free()

    def _usable(self, what: str) -> None:
        if self._released:
            raise TorusError(f"{what} on rank {self.rank}: this TorusComm was freed (TorusComm.Free)")

    def Dup(self) -> TorusComm:
        """A new TorusComm over a duplicate of this one's communicator: the same ranks, grid, nodes and options
        (the link's Gbit/s as this one measured it, not measured again; OpenMP threads left as they are), its own
        messages, buffers and shared-memory windows, so that a collective on it may run beside one on this
        (from another thread, where ``MPI.Query_thread()`` is ``THREAD_MULTIPLE``). Collective."""
        self._usable("Dup")
        o = self._options
        return TorusComm(self.comm, self.dims, ranks_per_node=o.ranks_per_node or None,
                         segment_bytes=o.segment_bytes or None, check=o.check, timeout=o.timeout,
                         gpu_reduce=o.gpu_reduce, threads=None, link_gbits=self._link_gbits,
                         shm_phases=o.shm_phases)

    def Free(self) -> None:
        """Release the duplicated communicators (collective); any later call on this TorusComm is a
        TorusError."""
        self._usable("Free")
        self._released = True
        agreement.finish(self._announcements, self.rank, self._executor.timeout, "Free")
        self._shm.free()
        for transport in self._node_shm.values():
            transport.free()
        for c in (self.row_comm, self.col_comm, self.local_comm, self.cross_comm, self.comm):
            c.Free()

    def __repr__(self) -> str:
        X, Y = self.dims
        return f"TorusComm(rank={self.rank}, size={self.size}, dims={X}x{Y}, coords={self.coords})"
