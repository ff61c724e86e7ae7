"""``torus-train --data fashion-mnist --model resnet20`` as a user runs it, under ``mpiexec -n 2`` and ``-n 1``
at the same global batch: the same global batches (the training set is shared, data.open_idx), the same
starting weights and learning rates; the two runs differ only in where batch normalization takes its batch
statistics (64 images per rank at 2 ranks, 128 at 1) and in the order of float sums. Both are measured on the
whole official test split (10,000 images), and their test accuracy and training loss must agree within
tolerances that such differences allow, after a short run (2,048 training images, 16 steps) that has left
chance well behind. Skipped where Debian's ``dataset-fashion-mnist`` is not installed.
Budget: about 2 minutes on 2 cores (two jobs; TensorFlow start-up and the test-set pass dominate).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import jobs

pytest.importorskip("tensorflow")
from torus.integrations.keras.app import idx  # noqa: E402

pytestmark = pytest.mark.skipif(not idx.FASHION_MNIST_DIR.is_dir(), reason=f"{idx.FASHION_MNIST_DIR} absent: "
                                "apt-get install dataset-fashion-mnist")
TRAIN = [str(Path(sys.executable).parent / "torus-train"), "--data", "fashion-mnist", "--model", "resnet20",
         "--epochs", "1", "--train-images", "2048", "--batch-schedule", "0:128", "--optimizer", "sgd",
         "--lr", "0.1", "--warmup-epochs", "0.1", "--bn-momentum", "0.5", "--verbose", "0"]
ACCURACY_TOLERANCE = 0.02  # of 10,000 test images: 200 answers
LOSS_TOLERANCE = 0.02  # relative, the epoch's mean training loss
JOB_LIMIT_S = 400


def _summary(ranks: int, folder: Path) -> dict:
    path = folder / f"summary-{ranks}.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
    rc, _, out = jobs.run([jobs.mpiexec(), "-n", str(ranks), *TRAIN, "--summary", str(path)], env, JOB_LIMIT_S,
                          f"torus-train at {ranks} rank(s)")
    assert rc == 0, out[-3000:]
    assert "torus-train: done: 1 epochs" in out and "resnet20 at 28x28" in out, out[-3000:]
    return json.loads(path.read_text())


@pytest.mark.timeout(2 * JOB_LIMIT_S + 60)  # two bounded jobs: more than pyproject.toml's 300 s on a loaded machine
def test_two_ranks_reach_the_test_accuracy_of_one_process(tmp_path):
    one, two = _summary(1, tmp_path), _summary(2, tmp_path)
    for summary, ranks in ((one, 1), (two, 2)):
        assert summary["world_size"] == ranks and summary["data"] == str(idx.FASHION_MNIST_DIR)
        (epoch,) = summary["history"]
        assert epoch["global_batch"] == 128 and epoch["steps"] == 2048 // 128
        assert summary["val_top1"] > 0.2, summary  # learnt something: chance is 0.1
    assert abs(one["val_top1"] - two["val_top1"]) <= ACCURACY_TOLERANCE, (one["val_top1"], two["val_top1"])
    assert two["history"][0]["loss"] == pytest.approx(one["history"][0]["loss"], rel=LOSS_TOLERANCE)
