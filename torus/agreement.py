"""The per-call argument check across ranks: every rank all-gathers a small signature of its call
(collective, op, dtype, count, algorithm, segment size, grid, a checksum of recvcounts, whether the
node-level phases run over shared memory) and all raise the same
``MismatchError`` when any differ, instead of hanging or summing garbage (recvcounts that differ are then
all-gathered too, to name them).

Cost: one 10 x int64 ``MPI_Iallgather`` per call, waited for with the stall timeout (so a rank that never calls
turns into ``TimeoutError`` before the first data message); about one small-collective latency
(bench/torus_bench/README.md has the measured figures). ``check=False`` / ``TORUS_CHECK=0`` skips it.

A rank whose own arguments fail their local check raises its ValueError/TypeError at once and posts its share
of the all-gather marked "argument error" (``reports_errors``), so the others raise MismatchError naming it;
that posted all-gather is completed at the TorusComm's next call.

Shared-memory calls (``algorithm="shm"``, which ``auto`` picks on one node) skip this all-gather once the
window is open: the signature rides in every step's header there, and an argument error is announced in it
(torus/runtime/shm.py says what that catches and misses). That is what keeps the check off a 64 KiB call's
critical path.

Not caught: anything with the check off (ranks that disagree then hang until the stall timeout, fail in MPI
with a truncation error, or silently combine mismatched data); a rank that never calls or died (the others get
TimeoutError after ``timeout`` s); differing buffer contents; ranks calling collectives on different
TorusComm objects in different orders (also a timeout).
"""
from __future__ import annotations

import functools
import zlib

import numpy as np

from torus import faults
from torus.errors import MismatchError
from torus.ops import DTYPE_CODE, OPS
from torus.schedules import registry

# The calls a signature row can name (alloc and free_alloc agree in the same row layout, torus/runtime/shm.py,
# so that a rank in another call's argument check sees the difference as one in "collective").
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "alloc", "free_alloc")
SIGNATURE = ("collective", "op", "dtype", "count", "algorithm", "segment_bytes", "grid", "recvcounts",
             "shm phases", "argument error")
_COUNTS = SIGNATURE.index("recvcounts")  # a crc32 of them: named by a second all-gather when they differ
_ERROR = len(SIGNATURE) - 1  # the field that says "this rank rejected its own arguments"
DTYPE_NAMES = tuple(str(d) for d in DTYPE_CODE)  # a "dtype" field's value -> its name


class PeerRejected(MismatchError):
    """Some rank rejected its own arguments to this call (raised on the others; that rank raised its
    ValueError/TypeError)."""


def ranks_text(ranks: list) -> str:
    """``[0, 1, 2, 5]`` -> ``'ranks 0-2, 5'``: short at any scale."""
    runs, lo = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append(str(lo) if lo == a else f"{lo}-{a}")
            lo = b
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def reports_errors(method):
    """Make a TorusComm collective whose arguments fail their local check tell the other ranks (with
    ``check`` on): the error is raised here at once, and this rank's share of the signature all-gather is
    posted marked "argument error" unless the agreement itself was under way."""
    what = method.__name__

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self._agreeing = False
        try:
            return method(self, *args, **kwargs)
        except (ValueError, TypeError):
            if not self._agreeing:
                if self.check:
                    self._announcements.append(announce(self.comm, self.size, what))
                self._shm.announce_error(self.check)  # for peers whose call runs unchecked over shm
            raise
    return wrapper


def texts_that_differ(comm, text: str, timeout, stalled) -> tuple[list[int], list[str]]:
    """Compare ``text`` (a short description of what this rank is about to do) across the ranks of ``comm``:
    one ``MPI_Iallgather`` of its crc32, waited at most ``timeout`` s without progress (else
    ``torus.errors.TimeoutError`` with the message ``stalled()``). Returns the ranks whose text differs from
    rank 0's and, where there are any, every rank's text (a second all-gather: every rank is here then and
    saw the same difference), else ``[]``. Collective."""
    mine = np.array([zlib.crc32(text.encode())], np.int64)
    every = np.empty(comm.Get_size(), np.int64)
    faults.wait(comm.Iallgather(mine, every), timeout, stalled)
    differ = [r for r in range(every.size) if every[r] != every[0]]
    return differ, (comm.allgather(text) if differ else [])


def announce(comm, size: int, what: str) -> tuple:
    """Post this rank's "argument error" signature; not waited for (see ``finish``)."""
    mine = np.full(len(SIGNATURE), -1, np.int64)
    mine[0], mine[_ERROR] = COLLECTIVES.index(what), 1
    every = np.empty((size, mine.size), np.int64)
    return comm.Iallgather(mine, every), mine, every


def finish(pending: list, rank: int, timeout, what: str) -> None:
    """Complete earlier announcements (``pending``, emptied) before the next all-gather on the communicator."""
    while pending:
        req = pending.pop(0)[0]
        faults.wait(req, timeout, lambda: (
            f"{what} on rank {rank}: no progress for {timeout:g} s completing the report of this rank's "
            "earlier argument error: some rank never made that call; abort the job"))


