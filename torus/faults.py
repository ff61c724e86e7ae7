"""Ending the whole MPI job when one rank fails, instead of leaving the other ranks waiting forever.

hydra's ``mpiexec`` ends a job whose rank dies by a signal or ``os._exit``, but a rank that leaves through an
uncaught exception or ``sys.exit`` runs ``MPI_Finalize``, which waits for the ranks still inside a collective:
the job hangs. This module closes that gap:

- :func:`abort_on_exception` (opt-in; torus-train installs it) turns an uncaught exception on any rank into
  :func:`abort`: ``MPI_Abort``, with a watchdog (``SIGALRM`` after ``TORUS_ABORT_TIMEOUT`` seconds) for the case
  where ``MPI_Abort`` returns, as it does on a host cut off from ``mpiexec``. A stall timeout (a peer died, was
  cut off or is stuck) aborts with :data:`PEER_LOST_EXIT` instead of the given status, so that a supervisor
  (torus-run, torus/supervise/) can tell a lost peer, worth a relaunch, from an error of the program.
- :func:`at_exit` marks, at Python's exit, in every shared-memory window this process has open, that it has
  left; a survivor on the same node waiting on it raises :class:`torus.errors.TimeoutError` naming it (over
  shared memory at once, in :func:`wait` after ``LEFT_GRACE_S``).
- :func:`wait` polls an MPI request under the stall timeout (``TorusComm(timeout=...)``, ``TORUS_TIMEOUT``):
  every torus collective raises :class:`torus.errors.TimeoutError` naming the operation after ``timeout``
  seconds without progress; from then on (:func:`stalled`) an uncaught exception aborts the job, in library use
  too (``TORUS_ABORT_ON_STALL=0`` opts out), and the watchdog is armed at exit.

Not covered: a survivor blocked in an MPI call outside torus (``algorithm="native"``, the caller's own
``comm.Allreduce``) waits forever, since MPI's blocking calls have no timeout. What hydra does by itself in
each case, what the mark covers and misses, and why the watchdog is a signal: docs/design.md, "The fault
model".
"""
from __future__ import annotations

import atexit
import os
import re
import signal
import sys
import time

from mpi4py import MPI

from torus import knobs, recorder
from torus.errors import TimeoutError as TorusTimeout

# Seconds between an uncaught exception's report and MPI_Abort, so the launcher forwards the report first.
ABORT_GRACE_S = 0.5
# abort_on_exception's status for an uncaught stall timeout (sysexits' EX_TEMPFAIL: try again): a peer died, was
# cut off or is stuck, so the job may succeed when relaunched. torus-run relaunches on it (torus/supervise/).
PEER_LOST_EXIT = 75
# In a stall timeout's message when the peer's Python exited (it left on purpose: a relaunch would repeat it).
PYTHON_EXITED = "left the job (Python exited there)"
EXIT_AFTER_STALL = 3  # the watchdog at exit after a stall: this many abort timeouts
_stalled = False  # set when this process raised a stall timeout: its communicators may never finish
# A wait that has run this long while a peer's Python has exited raises: that peer cannot take part in a
# call it has not finished (long enough for its last messages to arrive).
LEFT_GRACE_S = knobs.read("TORUS_LEFT_GRACE")
_PROBE_AFTER_S = 0.02  # a wait starts looking for departed peers after this, then every _PROBE_EVERY_S
_PROBE_EVERY_S = 0.01
_left_probes: dict = {}  # id(owner) -> () -> "rank 1" / "ranks 1, 3" whose Python exited, or "" (at_exit)
_exit_notices: dict = {}  # id(owner) -> what tells its peers when this process exits (at_exit)


