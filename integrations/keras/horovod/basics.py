"""Process layout for the Horovod-compatible API: ``init``, ``rank``, ``size``, ``local_*``, ``cross_*``.

One ``torus.TorusComm`` per process, built by ``init()`` over ``MPI.COMM_WORLD`` (or the communicator given);
every other call of the API uses it. Horovod's "local" ranks are those on the same node
(``MPI.COMM_TYPE_SHARED``, or ``TORUS_RANKS_PER_NODE`` emulated nodes); "cross" ranks are those with the same
local rank on every node, so ``cross_rank()`` is the node index and ``cross_size()`` the number of nodes on
regular layouts (``TorusComm.cross_comm``).
"""
from __future__ import annotations

from mpi4py import MPI

from torus import TorusComm

_torus_comm: TorusComm | None = None


def init(comm=None) -> None:
    """Start the API over ``comm`` (an ``mpi4py.MPI.Intracomm``; default ``MPI.COMM_WORLD``). Collective: every
    rank of ``comm`` calls it. A second call is a no-op, as in Horovod. Horovod's list-of-ranks form and
    process sets are not supported: ``TypeError``."""
    global _torus_comm
    if _torus_comm is not None:
        return
    if comm is not None and not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"hvd.init: comm must be an mpi4py.MPI.Intracomm or None, got {type(comm).__name__} "
                        "(lists of ranks and process sets are not supported)")
    _torus_comm = TorusComm(comm)


def shutdown() -> None:
    """Forget the communicator (``init()`` may be called again); frees torus' working buffers."""
    global _torus_comm
    if _torus_comm is not None:
        _torus_comm.free_buffers()
    _torus_comm = None


def is_initialized() -> bool:
    return _torus_comm is not None


def torus_comm() -> TorusComm:
    """The ``TorusComm`` behind the API; ``ValueError`` before ``init()``."""
    if _torus_comm is None:
        raise ValueError(f"torus.integrations.keras.horovod on rank {MPI.COMM_WORLD.Get_rank()}: "
                         "not initialized; call hvd.init() first")
    return _torus_comm


def rank() -> int:
    """This process' rank in the communicator given to ``init``."""
    return torus_comm().rank


def size() -> int:
    """The number of processes."""
    return torus_comm().size


def local_rank() -> int:
    """This process' rank among the processes on its node (e.g. the GPU index to pin)."""
    return torus_comm().local_rank


def local_size() -> int:
    """The number of processes on this node."""
    return torus_comm().local_size


def cross_rank() -> int:
    """This process' rank among the processes with its local rank (its node's index on regular layouts)."""
    return torus_comm().cross_comm.Get_rank()


def cross_size() -> int:
    """The number of processes with this local rank (the number of nodes on regular layouts)."""
    return torus_comm().cross_comm.Get_size()
