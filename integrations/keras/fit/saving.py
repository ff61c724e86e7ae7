"""``model.save`` / ``save_weights`` / ``export`` and ``keras.saving.save_model`` / ``save_weights`` under
TorusStrategy: called on every rank, the file is written once, by rank 0, atomically; called on rank 0 alone
(``if strategy.is_chief:``, Horovod's idiom), it is written there and nothing waits.

``compat.install()`` (called by ``TorusStrategy.__init__``, idempotent) wraps Keras' save entry points once per
process with ``coordinated`` (its rows of ``compat.PATCH_SITES``). ``Model.save`` and ``Model.save_weights`` reach
``saving_api.save_model`` / ``save_weights`` through that module's attributes, so they are covered with the
public functions; ``keras.saving.save_model`` and ``keras.models.save_model`` are the same function object,
rebound in both modules (a ``from keras.saving import save_model`` made before the strategy existed keeps the
plain one). Without a TorusStrategy in the process a model saves as plain Keras; with one, any model is coordinated.

For a model of a TorusStrategy:

- **Rank 0** runs Keras' own function on a hidden name beside the target (``.torus-<pid>-<name>``, so Keras'
  suffix checks see the same suffix), then ``os.replace``-s it onto the target: a reader sees the old file or
  the complete new one, never half of one. A directory (``export``'s SavedModel, ``zipped=False``) is swapped
  in by two renames (a reader may find no directory for a moment, never a half-written one). Errors, and what
  Keras prints, name the target, not the hidden name, as in one process; ``overwrite=False`` asks (Keras'
  prompt, on rank 0) about the target. Remote paths (``gs://``, ``hf://``, ...) and sharded weights
  (``max_shard_size``) are written in place, not atomically. Then rank 0 posts a *notice* to every other rank
  (one small non-blocking send per rank on a communicator of its own, made with the strategy): which function,
  which path, and its error if it raised. Rank 0 never waits for the other ranks, so a call on rank 0 alone
  returns like one process' call; its notices stay queued at the others (read and dropped at their exit).
- **Every other rank** writes nothing: it waits (bounded by the strategy's stall timeout) for rank 0's notice
  of the same call, then returns, or raises rank 0's error (the same built-in exception class,
  ``RuntimeError`` for other classes, its message naming rank 0 and the error), so every rank fails together
  and none hangs. When it returns, rank 0's file is in place: ``keras.models.load_model`` / ``load_weights`` on
  any rank (same host, or a shared filesystem) gets rank 0's values.

Which notice is "the same call" on the other ranks, and the failure modes chosen there: docs/design.md
("Saving on every rank").
"""
from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import inspect
import io
import json
import os
import shutil
import sys

import numpy as np
from mpi4py import MPI

from torus import faults
from torus.integrations.keras.collectives.loop import stall_timeout
from torus.integrations.keras.compat import file_utils, io_utils
from torus.integrations.keras.fit import alone, fit_hook

NOTICE_BYTES = 4096  # one notice: small enough for MPI's eager protocol, so rank 0's sends complete at once
_TAG = 7


@contextlib.contextmanager
def local(strategy):
    """Inside the block, saves of ``strategy``'s models run as plain Keras on this rank alone (``files.py``'s
    chief-only callbacks, and the saves Keras makes inside a coordinated one), and so does what Keras does inside
    them: variables created, random draws (``alone.rank_alone``)."""
    notices = strategy.save_notices
    notices.plain += 1
    try:
        with alone.rank_alone():
            yield
    finally:
        notices.plain -= 1


def atomic(write):
    """``write(path, ...)`` made atomic: ``write`` writes a hidden name beside ``path`` (same suffix, so Keras
    accepts it) that is then renamed onto ``path``; errors and printed text name ``path``, not the hidden one."""
    def atomic_write(filepath, *args, **kwargs):
        filepath = os.fspath(filepath)
        folder, name = os.path.split(os.path.normpath(filepath))  # "dir/" names dir
        tmp = os.path.join(folder, f".torus-{os.getpid()}-{name}")
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                result = write(tmp, *args, **kwargs)
            _publish(tmp, os.path.join(folder, name))
            return result
        except Exception as exc:
            _rename(exc, tmp, filepath)
            raise
        finally:
            sys.stdout.write(printed.getvalue().replace(tmp, filepath))
            for leftover in (tmp, tmp + ".old"):
                if os.path.isdir(leftover) and not os.path.islink(leftover):
                    shutil.rmtree(leftover, ignore_errors=True)
                elif os.path.lexists(leftover):
                    os.remove(leftover)
    return atomic_write