def wait(req: MPI.Request, timeout: float | None, message) -> None:
    """Complete ``req``, or raise :class:`torus.errors.TimeoutError` with ``message()`` after ``timeout`` s,
    or after ``LEFT_GRACE_S`` (5 s, ``TORUS_LEFT_GRACE``) once a peer's Python has exited (:func:`at_exit`'s
    probes): then the message names that peer instead of the stall.

    ``timeout`` None waits in ``MPI_Wait`` (no polling cost, no departed peers). ``message`` is called only on
    failure, so callers build the text lazily: ``"<operation> on rank <r>: <why>"``."""
    if timeout is None:
        req.Wait()
        return
    start = time.monotonic()
    deadline, probe = start + timeout, start + _PROBE_AFTER_S
    while not req.Test():
        # Give the core away after every unsuccessful test: when ranks outnumber cores the rank we wait for
        # may need this very core (docs/performance.md, "Where the constants come from": yielding rarely or
        # never was slower at 4 ranks on 2 cores; with a core per rank sched_yield returns at once).
        os.sched_yield()
        now = time.monotonic()
        if now > deadline:
            stalled()
            raise TorusTimeout(message())
        if _left_probes and now > probe:
            probe = now + _PROBE_EVERY_S
            left = next((who for who in (p() for p in list(_left_probes.values())) if who), "")
            if left and now - start > LEFT_GRACE_S:
                stalled()
                raise TorusTimeout(f"{message().split(': ', 1)[0]}: {left} {PYTHON_EXITED} "
                                   f"while this rank waits ({now - start:.1f} s into this wait): every "
                                   "rank must make the same collective calls (under TorusStrategy, fit, "
                                   "evaluate and predict too: call them on every rank, not on rank 0 alone)")


def at_exit(owner, notice, left) -> None:
    """Until :func:`cancel_at_exit` of ``owner``: call ``notice()`` when this process's Python exits (before
    MPI_Finalize), and let :func:`wait` call ``left()`` for the peers whose ``notice`` has run ("rank 1" /
    "ranks 1, 3", or ""). The shared-memory transport's marks in its window: memory reads, no messages."""
    _exit_notices[id(owner)] = notice
    _left_probes[id(owner)] = left


def cancel_at_exit(owner) -> None:
    _exit_notices.pop(id(owner), None)
    _left_probes.pop(id(owner), None)


@atexit.register  # registered after mpi4py's MPI_Finalize (imported above): runs before it
def _announce_exit() -> None:
    for notice in list(_exit_notices.values()):
        notice()


def stalled() -> None:
    """Called by every raise of a stall timeout (or a departed peer): from then on an uncaught exception ends the
    whole job at once (:func:`abort_on_exception` with :data:`PEER_LOST_EXIT`, unless a hook is installed
    already or ``TORUS_ABORT_ON_STALL=0``), and at Python's exit the watchdog is armed, since MPI_Finalize may
    wait forever for the stuck peer (the stuck rank is alive: the launcher ends it only when another rank's
    process ends). A caught stall timeout changes nothing until the exit."""
    global _stalled
    if not _stalled:
        _stalled = True
        if knobs.read("TORUS_ABORT_ON_STALL") and not hasattr(sys.excepthook, "torus_previous"):
            abort_on_exception()
        # Three abort timeouts: Python's own exit (TensorFlow's teardown, other atexit handlers) runs first and
        # can outlast one abort timeout on a loaded machine (docs/performance.md, "Where the constants come from").
        atexit.register(lambda: watchdog("exiting after a stall timeout", EXIT_AFTER_STALL * _timeout_s()))


def _timeout_s() -> float:
    return knobs.read("TORUS_ABORT_TIMEOUT")


def watchdog(why: str, seconds: float | None = None) -> None:
    """End this process with SIGALRM (status 128 + 14 from a shell, "signal 14" from hydra) ``seconds`` from
    now (default ``TORUS_ABORT_TIMEOUT``, 10 s), whatever it is blocked in by then, unless it has ended.

    For the last stretch of a failing rank (``MPI_Abort``, ``MPI_Finalize`` after a stall); nothing can cancel
    it but another call (which re-arms it) or ``signal.setitimer(signal.ITIMER_REAL, 0)``. Replaces any
    ``SIGALRM`` handler: a Python handler could not run while the main thread is blocked in MPI. Says so on
    stderr first, in one write."""
    seconds = _timeout_s() if seconds is None else seconds
    _say(f"{why}; this process ends itself (SIGALRM) if it still runs in {seconds:g} s")
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def abort(comm: MPI.Comm | None = None, status: int = 1) -> None:
    """``comm.Abort(status)`` (``comm`` defaults to ``MPI.COMM_WORLD``) that ends this process even where
    ``MPI_Abort`` cannot: the :func:`watchdog` is armed first, and if ``MPI_Abort`` returns (or raises) the
    process leaves with ``os._exit(status)``. Never returns."""
    comm = MPI.COMM_WORLD if comm is None else comm
    watchdog(f"[rank {comm.Get_rank()}] calling MPI_Abort({status})")
    try:
        comm.Abort(status)
    finally:
        # MPICH's returns once the abort request is with the local proxy, which ends the job where it can
        # reach mpiexec; leave now rather than run on into MPI_Finalize, which blocks where it cannot
        _say(f"[rank {comm.Get_rank()}] MPI_Abort returned; exiting with status {status}")
        os._exit(status)


