"""A model that overrides ``train_step`` / ``test_step`` the keras.io way (``compute_loss``, its own metric
updates, ``return {m.name: m.result() for m in self.metrics}``) logs global values under ``TorusStrategy``:
every metric as one process on the global batch computes it, other floating entries averaged over ranks, the
same bits on every rank (so History and callbacks agree); the loss tracked from ``compute_loss`` is, as under
every tf.distribute strategy, the global loss over the number of ranks (metrics.py). Against one process on the
global batch (``fit_hook.local()``), at any rank count whose size divides the global batch ``B``."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from kerasref import B, assert_identical_across_ranks, data, initial_weights  # noqa: E402

from torus.integrations.keras import TorusStrategy  # noqa: E402
from torus.integrations.keras.fit import fit_hook  # noqa: E402

EPOCHS = 3


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


class GuideModel(keras.Model):
    """The keras.io guide's custom steps, plus a non-metric entry: the batch's mean input."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        logs = {m.name: m.result() for m in self.metrics}
        logs["mean_x"] = tf.reduce_mean(x)
        return logs

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def build(w0=None):
    inputs = keras.Input((6,))
    model = GuideModel(inputs, keras.layers.Dense(3)(keras.layers.Dense(9, activation="tanh")(inputs)))
    if w0 is not None:
        model.set_weights(w0)
    model.compile(keras.optimizers.SGD(0.3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc"),
                           keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")])
    return model


class BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append({k: float(v) for k, v in logs.items()})


def run(model, x, y, xv, yv):
    batches = BatchLogs()
    history = model.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0, validation_data=(xv, yv),
                        callbacks=[batches])
    return history.history, batches.rows, model.evaluate(xv, yv, batch_size=B, verbose=0, return_dict=True)


def flat_logs(logs: dict) -> dict:
    """``evaluate``'s dict with Keras 3.12's nested ``compile_metrics`` entry spread out, as floats."""
    out = {}
    for k, v in logs.items():
        out.update({n: float(m) for n, m in v.items()} if isinstance(v, dict) else {k: float(v)})
    return out


def test_custom_step_logs_are_global(world, strategy):
    x, y = data(seed=21, n=4 * B)
    xv, yv = data(seed=22, n=2 * B)
    probe = build()
    w0 = initial_weights(probe, seed=23)
    with strategy.scope():
        model = build(w0)
    history, batches, evaluated = run(model, x, y, xv, yv)
    with fit_hook.local():
        ref_history, ref_batches, ref_evaluated = run(build(w0), x, y, xv, yv)

    size = strategy.size
    flat = [v for k in sorted(history) for v in history[k]] + [v for r in batches for k in sorted(r) for v in [r[k]]]
    assert_identical_across_ranks(world, [np.array(flat, np.float64)], "custom step logs")
    assert sorted(history) == sorted(ref_history)
    # Keras 3.12 keeps the guide's validation metrics out of History (the step returns them nested under
    # "compile_metrics"); later versions log val_acc / val_top2. Whatever one process logs must match.
    keys = [k for k in ("acc", "top2", "val_acc", "val_top2") if k in ref_history]
    assert {"acc", "top2"} <= set(keys), sorted(ref_history)
    for key in keys:  # metrics: exactly one process's (same counts)
        np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-6, err_msg=key)
    for key in ("loss", "val_loss"):  # compute_loss' loss is scaled by 1 / ranks (Keras under tf.distribute)
        np.testing.assert_allclose(np.array(history[key]) * size, ref_history[key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose([r["mean_x"] for r in batches], [r["mean_x"] for r in ref_batches], rtol=1e-5,
                               atol=1e-6, err_msg="mean_x: the ranks' batch means averaged = the global batch's")
    np.testing.assert_allclose([r["acc"] for r in batches], [r["acc"] for r in ref_batches], rtol=1e-6)
    evaluated, ref_evaluated = flat_logs(evaluated), flat_logs(ref_evaluated)
    np.testing.assert_allclose(evaluated["acc"], ref_evaluated["acc"], rtol=1e-6)
    np.testing.assert_allclose(evaluated["loss"] * size, ref_evaluated["loss"], rtol=1e-5)