def _publish(tmp: str, filepath: str) -> None:
    if not os.path.isdir(tmp):
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, filepath)
        return
    if not (os.path.isdir(filepath) and not os.path.islink(filepath)):
        os.replace(tmp, filepath)
        return
    os.replace(filepath, tmp + ".old")  # a directory cannot replace a non-empty one in one rename
    try:
        os.replace(tmp, filepath)
    except BaseException:
        os.replace(tmp + ".old", filepath)
        raise


def _rename(exc: BaseException, tmp: str, filepath: str) -> None:
    exc.args = tuple(a.replace(tmp, filepath) if isinstance(a, str) else a for a in exc.args)
    for attr in ("strerror", "filename", "filename2"):  # what OSError's str() shows
        if isinstance(getattr(exc, attr, None), str):
            setattr(exc, attr, getattr(exc, attr).replace(tmp, filepath))


def count_start(call) -> None:
    """fit_hook stage "model": a fit / evaluate / predict starts, a boundary between the save windows of its
    strategy (counted per strategy: a strategy of some ranks only, e.g. on a sub-communicator, moves its own)."""
    _boundary(call)


def count_end(call, result):
    """fit_hook stage "result": it ended, another boundary."""
    _boundary(call)
    return result


def _boundary(call) -> None:
    call.strategy.save_notices.window += 1


