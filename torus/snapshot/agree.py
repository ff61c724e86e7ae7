"""Resuming from the newest snapshot any rank holds, and who writes snapshots: one rank per node.

:func:`agree_newest`, collective, bounded by ``timeout`` at every wait (``faults.wait``: a rank that never
calls, died or is stuck turns into torus.errors.TimeoutError on the others):

1. every rank finds the newest snapshot of its store's job and key that verifies (``SnapshotStore.load_newest``:
   damaged or partial files skipped with a warning, an unreadable folder counts as none), reading it whole;
2. one ``MPI_Iallgather`` of a fixed record per rank: holds one?, its step, CRC-32s of the store's job id and
   model key (ranks that differ there raise MismatchError, all of them), the file's CRC-32 and length;
3. the newest step held anywhere wins; the lowest rank holding it sends the whole file (``MPI_Ibcast`` in
   chunks of ``CHUNK_BYTES``, below MPI's 2 GiB count limit), its length already known from the record;
4. every other rank verifies what it received (the file's own checksum, the CRC-32 and job, key and step the
   sender announced), and one more all-gather of a pass/fail flag makes a failure on any rank raise
   SnapshotCorrupt on every rank: nothing is loaded anywhere.

Every rank then returns the same ``(step, arrays, meta)``, bitwise, or None when no rank holds a snapshot. The
messages run on a duplicate of ``comm`` (``MPI_Comm_idup``), so that nothing the caller left pending on
``comm`` can match them.

Every rank sends or receives the whole file, even one whose own newest copy is the same: one broadcast,
simpler than working out who lacks it. Every rank of a node reads the node's newest file in step 1.
"""
from __future__ import annotations

import warnings
import zlib

import numpy as np
from mpi4py import MPI

from torus import faults, knobs, options
from torus.agreement import disagreements, ranks_text
from torus.comm import TorusComm
from torus.errors import MismatchError
from torus.snapshot import format
from torus.snapshot.store import SnapshotSkipped, SnapshotStore

RECORD = ("holds", "step", "job", "key", "crc", "nbytes")  # one int64 each, per rank
CHUNK_BYTES = 1 << 30  # bytes per broadcast message


def node_writer(comm, ranks_per_node: int | None = None) -> bool:
    """True on exactly one rank per node (local rank 0), the one that writes the node's snapshots; False on
    the others, which may still read them.

    ``comm``: a TorusComm (its own nodes; no messages) or an ``mpi4py.MPI.Intracomm`` (collective: nodes of
    ``ranks_per_node`` consecutive ranks, default ``TORUS_RANKS_PER_NODE``, else the ranks sharing memory,
    ``MPI.COMM_TYPE_SHARED``; ``torus.options.discover``, as TorusComm finds them; MPI's blocking calls, no
    timeout). ValueError for ``ranks_per_node`` with a TorusComm."""
    if isinstance(comm, TorusComm):
        if ranks_per_node is not None:
            raise ValueError("node_writer: ranks_per_node is for an mpi4py communicator; a TorusComm has its "
                             "nodes (TorusComm(ranks_per_node=...))")
        return comm.local_rank == 0
    rpn = int(ranks_per_node or knobs.read("TORUS_RANKS_PER_NODE"))
    layout = options.Options(dims=None, segment_bytes=0, check=False, timeout=None, gpu_reduce=None,
                             link_gbits=None, ranks_per_node=rpn, shm_phases=False)
    return options.discover(comm, layout).local_rank == 0


