"""Ending the whole MPI job when one rank fails, instead of leaving the other ranks waiting forever.

What MPICH's hydra ``mpiexec`` (the ``mpich`` 5.0 wheel) does by itself when one of 3 ranks leaves in the
middle of a sequence of ``MPI_Allreduce`` calls (measured without torus; tests/test_faults_subprocess.py runs
the same sequence with torus):

- killed by a signal (SIGKILL) or ``os._exit(status)`` with any status: hydra sees the process end without
  ``MPI_Finalize`` and kills every other rank within a second; ``mpiexec`` exits non-zero, except that after
  ``os._exit(0)`` it returns 0 in about half the runs (hydra records the ranks it killed as status 0;
  pmodels/mpich#5930, #7057). Nothing runs in the leaving process then, so torus cannot change that.
- an uncaught exception or ``sys.exit(status)`` with any status: Python's exit runs mpi4py's ``MPI_Finalize``,
  which waits for the ranks that are still inside a collective, which wait for the leaving rank: the job hangs
  forever.

torus closes that gap in two parts. :func:`abort_on_exception` (opt-in; ``python -m mpi4py script.py`` does the
same for a whole script and also aborts on ``sys.exit`` with a non-zero status) turns an uncaught exception on
any rank into ``MPI_Abort``, which ends the job at once. A rank that leaves through ``sys.exit`` (or returns from
``main`` early) is caught by the survivors' stall timeout (``TorusComm(timeout=...)``, ``TORUS_TIMEOUT``): every
torus collective, including the argument check, raises :class:`torus.errors.TimeoutError` naming the operation
after ``timeout`` seconds without progress, and with :func:`abort_on_exception` that uncaught error aborts the job.
Not covered: a survivor blocked in an MPI call outside torus (``algorithm="native"``, the caller's own
``comm.Allreduce``) waits forever, since MPI's blocking calls have no timeout.
"""
from __future__ import annotations

import os
import sys
import time

from mpi4py import MPI

from torus.errors import TimeoutError as TorusTimeout

# Seconds between an uncaught exception's report and MPI_Abort, so the launcher forwards the report first.
ABORT_GRACE_S = 0.5


def wait(req: MPI.Request, timeout: float | None, message) -> None:
    """Complete ``req``, or raise :class:`torus.errors.TimeoutError` with ``message()`` after ``timeout`` s.

    ``timeout`` None waits in ``MPI_Wait`` (no polling cost). ``message`` is called only on timeout, so callers
    build the text (operation, rank, step, peer) lazily."""
    if timeout is None:
        req.Wait()
        return
    deadline = time.monotonic() + timeout
    while not req.Test():
        # Give the core away after every unsuccessful test: when ranks outnumber cores the rank we wait for
        # may need this very core. Measured at 4 ranks on 2 cores (ring all-reduce / MPI_Allreduce): 1.28x
        # -> 1.04x at 1 MiB, 1.20x -> 0.96x at 4 MiB against yielding every 100 tests; neutral at 2 ranks
        # (one core each), where sched_yield returns at once. Pure spinning was 2.7x slower still.
        os.sched_yield()
        if time.monotonic() > deadline:
            raise TorusTimeout(message())


def abort_on_exception(comm: MPI.Comm | None = None, status: int = 1) -> None:
    """Make an uncaught exception on this rank print its traceback and call ``comm.Abort(status)``.

    Call it on every rank at start-up (``comm`` defaults to ``MPI.COMM_WORLD``). Without it, an uncaught
    exception on one rank leaves the job hanging (see the module docstring). The previous ``sys.excepthook``
    still prints the traceback, prefixed by ``[rank r]``; ``KeyboardInterrupt`` aborts with status 130. Only the
    main thread's exceptions end the job: an exception in another thread does not end a Python process either.
    Calling it again replaces the earlier hook instead of stacking one on another."""
    comm = MPI.COMM_WORLD if comm is None else comm
    previous = getattr(sys.excepthook, "torus_previous", sys.excepthook)

    def hook(exc_type, exc, tb):
        # The reason goes out first, in one write: another rank's Abort may kill this process (and hydra may
        # drop its unforwarded output) at any moment after this, so the traceback is best effort.
        sys.stdout.flush()
        sys.stderr.write(f"[rank {comm.Get_rank()}] uncaught {exc_type.__name__}; aborting the MPI job: {exc}\n")
        sys.stderr.flush()
        previous(exc_type, exc, tb)
        sys.stderr.flush()
        # Give the launcher's output forwarding a moment to drain before Abort tears the job down.
        time.sleep(ABORT_GRACE_S)
        comm.Abort(130 if issubclass(exc_type, KeyboardInterrupt) else status)

    hook.torus_previous = previous
    sys.excepthook = hook