_say = recorder.say


# A Python error raised inside a TensorFlow op (tf.numpy_function) reaches the caller as an OpError whose message
# holds the original's traceback; its last line names the original error.
_WRAPPED = re.compile(r"^(?:torus\.errors\.)?(\w+(?:Error|Exception)): (.+)$", re.MULTILINE)
_WRAPPED_TIMEOUT = re.compile(r"^torus\.errors\.TimeoutError: (.+)$", re.MULTILINE)


def reason(exc_type, exc) -> tuple[str, str]:
    """The name and message of an uncaught exception for the one-line report: for a TensorFlow ``OpError``
    that wraps a Python error of an op, that error's (``MismatchError (in a TensorFlow op:
    InvalidArgumentError)``, its message line) instead of TensorFlow's graph execution text."""
    if exc_type.__module__.startswith("tensorflow"):
        found = _WRAPPED.search(str(exc))
        if found:
            return f"{found.group(1)} (in a TensorFlow op: {exc_type.__name__})", found.group(2)
    return exc_type.__name__, str(exc)


def peer_lost(exc_type, exc) -> bool:
    """Whether an uncaught exception is a stall timeout (:class:`torus.errors.TimeoutError`, also inside a
    TensorFlow op) that a relaunch may cure: not one naming a peer whose Python exited, which left on purpose."""
    if issubclass(exc_type, TorusTimeout):
        text = str(exc)
    elif exc_type.__module__.startswith("tensorflow"):
        # the op's own traceback ends with the qualified name; TensorFlow's "Detected at node" block before it
        # names the error by its bare class name, which a builtin TimeoutError shares
        found = _WRAPPED_TIMEOUT.search(str(exc))
        if not found:
            return False
        text = found.group(1)
    else:
        return False
    return PYTHON_EXITED not in text


def abort_on_exception(comm: MPI.Comm | None = None, status: int = 1) -> None:
    """Make an uncaught exception on this rank print its traceback and call ``comm.Abort(status)``.

    Call it on every rank at start-up (``comm`` defaults to ``MPI.COMM_WORLD``). Without it, an uncaught
    exception on one rank leaves the job hanging (see the module docstring). The previous ``sys.excepthook``
    still prints the traceback, prefixed by ``[rank r]``; ``KeyboardInterrupt`` aborts with status 130, and a
    stall timeout (:func:`peer_lost`: a peer died, was cut off or is stuck) with :data:`PEER_LOST_EXIT` (75).
    Only the main thread's exceptions end the job: an exception in another thread does not end a Python process
    either.
    Calling it again replaces the earlier hook instead of stacking one on another. The process ends even when
    ``MPI_Abort`` cannot end it (see :func:`abort`)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    previous = getattr(sys.excepthook, "torus_previous", sys.excepthook)

    def hook(exc_type, exc, tb):
        # The reason goes out first, in one write: another rank's Abort may kill this process (and hydra may
        # drop its unforwarded output) at any moment after this, so the traceback is best effort.
        sys.stdout.flush()
        name, message = reason(exc_type, exc)
        sys.stderr.write(f"[rank {comm.Get_rank()}] uncaught {name}; aborting the MPI job: {message}\n")
        sys.stderr.flush()
        previous(exc_type, exc, tb)
        sys.stderr.flush()
        recorder.dump(f"uncaught {name}: {message}")  # what torus.doctor reads (the stall's dump is newer: kept)
        # Give the launcher's output forwarding a moment to drain before Abort tears the job down.
        time.sleep(ABORT_GRACE_S)
        interrupted = issubclass(exc_type, KeyboardInterrupt)
        abort(comm, 130 if interrupted else PEER_LOST_EXIT if peer_lost(exc_type, exc) else status)

    hook.torus_previous = previous  # type: ignore[attr-defined]
    sys.excepthook = hook
