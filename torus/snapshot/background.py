"""One background thread that runs a job for the newest item handed to it: at most one job in flight and one
waiting; an item handed over while one waits replaces it (latest wins), so a slow disk delays snapshots and
drops stale ones, never queues them, and the memory held stays at two items.

The thread is a daemon started at the first ``submit``, at nice +``NICE`` (Linux: the thread's own priority,
lowered, which needs no privilege), so that it takes the CPU only when training leaves it. A job that raises
does not stop the thread: the error is kept in ``errors`` and reported with ``warnings.warn``.
"""
from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

NICE = 10


class LatestWins:
    """Run ``job(item)`` on a background thread for the newest of the items given to :meth:`submit`.

    ``name``: the thread's name, and the prefix of the warning for a job that raised."""

    def __init__(self, job: Callable[[Any], None], name: str):
        self._job, self._name = job, name
        self._lock = threading.Condition()
        self._waiting: Any = None  # the next item, or None
        self._busy = False  # a job is running
        self._closed = False
        self._thread: threading.Thread | None = None
        self.dropped = 0  # items replaced before their job ran
        self.errors: list[BaseException] = []  # what jobs raised, oldest first

    def submit(self, item) -> None:
        """Hand over ``item`` (not None): its job runs after the one in flight, unless a newer item comes first
        (then ``item`` is dropped). Returns at once. RuntimeError after :meth:`close`."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: closed")
            if self._waiting is not None:
                self.dropped += 1
            self._waiting = item
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no job runs and none waits, or ``timeout`` seconds (None: no limit). True when idle."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._busy and self._waiting is None, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """:meth:`wait`, then stop the thread; later ``submit`` calls raise. True when everything ran."""
        idle = self.wait(timeout)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        return idle

    def _run(self) -> None:
        try:  # Linux: this thread only; elsewhere PRIO_PROCESS would mean the whole process, so skip
            if hasattr(threading, "get_native_id") and os.uname().sysname == "Linux":
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except OSError:
            pass  # keep the priority it has
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._waiting is not None or self._closed)
                if self._waiting is None:
                    return  # closed and idle
                item, self._waiting, self._busy = self._waiting, None, True
            try:
                self._job(item)
            except Exception as e:  # reported, and the thread goes on with the next item
                self.errors.append(e)
                warnings.warn(f"{self._name}: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=1)
            finally:
                item = None  # drop the arrays now, not when the next item comes
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()
