"""TorusComm's settings, resolved once per rank: its arguments, their ``TORUS_*`` environment defaults, and the
node layout the grid, the segment size and ``auto`` depend on.

Everything here is checked on the calling rank before any message (ValueError naming the rank), except
``discover``, which is collective (every rank of ``comm`` calls it).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from mpi4py import MPI

from torus import knobs, link
from torus.topology import Topology, node_dims, node_indices

SEGMENT_BYTES = 1 << 20
# Across nodes: on emulated hosts 1 MiB and 512 KiB segments moved at a fraction of the link's rate and
# 256 KiB ones at its rate (bench/across_hosts/README.md; put down to UCX's rendezvous over TCP then). Those
# runs gave each rank every core of the shared machine; with the cores split among its ranks (TorusComm's
# threads="auto" now), 512 KiB segments ran at the link's rate too (bench/wire/README.md), so the slowdown
# was likely the kernels' parallel regions. 256 KiB is kept: not re-measured.
CROSS_NODE_SEGMENT_BYTES = 256 << 10


@dataclass(frozen=True)
class Options:
    dims: tuple | None  # (X, Y) as given, checked against the size; None: chosen by ``discover``
    segment_bytes: int  # 0: the default for the node layout (``segment_for``)
    check: bool
    timeout: float | None  # None waits forever
    gpu_reduce: bool | None
    link_gbits: float | None  # told; None: measured across real nodes
    ranks_per_node: int  # 0: the real nodes
    shm_phases: bool  # across nodes, run the node-level phases over shared memory (torus/schedules/phases.py)

    def segment_for(self, topology: Topology) -> int:
        if self.segment_bytes:
            return self.segment_bytes
        return CROSS_NODE_SEGMENT_BYTES if topology.nodes > 1 else SEGMENT_BYTES


def launched_alone() -> None:
    """``RuntimeError`` where ``srun`` started several tasks but MPI sees each as a world of one: the MPI library
    did not reach Slurm's process manager (PMI), and every task would run, and train, alone (Open MPI 5 under
    ``srun --mpi=pmi2``, ompi#13523; an MPI built without Slurm's PMI). Local: no communication."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if tasks.isdigit() and int(tasks) > 1 and MPI.COMM_WORLD.Get_size() == 1:
        raise RuntimeError(
            f"TorusComm: srun started {tasks} tasks, but MPI sees a world of 1 rank in task "
            f"{os.environ.get('SLURM_PROCID', '?')}: this MPI library did not connect to Slurm's PMI, so every "
            f"task would run alone. Launch with mpiexec inside the allocation (mpiexec -n {tasks} ...), or pass "
            "srun the --mpi plugin this MPI was built for (srun --mpi=list shows Slurm's)")


def resolve(rank: int, size: int, dims, segment_bytes, check, timeout, gpu_reduce, link_gbits,
            ranks_per_node, shm_phases=None) -> Options:
    """The arguments of ``TorusComm(...)`` with their environment defaults (see its docstring)."""
    if dims is not None:
        if len(dims) != 2:
            raise ValueError(f"TorusComm on rank {rank}: dims {tuple(dims)} must be two numbers (X, Y)")
        X, Y = (int(d) for d in dims)
        if X < 1 or Y < 1:
            raise ValueError(f"TorusComm on rank {rank}: dims {X}x{Y} must both be at least 1")
        if X * Y != size:
            raise ValueError(f"TorusComm on rank {rank}: dims {X}x{Y} do not multiply to the communicator "
                             f"size {size}")
        dims = (X, Y)
    seg = int(segment_bytes or knobs.read("TORUS_SEGMENT_BYTES"))
    if seg and not 1 <= seg < 1 << 31:
        raise ValueError(f"TorusComm on rank {rank}: segment_bytes {seg} outside [1, 2**31)")
    if timeout is not None and timeout < 0:
        timeout = knobs.read("TORUS_TIMEOUT")
    if gpu_reduce is None:
        gpu_reduce = knobs.read("TORUS_GPU_REDUCE")
    try:
        told = link.told(link_gbits)
    except ValueError as e:
        raise ValueError(f"TorusComm on rank {rank}: {e}") from None
    return Options(dims, seg, knobs.read("TORUS_CHECK") if check is None else bool(check),
                   timeout or None, None if gpu_reduce is None else bool(gpu_reduce), told,
                   int(ranks_per_node or knobs.read("TORUS_RANKS_PER_NODE")),
                   knobs.read("TORUS_SHM_PHASES") if shm_phases is None else bool(shm_phases))


def discover(comm: MPI.Intracomm, options: Options) -> Topology:
    """This rank's Topology: the nodes (emulated by ``ranks_per_node``, else the ranks sharing memory, each
    node known by its lowest rank) and the grid (as given; else one axis along equal real nodes where their
    placement has one, ``topology.node_dims``, else ``MPI.Compute_dims``'s squarest). Collective."""
    rank, size, rpn = comm.Get_rank(), comm.Get_size(), options.ranks_per_node
    if rpn:
        node_of = tuple(r // rpn for r in range(size))
    else:
        shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        lowest = shared.allreduce(rank, op=MPI.MIN)
        shared.Free()
        node_of = node_indices(comm.allgather(lowest))
    dims = options.dims
    if dims is None:
        Y, X = MPI.Compute_dims(size, 2)  # Compute_dims sorts descending; rows are the shorter side
        dims = (not rpn and node_dims(node_of)) or (X, Y)
    return Topology(rank, size, dims, node_of)


def machine_ranks(comm: MPI.Comm) -> int:
    """The ranks of ``comm`` on this rank's machine, by host name: more than its node's where nodes share a
    machine (hosts emulated by network namespaces share one machine and its name, as do ``ranks_per_node``'s
    nodes). Collective."""
    names = comm.allgather(socket.gethostname())
    return names.count(names[comm.Get_rank()])


def node_memory(comm: MPI.Comm, local: MPI.Comm, topology: Topology, emulated: bool, ranks: int) -> int | None:
    """For the shared-memory phases across nodes: ``ranks``, the ranks on this rank's machine
    (``machine_ranks``, what the transport's spin rule counts), or None where some node's ranks do not all
    share memory (emulated nodes larger than the machines they run on), so that no rank runs them. ``local``:
    this rank's node communicator. Collective; real nodes are ranks sharing memory by definition."""
    if not emulated:
        return ranks
    node = local.Split_type(MPI.COMM_TYPE_SHARED, key=local.Get_rank())
    shared = node.Get_size() == local.Get_size()
    node.Free()
    return ranks if comm.allreduce(shared, op=MPI.LAND) else None