def join(comm, rank: int, size: int, timeout, what: str) -> None:
    """Complete, from a rank that learnt of it another way (the shared-memory header), the all-gather that a
    rank posted with its argument error (``announce``), so that every rank's next all-gather matches."""
    mine = np.full(len(SIGNATURE), -1, np.int64)
    every = np.empty((size, mine.size), np.int64)
    faults.wait(comm.Iallgather(mine, every), timeout, lambda: (
        f"{what} on rank {rank}: no progress for {timeout:g} s collecting a peer's argument-error report; "
        "abort the job"))


def signature(what: str, algo: str, op: str, dt, count: int, recvcounts, segment_bytes: int, X: int,
              phased: bool = False) -> np.ndarray:
    """This call's signature (one int64 per ``SIGNATURE`` field), the row ``agree`` all-gathers; ``phased``:
    its node-level phases run over shared memory (torus/schedules/phases.py). A pure function of the call's
    shape, so TorusComm keeps it per shape instead of rebuilding it every call."""
    crc = zlib.crc32(np.asarray(recvcounts, np.int64).tobytes()) if recvcounts is not None else 0
    return np.array([COLLECTIVES.index(what), OPS.index(op), DTYPE_CODE[dt], count, registry.index(algo),
                     segment_bytes, X, crc, int(phased), 0], np.int64)


def agree(comm, rank: int, size: int, timeout, what: str, algo: str, mine: np.ndarray, recvcounts=None) -> None:
    """All-gather this call's signature ``mine``; raise MismatchError (the same on every rank) if any rank
    differs or rejected its own arguments, TimeoutError when some rank never joins within ``timeout`` s.
    ``recvcounts``: this call's per-rank blocks (``size`` counts; None for an all-reduce): when ranks in the
    same collective differ there (the signature holds only a crc32), a second all-gather, on that failing
    path only, collects them to name them."""
    every = np.empty((size, mine.size), np.int64)
    faults.wait(comm.Iallgather(mine, every), timeout, lambda: (
        f"{what}({algo}) on rank {rank}: no progress for {timeout:g} s in the argument check (the all-gather "
        f"of every rank's call signature): some rank did not call {what}, died or is stuck; the communicator "
        "is unusable now, abort the job"))
    if every.tobytes() == mine.tobytes() * size:  # the common case in one comparison (an error row differs)
        return
    failed = np.nonzero(every[:, _ERROR])[0]
    if failed.size:
        whose = "its" if failed.size == 1 else "their"
        raise PeerRejected(f"{what}({algo}) on rank {rank}: {ranks_text([int(r) for r in failed])} rejected "
                            f"{whose} own arguments to this call (see the error there); no data was moved")
    decode = {0: COLLECTIVES.__getitem__, 1: OPS.__getitem__, 2: DTYPE_NAMES.__getitem__,
              4: registry.names().__getitem__, 6: lambda x: f"{x}x{size // x}"}
    fields = {f: (name, decode.get(f, str)) for f, name in enumerate(SIGNATURE) if f != _COUNTS}
    parts = disagreements(every, fields)
    # Every rank sees ``every``, so all take this branch or none (not alloc's agreement: another collective).
    if (every[:, 0] == every[0, 0]).all() and (every[:, _COUNTS] != every[0, _COUNTS]).any():
        parts.append(_recvcounts_text(comm, rank, size, timeout, what, algo, recvcounts))
    if parts:
        raise MismatchError(f"{what}({algo}) on rank {rank}: ranks disagree on " + ", ".join(parts))


def _recvcounts_text(comm, rank: int, size: int, timeout, what: str, algo: str, recvcounts) -> str:
    """``"recvcounts (rank 0 has [2, 2]; rank 1 has [1, 3])"``, from an all-gather of every rank's."""
    mine = np.full(size, -1, np.int64) if recvcounts is None else np.asarray(recvcounts, np.int64)
    every = np.empty((size, size), np.int64)
    faults.wait(comm.Iallgather(mine, every), timeout, lambda: (
        f"{what}({algo}) on rank {rank}: no progress for {timeout:g} s collecting every rank's recvcounts "
        "after they disagreed; abort the job"))
    groups: dict = {}
    for r, row in enumerate(every):
        groups.setdefault(tuple(int(c) for c in row), []).append(r)
    shown = "; ".join(f"{ranks_text(rs)} {'has' if len(rs) == 1 else 'have'} "
                      f"{'none (an all-reduce)' if min(v) < 0 else list(v)}" for v, rs in groups.items())
    return f"recvcounts ({shown})"


def disagreements(every: np.ndarray, fields: dict) -> list:
    """``"name (rank 0 has x; ranks 1-2 have y)"`` for each column ``f`` of ``every`` (one row per rank) in
    ``fields`` (``f -> (name, decode)``, ``decode`` turning a value into its text) where the ranks differ."""
    parts = []
    for f in np.nonzero((every != every[0]).any(axis=0))[0]:
        if int(f) not in fields:
            continue
        name, decode = fields[int(f)]
        groups: dict = {}
        for r, v in enumerate(every[:, f]):
            groups.setdefault(int(v), []).append(r)
        shown = "; ".join(f"{ranks_text(rs)} {'has' if len(rs) == 1 else 'have'} {decode(v)}"
                          for v, rs in groups.items())
        parts.append(f"{name} ({shown})")
    return parts
