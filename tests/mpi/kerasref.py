"""Shared pieces of the Keras fit tests (test_keras_callbacks, precision, adopt, files, save...): data, models, a
per-step weight recorder, and the checks against one process on the global batch.

The reference runs on every rank: a plain Keras model (no strategy, inside ``fit_hook.local()``) fit on the
same arrays with the same global batch, initial weights, optimizer and callbacks. The distributed run is plain
user code too: the same arrays and ``batch_size`` (the global batch; each rank trains on its contiguous 1/size
of every batch).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras  # noqa: E402

B = 12  # global batch: divisible by 1, 2 and 3 ranks


def data(seed: int, n: int, features: int = 6, classes: int = 3):
    """Random float32 inputs and integer labels, the same on every rank."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, features)).astype(np.float32), rng.integers(0, classes, n)


def dense_model(features: int = 6, outputs: int = 3):
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(9, activation="tanh"),
                             keras.layers.Dense(outputs)])


def small_model(strategy=None):
    """A seeded, compiled 5 -> 6 -> 3 classifier (SGD with momentum), under ``strategy``'s scope if given."""
    def make():
        keras.utils.set_random_seed(4)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        return model
    if strategy is None:
        return make()
    with strategy.scope():
        return make()


VOCAB, LENGTH = 40, 5


class DensifyingModel(keras.Sequential):
    """One process whose step makes every gradient dense before the optimizer (the reference for
    ``sparse_as_dense=True``)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, self.trainable_variables)]
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def embedding_model(w0, cls=keras.Sequential):
    """Embedding -> pooling -> Dense, Adam (which updates a sparse gradient row by row); weights ``w0`` if given."""
    model = cls([keras.Input((LENGTH,), dtype="int32"), keras.layers.Embedding(VOCAB, 4),
                 keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    if w0 is not None:
        model.set_weights(w0)
    model.compile(keras.optimizers.Adam(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model


def token_data(seed, n):
    """``n`` rows of ``LENGTH`` token ids (few distinct ones) and 3-class labels, the same on every rank."""
    rng = np.random.default_rng(seed)  # few ids: many rows repeat within a batch and across ranks
    return rng.integers(0, VOCAB // 4, (n, LENGTH)).astype(np.int32), rng.integers(0, 3, n)


def initial_weights(model, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(w.shape).astype(np.float32) * 0.5 for w in model.get_weights()]


class Record(keras.callbacks.Callback):
    """Weights after every step."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append([np.array(w) for w in self.model.get_weights()])


def assert_identical_across_ranks(world, arrays, what: str) -> None:
    blob = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    every = world.allgather(blob)
    assert all(x == every[0] for x in every), f"{what}: differs between ranks (seen on rank {world.rank})"


def assert_steps_match(world, steps, ref_steps, atol: float = 1e-5, what: str = "step") -> None:
    """Same number of steps; each step's weights bitwise equal across ranks and within ``atol`` of one
    process."""
    assert len(steps) == len(ref_steps), f"{what}: {len(steps)} steps, one process took {len(ref_steps)}"
    for k, (got, want) in enumerate(zip(steps, ref_steps)):
        assert_identical_across_ranks(world, got, f"{what} {k}")
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=atol, atol=atol, err_msg=f"{what} {k}")
