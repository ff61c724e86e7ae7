"""The flight recorder and its diagnosis in real jobs (issue 43): each test launches ``mpiexec -n 3`` of this
file's worker (TorusComm all-reduces of 1000 + i float32 elements, i = 1, 2, ...; TORUS_TIMEOUT=3; the recorder
on, TORUS_RECORDER=64; the dumps in a folder of the test's own) and checks that the diagnosis names the right
rank and call, and that the job ended within the timeout plus 30 s:

- rank 1 stuck in its own code before call #4 (library use: no abort hook installed by the script);
- rank 1 stopped with SIGSTOP before call #4 (it can write nothing; the others' records name it);
- rank 1 skipping call #4 (its #4 is the others' #5: MismatchError), read afterwards by ``python -m
  torus.doctor``;
- rank 1 bucketing its gradients differently at the 4th reduction (``allreduce_tensors`` under TorusStrategy with
  overlap: the layout agreement's MismatchError, uncaught, ends the job), read afterwards by the doctor;
- SIGUSR1 to a healthy job: every rank dumps and the job finishes.
Budget: 5 jobs of 3 ranks, 3 to 20 s each.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import jobs

TIMEOUT_S = 3
BOUND_S = TIMEOUT_S + 30


def _job(mode: str, folder, **env_vars) -> tuple[int, float, str]:
    cmd = [jobs.mpiexec(), "-n", "3", sys.executable, __file__, mode]
    env = {**os.environ, "TORUS_TIMEOUT": str(TIMEOUT_S), "TORUS_TRACE_DIR": str(folder), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "TORUS_RECORDER": "64", **env_vars}
    return jobs.run(cmd, env, BOUND_S + 30, f"mpiexec with rank 1 {mode}")


@pytest.mark.parametrize("mode", ["stuck", "sigstop"])
def test_the_diagnosis_names_the_rank_that_never_came(mode, tmp_path):
    rc, seconds, out = _job(mode, tmp_path)
    tail = out[-3000:]
    assert rc != 0 and seconds < BOUND_S, f"status {rc} after {seconds:.0f} s:\n{tail}"
    assert "torus doctor: communicator " in out and ", 3 ranks (world ranks 0, 1, 2)" in out, tail
    assert "the ranks part at call #4, allreduce of 1004 float32" in out, tail
    assert "- rank 1 left no record" in out, tail
    # the argument check's all-gather cannot tell who is missing; the records can
    assert "- rank 0 timed out in the argument check" in out, tail
    assert "- rank 2 timed out in the argument check" in out, tail
    assert sorted(p.name for p in tmp_path.glob("torus-trace-rank*.json")) == \
        ["torus-trace-rank0.json", "torus-trace-rank2.json"]


def test_a_skipped_call_is_named_by_the_doctor_afterwards(tmp_path):
    rc, seconds, out = _job("skip", tmp_path)
    assert rc != 0 and seconds < BOUND_S, out[-3000:]
    assert "MismatchError" in out, out[-3000:]
    doctor = subprocess.run([sys.executable, "-m", "torus.doctor", str(tmp_path)], capture_output=True, text=True)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "the ranks part at call #4: they called different collectives:" in doctor.stdout, doctor.stdout
    assert "- ranks 0, 2: allreduce of 1004 float32" in doctor.stdout, doctor.stdout
    assert "- rank 1: allreduce of 1005 float32" in doctor.stdout, doctor.stdout


def test_a_bucket_layout_that_differs_ends_the_job_and_the_doctor_names_the_rank(tmp_path):
    pytest.importorskip("tensorflow")
    rc, seconds, out = _job("layout", tmp_path)
    assert rc != 0 and seconds < BOUND_S, out[-3000:]
    assert "MismatchError: allreduce of gradient buckets on rank" in out and \
        "rank 1 bucket the gradients differently from rank 0" in out, out[-3000:]
    doctor = subprocess.run([sys.executable, "-m", "torus.doctor", str(tmp_path)], capture_output=True, text=True)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "they called different collectives:" in doctor.stdout, doctor.stdout
    assert "- ranks 0, 2: bucket layout agreement of 74 float32" in doctor.stdout, doctor.stdout
    assert "- rank 1: bucket layout agreement of 75 float32" in doctor.stdout, doctor.stdout


def test_sigusr1_dumps_a_healthy_job_that_goes_on(tmp_path):
    cmd = [jobs.mpiexec(), "-n", "3", sys.executable, __file__, "healthy"]
    env = {**os.environ, "TORUS_TRACE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TORUS_RECORDER": "64"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in range(3)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)  # mpiexec forwards it to every rank
        out, _ = proc.communicate(timeout=BOUND_S + 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    for r in range(3):
        assert f"torus: rank {r} wrote its flight record to {tmp_path}/torus-trace-rank{r}.json (SIGUSR1)" in out
        assert f"rank {r} finished" in out, out[-3000:]
    doctor = subprocess.run([sys.executable, "-m", "torus.doctor", str(tmp_path)], capture_output=True, text=True)
    assert doctor.returncode == 0 and "the ranks agree" in doctor.stdout, doctor.stdout + doctor.stderr


def worker(mode: str) -> None:
    from pathlib import Path

    import numpy as np

    import torus
    from torus import faults

    if mode == "layout":
        _layout_worker()
        return
    if mode == "skip":
        faults.abort_on_exception()  # as TorusStrategy does: the uncaught MismatchError dumps the records
    tc = torus.TorusComm()
    calls = 40 if mode == "healthy" else 6
    for i in range(1, calls + 1):
        if tc.rank == 1 and i == 4:
            if mode == "stuck":
                time.sleep(10 * BOUND_S)
            elif mode == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif mode == "skip":
                continue
        tc.allreduce(np.ones(1000 + i, np.float32), algorithm="ring")
        if mode == "healthy":
            if i == 3:
                (Path(os.environ["TORUS_TRACE_DIR"]) / f"ready{tc.rank}").touch()
            time.sleep(0.1)
    print(f"rank {tc.rank} finished", flush=True)


def _layout_worker() -> None:
    import tensorflow as tf

    from torus.integrations.keras import TorusStrategy, allreduce_tensors

    strategy = TorusStrategy(overlap=True, bucket_bytes=256)  # installs abort_on_exception, as under fit
    reduce = tf.function(lambda ts: allreduce_tensors(strategy.host, ts, "sum"))
    for i in range(1, 7):
        n = 30 + i + (strategy.rank == 1 and i == 4)  # a new layout each call; rank 1's 4th one element longer
        reduce([tf.ones(n), tf.ones(40)])
    print(f"rank {strategy.rank} finished", flush=True)


if __name__ == "__main__":
    worker(sys.argv[1])
