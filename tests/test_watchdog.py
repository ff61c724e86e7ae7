"""The watchdog of torus.faults: a rank whose MPI_Abort cannot end it still ends, with a clear status.

Each case is one plain Python process (no mpiexec) with a stand-in communicator whose ``Abort`` behaves as
MPICH's does on a host cut off from ``mpiexec`` (tests/cluster/faults.py has the real thing): it blocks in a
read nobody answers, or it returns. And a process that raised a stall timeout and then blocks at exit (as in
``MPI_Finalize``) ends too. TORUS_ABORT_TIMEOUT=1; the bound, 15 s, allows a loaded machine's start-up.
Budget: 3 processes of about 1-2 s each.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

BOUND_S = 15

WORKER = r"""
import os, sys, atexit
mode = sys.argv[1]

class World:  # stands in for MPI.COMM_WORLD
    def Get_rank(self):
        return 3
    def Abort(self, status):
        if mode == "abort blocks":
            os.read(os.pipe()[0], 1)  # like the PMI read of a proxy that cannot reach mpiexec
        print("Abort returned", flush=True)

if mode == "stall then exit blocks":
    # registered first, so it runs after torus' exit handler, as mpi4py's MPI_Finalize does
    atexit.register(lambda: os.read(os.pipe()[0], 1))
from torus import faults
from torus.errors import TimeoutError as TorusTimeout

if mode == "stall then exit blocks":
    class Never:
        def Test(self):
            return False
    try:
        faults.wait(Never(), 0.05, lambda: "allreduce(ring) on rank 3: no progress")
    except TorusTimeout:
        sys.exit(0)  # the caller caught the stall timeout and leaves
faults.abort_on_exception(World(), status=7)
raise RuntimeError("rank 3 fails")
"""


def _run(mode: str) -> tuple[int, float, str]:
    env = dict(os.environ, TORUS_ABORT_TIMEOUT="1", PYTHONUNBUFFERED="1")
    env.pop("PMI_SIZE", None)  # never join an enclosing MPI job
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", WORKER, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BOUND_S + 15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{mode}: the process still ran after {BOUND_S + 15} s:\n{proc.communicate()[0][-2000:]}")
    return proc.returncode, time.monotonic() - t0, out


def test_abort_that_blocks_ends_by_sigalrm_after_the_timeout():
    rc, seconds, out = _run("abort blocks")
    assert rc == -signal.SIGALRM, (rc, out)
    assert 1 <= seconds < BOUND_S, (seconds, out)
    assert "[rank 3] uncaught RuntimeError; aborting the MPI job: rank 3 fails" in out, out
    assert "[rank 3] calling MPI_Abort(7); this process ends itself (SIGALRM) if it still runs in 1 s" in out
    assert "Abort returned" not in out, out


def test_abort_that_returns_exits_with_the_status_at_once():
    rc, seconds, out = _run("abort returns")
    assert rc == 7, (rc, out)
    assert seconds < BOUND_S, (seconds, out)
    assert "Abort returned" in out and "[rank 3] MPI_Abort returned; exiting with status 7" in out, out


def test_exit_after_a_stall_timeout_cannot_hang():
    rc, seconds, out = _run("stall then exit blocks")
    assert rc == -signal.SIGALRM, (rc, out)
    assert 1 <= seconds < BOUND_S, (seconds, out)
    assert "exiting after a stall timeout; this process ends itself (SIGALRM) if it still runs in 3 s" in out

