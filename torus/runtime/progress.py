"""One communication thread per ``TorusComm``: collectives handed to it run one at a time, in the order they
were submitted, while the submitting thread goes on (the gradient buckets of ``torus.integrations.keras``).

Contract:

- ``submit(fn)`` queues ``fn`` and returns a ``concurrent.futures.Future``; ``call(fn)`` runs it and returns
  its result: inline while the thread has never been started, else through the queue (so a collective of the
  same ``TorusComm`` never runs beside a queued one). Every rank must submit the same collectives in the same
  order, as for blocking calls: the order is the submitters', never the peers' readiness.
- A job that raises fails its future with that exception; the jobs queued before the failure was seen fail
  at once with ``TorusError`` naming the first one (they would wait on peers that have given up), so a stall
  costs one stall timeout, not one per queued job. Jobs submitted afterwards run normally.
- The thread is a daemon. At Python's exit (before ``MPI_Finalize``: registered after mpi4py's handler) it
  is stopped after its current job; queued jobs are failed, never left to block the exit. A job is bounded
  by the communicator's stall timeout like any collective.

The thread asks for a higher CPU priority (``nice`` ``TORUS_COMM_NICE``, default -10; Linux, where the process
may: root or CAP_SYS_NICE; otherwise it keeps its priority) and its long MPI waits sleep ``TORUS_COMM_POLL_US``
(default 200) microseconds between tests (``poll_pause``, read by the C step loop) instead of spinning: beside
TensorFlow's compute threads on every core, a spinning waiter either holds a core compute needs (at high
priority) or gets the CPU too late to keep the link busy (at equal priority); sleeping at high priority wakes
as data arrives and leaves the cores to compute in between (bench/overlap/README.md, "Overlap").

MPI must allow calls from a second thread (``MPI.Query_thread() >= MPI.THREAD_SERIALIZED``; ``threads_ok``);
callers fall back to blocking calls where it does not.
"""
from __future__ import annotations

import atexit
import itertools
import os
import queue
import threading
import weakref
from concurrent.futures import Future

from mpi4py import MPI

from torus import knobs
from torus.errors import TorusError

_all: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # TorusComm -> Progress
_lock = threading.Lock()


_local = threading.local()


def poll_pause() -> float:
    """Seconds a long MPI wait on the calling thread sleeps between tests: ``TORUS_COMM_POLL_US`` on a
    communication thread, 0 (yield only) elsewhere."""
    return getattr(_local, "pause", 0.0)


def _settings() -> tuple[int, float]:
    nice, pause_us = knobs.read("TORUS_COMM_NICE"), knobs.read("TORUS_COMM_POLL_US")
    if not 0 <= pause_us < 1e6:
        raise ValueError(f"TORUS_COMM_POLL_US={pause_us:g}: expected 0 to 999999 microseconds")
    return nice, pause_us * 1e-6


def threads_ok() -> bool:
    """Whether the MPI library lets a second thread make MPI calls (one at a time)."""
    return MPI.Query_thread() >= MPI.THREAD_SERIALIZED


def progress_for(torus_comm) -> Progress:
    """The one ``Progress`` of ``torus_comm`` (made on first use; the thread starts on the first submit)."""
    with _lock:
        found = _all.get(torus_comm)
        if found is None:
            found = _all[torus_comm] = Progress(f"torus-comm-r{torus_comm.rank}")
        return found


class Progress:
    """A FIFO of collectives run on one thread; see the module docstring."""

    def __init__(self, name: str = "torus-comm"):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._submitted = itertools.count()
        self._failed: tuple[int, BaseException] | None = None  # (jobs submitted when seen, the exception)
        self._settings = _settings()  # read here, so that a bad value raises in the caller
        self.nice = 0  # the thread's nice value once it runs (0 where raising it was refused)

    @property
    def started(self) -> bool:
        return self._thread is not None

    def submit(self, fn, *args) -> Future:
        """Queue ``fn(*args)`` on the communication thread; returns its Future."""
        future: Future = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
                _running.add(self)
            self._queue.put((next(self._submitted), future, fn, args))
        return future

    def call(self, fn, *args):
        """``fn(*args)``, run after every job queued before it; inline where no thread was ever started."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    def stop(self, timeout: float | None = None) -> None:
        """Let the current job finish, fail the queued ones, end the thread (joined up to ``timeout`` s)."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._queue.put(None)
        thread.join(timeout)

    def _run(self) -> None:
        nice, _local.pause = self._settings
        if nice:
            try:  # Linux: a thread's own nice value; EACCES without the right to raise priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
                self.nice = nice
            except OSError:
                pass
        while True:
            item = self._queue.get()
            if item is None:
                self._drain(TorusError(f"{self.name}: the communication thread stopped (Python is exiting) "
                                       "before this collective ran"))
                return
            seq, future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            failed = self._failed
            if failed is not None and seq < failed[0]:
                future.set_exception(TorusError(f"not run: an earlier collective on this communication thread "
                                                f"failed ({type(failed[1]).__name__}: {failed[1]})"))
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the waiter, which raises it in its own thread
                with self._lock:
                    self._failed = (next(self._submitted), e)  # the counter moves past every queued job
                future.set_exception(e)

    def _drain(self, error: BaseException) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(error)


_running: weakref.WeakSet = weakref.WeakSet()


@atexit.register  # after mpi4py's import registered MPI_Finalize: this runs first
def _stop_all() -> None:
    for progress in list(_running):
        progress.stop(timeout=5.0)
