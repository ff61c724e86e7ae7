"""Faults during torus-train (issue 7): a run killed with SIGKILL in the middle of epoch 3, and then again in the
middle of writing a checkpoint, resumes (``--resume``) to the same final weights and optimizer state as a run
that was never interrupted; the half-written checkpoint never hides the last complete one.

Each job is its own ``mpiexec -n 2 torus-train`` (tiny CNN, digits at 8x8, 5 epochs, one thread per rank) in
its own session, so a kill takes the launcher, the proxy and both ranks. The test runs in the 1-rank job only
(it is the launcher). Budget: four jobs of about 10 s each on a quiet 2-core machine.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorflow")
from mpi4py import MPI  # noqa: E402

from torus.integrations.keras.app import checkpoint, digits  # noqa: E402

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                reason="launches its own mpiexec -n 2; runs in the 1-rank job")
EPOCHS = 5
LIMIT_S = 300


def _env(**extra) -> dict:
    # the child job must not see this job's PMI connection, or its ranks would try to join this job
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI_LOCAL"))}
    return dict(env, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", **extra)


def _start(data: Path, ckpt: Path, *extra, **env) -> subprocess.Popen:
    bindir = Path(sys.executable).parent
    mpiexec = shutil.which("mpiexec", path=str(bindir)) or shutil.which("mpiexec")
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "torus.integrations.keras.app.cli", "--data", str(data),
           "--model", "tiny", "--image-size", "8", "--epochs", str(EPOCHS), "--batch-schedule", "0:32,3:64",
           "--warmup-epochs", "1", "--threads", "1", "--verbose", "0", "--checkpoint-dir", str(ckpt), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(**env),
                            start_new_session=True)


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torus-train still ran after {LIMIT_S} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def _kill_when(proc: subprocess.Popen, ready, what: str) -> str:
    """SIGKILL the whole job as soon as ``ready()`` holds; return its output."""
    deadline = time.monotonic() + LIMIT_S
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"torus-train never reached {what}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()[0]


def _arrays(path: Path) -> dict:
    with np.load(path) as archive:
        return {k: archive[k] for k in archive.files if k != "meta"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORUS_CACHE", str(tmp_path_factory.mktemp("cache")))
        return digits.ensure_digits(8)


def test_sigkill_in_epoch_and_mid_checkpoint_then_resume_matches_uninterrupted(data, tmp_path):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    _finish(_start(data, reference))

    # kill 1: during epoch 3 (checkpoint 2 is complete, checkpoint 3 not yet written)
    _kill_when(_start(data, interrupted), lambda: (interrupted / "checkpoint-000002.npz").exists(), "epoch 3")
    assert checkpoint.latest(interrupted).name == "checkpoint-000002.npz"

    # kill 2: after resuming, while the checkpoint of epoch 4 is half written (the writer pauses there)
    proc = _start(data, interrupted, "--resume", TORUS_CHECKPOINT_SLEEP="120@4")
    _kill_when(proc, lambda: any(interrupted.glob(".checkpoint-000004.npz.*.tmp")), "the checkpoint-4 write")
    assert checkpoint.latest(interrupted).name == "checkpoint-000003.npz"
    assert checkpoint.read_state(checkpoint.latest(interrupted))["epoch"] == 3

    out = _finish(_start(data, interrupted, "--resume"))
    assert "resumed from" in out and "after epoch 3" in out
    assert not list(interrupted.glob(".checkpoint-*.tmp"))
    expected = _arrays(reference / f"checkpoint-{EPOCHS:06d}.npz")
    got = _arrays(interrupted / f"checkpoint-{EPOCHS:06d}.npz")
    assert expected.keys() == got.keys()
    for key in expected:  # weights (w*), optimizer slots and step counter (o*)
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
