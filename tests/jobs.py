"""Launching a whole MPI job from a test: ``mpiexec`` beside this Python, and ``run`` with a wall-clock bound."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def mpiexec() -> str:
    """The ``mpiexec`` of this Python's environment (the mpich wheel's), else the one on PATH."""
    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def run(cmd: list[str], env: dict, limit_s: float, what: str) -> tuple[int, float, str]:
    """Run ``cmd`` in its own session (so that a job past ``limit_s`` seconds is killed whole: launcher, proxy
    and ranks, then the test fails naming ``what``); returns (exit status, seconds, merged output)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    out, _ = finish(proc, limit_s, what)
    return proc.returncode, time.monotonic() - t0, out


def finish(proc: subprocess.Popen, limit_s: float, what: str) -> tuple[str, str | None]:
    """``proc.communicate()`` of a process started with ``start_new_session=True``, bounded: past ``limit_s``
    seconds its whole session is killed and the test fails naming ``what``. Returns (stdout, stderr)."""
    try:
        return proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what} still ran after {limit_s:g} s:\n{out[-3000:]}{err or ''}")