class SaveNotices:
    """Rank 0's notices of its saves to the other ranks of ``torus_comm`` (see the module docstring).
    Collective to create (it duplicates the communicator): ``TorusStrategy.__init__`` makes one."""

    def __init__(self, torus_comm):
        self.torus_comm = torus_comm
        self.comm = torus_comm.comm.Dup()
        self._sent: list = []  # (buffer, request) of notices not yet known to be delivered
        self._held: dict | None = None  # a notice of a later window, read ahead
        self.window = 0  # fit / evaluate / predict starts and ends under this strategy so far
        self.plain = 0  # > 0: saves run as plain Keras (inside a coordinated save, or local())
        atexit.register(self._drain)  # before mpi4py's MPI_Finalize (atexit runs the later hooks first)

    def save(self, what: str, write, model, filepath, args: tuple, kwargs: dict, in_place: bool, overwrite: bool):
        """Run ``write(model, filepath, *args, **kwargs)`` the torus way: on rank 0 atomically (unless
        ``in_place``) then post a notice; elsewhere wait for rank 0's notice (or write for itself)."""
        path = os.fspath(filepath)
        rank = self.torus_comm.rank
        if rank != 0 and self._follow(what, path):
            return None
        try:
            if not overwrite and os.path.exists(path):
                if not io_utils.ask_to_proceed_with_overwrite(path):
                    self._post(what, path, None)
                    return None
            target = write if in_place else atomic(lambda tmp, *a, **k: write(model, tmp, *a, **k))
            result = target(model, path, *args, **kwargs) if in_place else target(path, *args, **kwargs)
        except BaseException as exc:
            self._post(what, path, exc)
            raise
        self._post(what, path, None)
        return result

    def _post(self, what: str, path: str, error: BaseException | None) -> None:
        if self.torus_comm.rank != 0 or self.torus_comm.size == 1:
            return
        reason = None if error is None else [type(error).__name__, str(error)]
        blob = json.dumps({"window": self.window, "what": what, "path": path, "error": reason}).encode()
        while len(blob) > NOTICE_BYTES and reason is not None and len(reason[1]) > 16:
            reason[1] = reason[1][:len(reason[1]) // 2] + " [...]"  # a long error message, cut
            blob = json.dumps({"window": self.window, "what": what, "path": path, "error": reason}).encode()
        if len(blob) > NOTICE_BYTES:
            raise ValueError(f"{what} on rank 0: a path of {len(path)} characters is too long to announce to the "
                             f"other ranks ({NOTICE_BYTES} bytes at most)")
        self._sent = [(b, r) for b, r in self._sent if not r.Test()]
        buf = np.frombuffer(blob, np.uint8).copy()
        for peer in range(1, self.torus_comm.size):
            self._sent.append((buf, self.comm.Isend([buf, MPI.BYTE], dest=peer, tag=_TAG)))

    def _next(self, what: str, path: str) -> dict:
        if self._held is not None:
            notice, self._held = self._held, None
            return notice
        buf = np.zeros(NOTICE_BYTES, np.uint8)  # JSON holds no NUL byte: the notice is what precedes them
        req = self.comm.Irecv([buf, MPI.BYTE], source=0, tag=_TAG)
        timeout, rank = stall_timeout(self.torus_comm), self.torus_comm.rank
        try:
            faults.wait(req, timeout, lambda: (
                f"{what} on rank {rank}: no notice from rank 0 for {timeout:g} s that it saved {path}: under "
                f"TorusStrategy call {what} with the same path on every rank (rank 0 writes it) or on rank 0 "
                "alone; rank 0 did neither, or is stuck or gone; abort the job"))
        except BaseException:
            req.Cancel()  # a later notice must not land in this abandoned buffer
            raise
        return json.loads(buf.tobytes().rstrip(b"\0"))

    def _drain(self) -> None:
        """At exit, on ranks other than 0: receive and drop the notices that arrived unread (saves rank 0 made
        alone), so ``MPI_Finalize`` finds no unreceived message (a warning there across hosts)."""
        if self.torus_comm.rank == 0 or MPI.Is_finalized():
            return
        buf = np.zeros(NOTICE_BYTES, np.uint8)
        while self.comm.Iprobe(source=0, tag=_TAG):
            self.comm.Recv([buf, MPI.BYTE], source=0, tag=_TAG)

    def _follow(self, what: str, path: str) -> bool:
        """On a rank other than 0: True once rank 0's notice of this save arrived (raising its error if it
        failed); False where this rank must write ``path`` itself."""
        while True:
            notice = self._next(what, path)
            if notice["window"] < self.window:
                continue  # a save rank 0 made alone, before the last fit / evaluate / predict boundary
            if notice["window"] > self.window:
                self._held = notice  # rank 0 made no save here: it belongs to a later one of ours
                return False
            if (notice["what"], notice["path"]) != (what, path):
                return False  # rank 0 saved another path here: per-rank paths, each writes its own
            if notice["error"] is not None:
                raise _remote_error(what, self.torus_comm.rank, path, *notice["error"])
            return True


def _remote_error(what: str, rank: int, path: str, name: str, text: str) -> BaseException:
    message = f"{what} on rank {rank}: rank 0 failed to write {path}: {name}: {text}"
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # a built-in that wants other arguments (UnicodeError's)
            pass
    return RuntimeError(message)


def coordinated(original, what: str):
    """``original`` (a Keras save entry point, shown as ``what``) written once by rank 0 (the module docstring)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(model, filepath, *args, **kwargs):
        # The model's own TorusStrategy, else the process' (a model built outside the scope and not fit yet:
        # every rank would write the same file at once)
        strategy = fit_hook.strategy_of(model, adopting=True) if hasattr(model, "distribute_strategy") else None
        if strategy is None or strategy.save_notices.plain or not isinstance(filepath, (str, os.PathLike)):
            return original(model, filepath, *args, **kwargs)
        try:
            bound = signature.bind(model, filepath, *args, **kwargs).arguments
        except TypeError:  # Keras' own TypeError, on every rank
            return original(model, filepath, *args, **kwargs)
        overwrite = bool(bound.get("overwrite", True))  # Keras' default
        path = os.fspath(filepath)
        if not isinstance(path, str):  # a bytes path: left to Keras
            return original(model, filepath, *args, **kwargs)
        in_place = (file_utils.is_remote_path(path) or path.startswith("hf://")
                    or bound.get("max_shard_size") is not None)
        with local(strategy):
            return strategy.save_notices.save(what, original, model, filepath, args, kwargs, in_place, overwrite)

    return wrapper


