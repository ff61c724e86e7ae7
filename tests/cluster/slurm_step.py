"""One Slurm job step for the Slurm suites, started again where Slurm's ``pmi2`` plugin misread the PMI
requests of MPICH's PMI-1 client: it sometimes parses a request longer than its one read as several
(``slurmstepd: error: mpi/pmi2: invalid client request``, ``value not properly terminated``), and the step then
hangs in ``MPI_Init`` or fails there (exit code 15) (Slurm 22.05, the pip wheel's MPICH; docs/clusters.md,
"Slurm"; tests/cluster/slurm.py's job environment makes it rare). That is the launcher's fault, not torus's: the
step is ended once those lines are seen, or has ended unsuccessfully after them, and is started again, with a
line saying so, at most seven times (the clean-clone run of 310c260 met one misread with the environment's
fix in, that of 9454c37 four in a row); an eighth misread is returned as it is (the test then fails).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

PMI_MISREAD = re.compile(r"mpi/pmi2: (?:invalid client request|value not properly terminated|request not begin)")
GRACE_S = 20.0  # after the first misread line: the step may still finish (a misread of a request it repeats)
DRAIN_S = 60.0  # for the ended step's job to leave the queue: until then a new one waits for its nodes


def run(cmd: list[str], env: dict, cwd: Path, limit_s: float, attempts: int = 8) -> tuple[int | None, str, str]:
    """``cmd`` in a session of its own, at most ``limit_s`` seconds an attempt: (status, None where it ran out
    of time; its stdout; its stderr)."""
    for attempt in range(1, attempts + 1):
        status, out, err, misread = _once(cmd, env, cwd, limit_s)
        if misread is None or attempt == attempts:
            return status, out, err
        print(f"slurm step: Slurm's pmi2 plugin misread a PMI request ({misread}) and "
              f"the step hung or failed in MPI_Init; starting it again (attempt {attempt + 1} of {attempts})",
              flush=True)
        _drain(env)
    raise AssertionError("unreachable")


def _drain(env: dict) -> None:
    """Cancel this cluster's jobs (the ended step's job stays on record, holding its nodes) and wait until
    the queue is empty, at most DRAIN_S."""
    scancel, squeue = shutil.which("scancel", path=env.get("PATH")), shutil.which("squeue", path=env.get("PATH"))
    if scancel is None or squeue is None:
        return
    subprocess.run([scancel, "--user", str(os.getuid())], env=env, check=False, capture_output=True, timeout=30)
    deadline = time.monotonic() + DRAIN_S
    while time.monotonic() < deadline:
        listed = subprocess.run([squeue, "--noheader", "--user", str(os.getuid())], env=env, check=False,
                                capture_output=True, text=True, timeout=30)
        if listed.returncode == 0 and not listed.stdout.strip():
            return
        time.sleep(1.0)


def _once(cmd: list[str], env: dict, cwd: Path, limit_s: float) -> tuple[int | None, str, str, str | None]:
    """(status, stdout, stderr, the misread line's error where the step met one and did not succeed, else None)."""
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        proc = subprocess.Popen(cmd, stdout=out_file, stderr=err_file, text=True, env=env, cwd=cwd,
                                start_new_session=True)
        t0, seen, status, misread = time.monotonic(), None, None, False
        while (status := proc.poll()) is None:
            now = time.monotonic()
            if seen is None:
                err_file.seek(0)
                seen = now if PMI_MISREAD.search(err_file.read()) else None
            if now - t0 > limit_s or (seen is not None and now - seen > GRACE_S):
                misread = seen is not None
                os.killpg(proc.pid, signal.SIGTERM)  # srun cancels its step and job on SIGTERM
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # salloc ignores SIGTERM
                    proc.wait()
                status = None
                break
            time.sleep(1.0)
        out_file.seek(0)
        err_file.seek(0)
        out, err = out_file.read(), err_file.read()
        found = PMI_MISREAD.search(err)
        return status, out, err, found.group(0) if found and (misread or status != 0) else None