def agree_newest(comm, store: SnapshotStore, timeout: float | None) -> tuple[int, dict, dict] | None:
    """The newest complete snapshot that any rank of ``comm`` holds in its ``store`` (module docstring), as
    ``(step, arrays, meta)``: the global step (int), name -> ndarray (the shapes and dtypes written; views
    into one writable buffer per rank), the meta dict. None on every rank when no rank holds one.

    ``comm``: an ``mpi4py.MPI.Intracomm`` or a TorusComm; collective over it. ``store``: this rank's
    SnapshotStore; every rank's must have the same job id and model key. ``timeout``: seconds without
    progress at each wait (None: wait forever).

    Raises on every rank: MismatchError when the ranks' stores differ in job id or key; SnapshotCorrupt (a
    ValueError) when the received bytes fail their check on any rank. torus.errors.TimeoutError (on the ranks
    that called) when some rank does not take part within ``timeout``. Warns (``SnapshotSkipped``) for each
    file skipped in this rank's store."""
    base = comm.comm if isinstance(comm, TorusComm) else comm
    rank, size = base.Get_rank(), base.Get_size()
    job, key = store.job_id, store.key

    def stalled(doing):
        return lambda: (f"agree_newest on rank {rank}: no progress for {timeout:g} s {doing}: some rank did not "
                        "call agree_newest, died or is stuck; the communicator is unusable now, abort the job")

    try:
        mine = store.load_newest()
    except OSError as e:  # this node's folder unreadable: the others may still hold one
        warnings.warn(f"agree_newest on rank {rank}: cannot list {store.folder} ({e}); this rank holds none",
                      SnapshotSkipped, stacklevel=2)
        mine = None
    dup, req = base.Idup()
    faults.wait(req, timeout, stalled("duplicating the communicator"))
    # 1. who holds what
    record = np.array([mine is not None, mine.step if mine else -1, _crc(job), _crc(key),
                       mine.crc if mine else 0, mine.buffer.size if mine else 0], np.int64)
    every = np.empty((size, len(RECORD)), np.int64)
    faults.wait(dup.Iallgather(record, every), timeout, stalled("exchanging which snapshot each rank holds"))
    _same_store(dup, every, rank, job, key)
    holds = every[:, 0] == 1
    if not holds.any():
        dup.Free()
        return None
    # 2. the newest, from its lowest holder
    step = int(every[holds, 1].max())
    root = int(np.flatnonzero(holds & (every[:, 1] == step))[0])
    crc, nbytes = int(every[root, 4]), int(every[root, 5])
    if rank == root:
        assert mine is not None
        buffer = mine.buffer
    else:
        mine, buffer = None, np.empty(nbytes, np.uint8)  # drop this rank's older copy first
    for start in range(0, nbytes, CHUNK_BYTES):
        faults.wait(dup.Ibcast(buffer[start:start + CHUNK_BYTES], root=root), timeout,
                    stalled(f"receiving bytes {start}-{min(start + CHUNK_BYTES, nbytes)} of {nbytes} of the "
                            f"step {step} snapshot from rank {root}"))
    # 3. every receiver checks it; a failure anywhere fails everywhere
    source, problem = f"of step {step} sent by rank {root}", ""
    if rank != root:
        try:
            mine = format.parse(buffer, source)
            if (mine.crc, mine.job, mine.key, mine.step) != (crc, job, key, step):
                problem = (f"received CRC-32 {mine.crc:#010x}, job {mine.job!r}, key {mine.key!r}, step "
                           f"{mine.step}; rank {root} announced {crc:#010x}, {job!r}, {key!r}, {step}")
        except format.SnapshotCorrupt as e:
            problem = e.reason
    failed = np.empty(size, np.int64)
    faults.wait(dup.Iallgather(np.array([bool(problem)], np.int64), failed), timeout,
                stalled("comparing every rank's check of the received snapshot"))
    dup.Free()
    if failed.any():
        where = ranks_text([int(r) for r in np.flatnonzero(failed)])
        here = f" (here: {problem})" if problem else ""
        raise format.SnapshotCorrupt(source, f"failed its check on {where}{here}; not loaded on any rank")
    assert mine is not None
    return mine.step, mine.arrays, mine.meta


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _same_store(dup: MPI.Intracomm, every: np.ndarray, rank: int, job: str, key: str) -> None:
    """MismatchError, on every rank, when the ranks look for different jobs or model keys (their names
    all-gathered to say which; every rank sees the same records, so all take this path or none)."""
    columns = [RECORD.index("job"), RECORD.index("key")]
    if (every[:, columns] == every[0, columns]).all():
        return
    names = dup.allgather((job, key))
    decode = {c: {_crc(n[i]): repr(n[i]) for n in names}.__getitem__ for i, c in enumerate(columns)}
    parts = disagreements(every, {columns[0]: ("the job id", decode[columns[0]]),
                                  columns[1]: ("the model key", decode[columns[1]])})
    dup.Free()
    raise MismatchError(f"agree_newest on rank {rank}: ranks disagree on {', '.join(parts)}: every rank must "
                        "resume the same model under the same job id")
