"""The snapshots of one job and model on this node's storage: ``<directory>/<job_id>/step-<step>-<tag>.snap``
(``tag``: the CRC-32 of the model key, 8 hex digits), written in the background, the newest ``keep`` kept,
the newest complete one found again at start.

``directory``: the argument, else ``TORUS_SNAPSHOT_DIR``, else ``~/.cache/torus/snapshots``. Point it at
storage local to the node (a local disk, not a shared file system): every node's writer keeps its own copy,
so that any surviving node can resume the job. Writers that share one folder (a shared file system, or
emulated nodes on one machine) stay correct, only slower: each write is an atomic rename, and a file deleted
under another writer's listing is skipped.

A job folder may hold several models (keys, e.g. the models of successive ``fit`` calls of one script): each
store lists, loads, keeps and deletes the files of its own key only, so they never overwrite or prune each
other's, and a file is believed only once its header says the same job, key and step. The job's folder is a
cache: remove it when the job is done.
"""
from __future__ import annotations

import atexit
import os
import re
import socket
import warnings
import zlib
from pathlib import Path

from torus import knobs
from torus.snapshot import format
from torus.snapshot.background import LatestWins

DEFAULT_DIR = "~/.cache/torus/snapshots"
EXIT_FLUSH_S = 120.0  # at Python's exit, wait this long for the write in flight before abandoning it
_FINAL = re.compile(r"step-(\d+)-([0-9a-f]{8})\.snap")  # step, key tag
_TEMP = re.compile(r"\.step-\d+-[0-9a-f]{8}\.snap\.(.+)\.(\d+)\.tmp")  # format.write's temporary name: host, pid


class SnapshotSkipped(UserWarning):
    """A snapshot file that was not loaded: damaged, partial, or whose header names another job, key or step."""


