"""torus-train across hosts (run by tests/cluster/suites.py on a running cluster, TORUS_CLUSTER=name): 2 hosts
x 1 rank, the tiny CNN on the digits at 8x8, 2 epochs (global batch 64, then 128). Resumed (``--resume``) from
its checkpoint after epoch 1, a run ends with the same weights and optimizer state, to the bit, as the same
run without a break (rank 0's checkpoints; both ranks' gradients crossed the host link at every step).
Stopping a run by SIGKILL mid-epoch and mid-checkpoint is tested on one host (tests/mpi/test_train_faults.py).

Budget: two 2-rank jobs of about 10-20 s each on a quiet machine (TensorFlow's start-up dominates).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.cluster import child_env, from_state

pytest.importorskip("tensorflow")
LIMIT_S = 240
EPOCHS = 2


@pytest.fixture(scope="module")
def cluster():
    name = os.environ.get("TORUS_CLUSTER")
    if not name:
        pytest.skip("needs a running cluster (python -m tests.cluster test)")
    return from_state(name)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from torus.integrations.keras.app import digits

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORUS_CACHE", str(tmp_path_factory.mktemp("cache")))
        return digits.ensure_digits(8)


def _start(cluster, data, ckpt, *extra: str) -> subprocess.Popen:
    cmd = cluster.mpiexec(ppn=1) + [
        "-n", "2", sys.executable, "-m", "torus.integrations.keras.app.cli", "--data", str(data),
        "--model", "tiny", "--image-size", "8", "--epochs", str(EPOCHS), "--batch-schedule", "0:64,1:128",
        "--warmup-epochs", "1", "--threads", "1", "--verbose", "0", "--checkpoint-dir", str(ckpt), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(TORUS_TIMEOUT="60"), start_new_session=True)


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"torus-train still ran after {LIMIT_S} s:\n{proc.communicate()[0][-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def _arrays(path) -> dict:
    with np.load(path) as archive:
        return {k: archive[k] for k in archive.files if k != "meta"}


def test_resume_across_hosts_matches_an_unbroken_run(cluster, data, tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    _finish(_start(cluster, data, reference))
    name = f"checkpoint-{EPOCHS:06d}.npz"
    # the state after epoch 1 and nothing later: as if the run had stopped there
    shutil.copytree(reference, resumed, ignore=shutil.ignore_patterns(name, "logs", "summary.json"))
    assert [p.name for p in resumed.glob("checkpoint-*.npz")] == ["checkpoint-000001.npz"]

    out = _finish(_start(cluster, data, resumed, "--resume"))
    assert "resumed from" in out and "after epoch 1" in out, out[-3000:]
    expected, got = _arrays(reference / name), _arrays(resumed / name)
    assert expected.keys() == got.keys()
    for key in expected:  # weights (w*), optimizer slots and step counter (o*)
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
