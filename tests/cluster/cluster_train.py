"""torus-train across hosts (run by tests/cluster/suites.py on a running cluster, TORUS_CLUSTER=name): 2 hosts
x 1 rank, the tiny CNN on the digits at 8x8, 3 epochs. A run killed (the launcher and everything in the
namespaces, SIGKILL) once its first checkpoint is written, then resumed (``--resume``), ends with the same
weights and optimizer state, to the bit, as a run without a break (rank 0's checkpoints; the gradients
of both ranks went through torus across the host link at every step).

Budget: three 2-rank jobs of about 10-20 s each on a quiet machine (TensorFlow's start-up dominates).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.cluster import child_env, from_state

pytest.importorskip("tensorflow")
LIMIT_S = 240
EPOCHS = 3


@pytest.fixture(scope="module")
def cluster():
    name = os.environ.get("TORUS_CLUSTER")
    if not name:
        pytest.skip("needs a running cluster (python -m tests.cluster test)")
    return from_state(name)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from torus.integrations.keras import digits

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORUS_CACHE", str(tmp_path_factory.mktemp("cache")))
        return digits.ensure_digits(8)


def _start(cluster, data, ckpt, *extra: str) -> subprocess.Popen:
    cmd = cluster.mpiexec(ppn=1) + [
        "-n", "2", sys.executable, "-m", "torus.integrations.keras.train", "--data", str(data),
        "--model", "tiny", "--image-size", "8", "--epochs", str(EPOCHS), "--batch-schedule", "0:32,2:64",
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
    reference, broken = tmp_path / "reference", tmp_path / "broken"
    _finish(_start(cluster, data, reference))

    proc = _start(cluster, data, broken)
    deadline = time.monotonic() + LIMIT_S
    while not (broken / "checkpoint-000001.npz").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher; the proxies and ranks live in the namespaces:
    for h in range(1, cluster.hosts + 1):
        cluster.kill_all(cluster.namespace(h))
    proc.communicate()
    assert not (broken / f"checkpoint-{EPOCHS:06d}.npz").exists()

    out = _finish(_start(cluster, data, broken, "--resume"))
    assert "resumed from" in out, out[-3000:]
    name = f"checkpoint-{EPOCHS:06d}.npz"
    expected, got = _arrays(reference / name), _arrays(broken / name)
    assert expected.keys() == got.keys()
    for key in expected:  # weights (w*), optimizer slots and step counter (o*)
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