class SnapshotStore:
    """Snapshots of job ``job_id`` (a folder name: non-empty, no ``/``) and model key ``key`` (any str, e.g. a
    digest of the model's variable names, shapes and dtypes) under ``directory`` (module docstring); the newest
    ``keep`` (>= 1) complete ones are kept. ValueError for a bad job id or ``keep``, TypeError for a key that
    is not a str. Makes nothing on disk until the first ``save_async``.

    One store per process, job and key; its methods are for one thread (the caller's), the writing happens on the
    store's own thread. A context manager: leaving it calls :meth:`close`."""

    def __init__(self, directory, job_id: str, key: str, keep: int = 2):
        if not isinstance(job_id, str) or not job_id or job_id in (".", "..") or "/" in job_id or "\0" in job_id:
            raise ValueError(f"SnapshotStore: job id {job_id!r} must be a folder name (non-empty, no '/')")
        if not isinstance(key, str):
            raise TypeError(f"SnapshotStore: model key must be a str, got {type(key).__name__}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"SnapshotStore: keep must be an int >= 1, got {keep!r}")
        root = directory if directory is not None else knobs.read("TORUS_SNAPSHOT_DIR") or DEFAULT_DIR
        self.folder = Path(root).expanduser() / job_id
        self.job_id, self.key, self.keep = job_id, key, keep
        self.tag = f"{zlib.crc32(key.encode()):08x}"
        self._writer = LatestWins(self._write, f"snapshot writer ({self.folder})")
        self._corrupt: set = set()  # files this process found damaged: deleted by the next prune
        self._started = False  # folder made, exit flush registered

    # -- writing -------------------------------------------------------------------------------------------

    def save_async(self, step: int, arrays: dict, meta: dict | None = None) -> None:
        """Write a snapshot of global step ``step`` (int >= 0) in the background and return at once.

        ``arrays``: name (str) -> numpy.ndarray, any shape and dtype but object/structured ones; ``meta``: a
        JSON-serialisable dict (None: ``{}``; int keys come back as str, tuples as lists). The caller has
        copied the arrays at a step boundary: from this call on the store owns them, and ``meta``, and the
        caller must not change them (they are read while being written, later). One write runs at a time; a
        snapshot handed over while one is written waits, and a newer one replaces it unwritten (latest wins:
        ``dropped`` counts those). After each write this key's snapshots beyond the newest ``keep`` are deleted.

        TypeError/ValueError here, on the caller's thread, for what cannot be stored; OSError when the folder
        cannot be made. A failed write (disk full...) is not raised: it warns (RuntimeWarning naming the
        folder and the error), is kept in ``errors``, and leaves the snapshots written before."""
        format.describe(self.job_id, self.key, step, arrays, {} if meta is None else meta)  # raises here
        if not self._started:
            self.folder.mkdir(parents=True, exist_ok=True)
            atexit.register(self._flush_at_exit)
            self._started = True
        self._writer.submit((int(step), dict(arrays), {} if meta is None else meta))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the write in flight and the one waiting are done, or ``timeout`` seconds (None: no
        limit). True when done."""
        return self._writer.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """:meth:`wait`, then stop the writer thread (later ``save_async`` calls raise RuntimeError). True when
        every snapshot handed over was written or dropped."""
        done = self._writer.close(timeout)
        if self._started:
            atexit.unregister(self._flush_at_exit)
        return done

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def dropped(self) -> int:
        """Snapshots replaced by a newer one before their write began."""
        return self._writer.dropped

    @property
    def errors(self) -> list:
        """The exceptions of failed writes, oldest first."""
        return self._writer.errors

    # -- reading -------------------------------------------------------------------------------------------

    def newest_complete(self) -> tuple[int, Path] | None:
        """``(step, path)`` of the newest snapshot of this job and key whose whole file verifies, or None.
        Newer files that do not (damaged, partial; a header that names another job, key or step) are skipped
        with one :class:`SnapshotSkipped` warning each, naming the file; they are never loaded. Reads every
        skipped file and the one returned; the files of other keys are not even opened."""
        found = self._newest()
        return None if found is None else (found[0].step, found[1])

    def load_newest(self) -> format.Snapshot | None:
        """The snapshot :meth:`newest_complete` names, verified and in memory (its arrays views into one
        buffer), or None."""
        found = self._newest()
        return None if found is None else found[0]

    def _newest(self) -> tuple[format.Snapshot, Path] | None:
        for step, path in sorted(self._finals(), reverse=True):
            try:
                snap = format.read(path)
            except FileNotFoundError:  # deleted by another writer since the listing
                continue
            except (format.SnapshotCorrupt, OSError) as e:  # OSError: unreadable (EIO, EACCES)
                if isinstance(e, format.SnapshotCorrupt):
                    self._corrupt.add(path)
                warnings.warn(f"{e}; skipped, not loaded", SnapshotSkipped, stacklevel=3)
                continue
            if (snap.job, snap.key, snap.step) != (self.job_id, self.key, step):
                warnings.warn(f"snapshot {path}: holds job {snap.job!r}, model key {snap.key!r}, step {snap.step}, "
                              f"not job {self.job_id!r}, key {self.key!r}, step {step}; skipped, not loaded",
                              SnapshotSkipped, stacklevel=3)
                continue
            return snap, path
        return None

    # -- the writer thread ---------------------------------------------------------------------------------

    def _write(self, item: tuple[int, dict, dict]) -> None:
        step, arrays, meta = item
        format.write(self.path(step), self.job_id, self.key, step, arrays, meta)
        self._prune()

    def _prune(self) -> None:
        """Keep the newest ``keep`` complete snapshots of this job and key; delete this key's other files
        older than the newest kept one (older snapshots, damaged ones), the files found damaged, and the
        temporary files of writers on this host that have died (any key's)."""
        kept: list[tuple[int, Path]] = []
        rest: list[tuple[int, Path]] = []
        for step, path in sorted(self._finals(), reverse=True):
            try:
                h = format.peek(path)
                ours = (h.job, h.key, h.step) == (self.job_id, self.key, step) and path not in self._corrupt
            except format.SnapshotCorrupt:
                ours = False
            except FileNotFoundError:
                continue
            (kept if ours and len(kept) < self.keep else rest).append((step, path))
        newest = kept[0][0] if kept else -1
        doomed = [p for s, p in rest if s < newest or p in self._corrupt]
        host = socket.gethostname()
        for p in self.folder.iterdir():
            m = _TEMP.fullmatch(p.name)
            if m and m[1] == host and not _alive(int(m[2])):
                doomed.append(p)
        for p in doomed:
            p.unlink(missing_ok=True)
            self._corrupt.discard(p)

    def path(self, step: int) -> Path:
        """The file of this key's snapshot of ``step``."""
        return self.folder / f"step-{step}-{self.tag}.snap"

    def _finals(self) -> list:
        """``(step, path)`` of every snapshot file of this key in the job folder."""
        if not self.folder.is_dir():
            return []
        return [(int(m[1]), p) for p in self.folder.iterdir()
                if (m := _FINAL.fullmatch(p.name)) and m[2] == self.tag]

    def _flush_at_exit(self) -> None:
        if not self._writer.wait(EXIT_FLUSH_S):
            warnings.warn(f"snapshot writer ({self.folder}): a write still runs after {EXIT_FLUSH_S:g} s at "
                          "exit; abandoned (the snapshots written before stay)", RuntimeWarning, stacklevel=1)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, and belongs to another user
        pass
    return True
