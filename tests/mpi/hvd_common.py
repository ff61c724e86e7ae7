"""Shared pieces of tests/mpi/test_horovod_*.py: data, tiny models, a weight recorder, cross-rank checks."""
import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras  # noqa: E402

import torus.integrations.keras.horovod as hvd  # noqa: E402

B = 12  # global batch: divisible by 1, 2 and 3


def init_world():
    """``hvd.init()`` (collective; a no-op after the first), then ``MPI.COMM_WORLD`` for the oracles."""
    hvd.init()
    return MPI.COMM_WORLD


def digits(n: int, seed: int = 0):
    """``n`` scikit-learn digits as (n, 8, 8, 1) float32 in [0, 1] and int64 labels, the same on every rank."""
    from sklearn.datasets import load_digits
    data = load_digits()
    rows = np.random.default_rng(seed).permutation(len(data.target))[:n]
    return (data.images[rows, ..., None] / 16.0).astype(np.float32), data.target[rows].astype(np.int64)


def rank_rows(n_rows: int, size: int, rank: int, batch: int = B) -> np.ndarray:
    """Rows this rank feeds: its contiguous 1/size of every global batch of ``batch`` rows."""
    b = batch // size
    return np.concatenate([np.arange(k * batch + rank * b, k * batch + (rank + 1) * b)
                           for k in range(n_rows // batch)])


def mnist_model():
    """Horovod's MNIST example's layer types, shrunk (no dropout: the comparison must be deterministic)."""
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                             keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                             keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10, activation="softmax")])


def initial_weights(model, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(w.shape).astype(np.float32) * 0.3 for w in model.get_weights()]


class Record(keras.callbacks.Callback):
    """Weights before the first batch and after every batch."""

    def __init__(self):
        super().__init__()
        self.first, self.steps = None, []

    def on_train_batch_begin(self, batch, logs=None):
        if self.first is None:
            self.first = [np.array(w) for w in self.model.get_weights()]

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append([np.array(w) for w in self.model.get_weights()])


def assert_identical_across_ranks(world, arrays, what):
    blob = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    every = world.allgather(blob)
    assert all(x == every[0] for x in every), f"{what}: differs between ranks (rank {world.rank})"


def assert_close(got, want, what, tol=1e-5):
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"{what}, array {k}")
