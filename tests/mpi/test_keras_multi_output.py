"""A two-output model's per-output losses and metrics, in training, validation and ``evaluate``, equal one
process's on the global batch when the validation rows split unevenly over the ranks (41 and 37 rows at global
batch 12: the last batch is 5 or 1 rows, so some rank has fewer rows, or none), and are the same bits on every
rank. Keras tracks each output's loss per batch unweighted by its rows (metrics.py): the reference is one
process, computed in this process (``fit_hook.local()``)."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from kerasref import B, assert_identical_across_ranks, initial_weights  # noqa: E402

from torus.integrations.keras import TorusStrategy  # noqa: E402
from torus.integrations.keras.fit import fit_hook  # noqa: E402


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


def arrays(seed, n):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 5)).astype(np.float32),
            {"a": rng.standard_normal((n, 1)).astype(np.float32), "b": rng.integers(0, 3, n)})


def build(w0=None):
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(hidden),
                                 "b": keras.layers.Dense(3, name="b")(hidden)})
    if w0 is not None:
        model.set_weights(w0)
    model.compile(keras.optimizers.SGD(0.1), jit_compile=False,
                  loss={"a": "mse", "b": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
                  loss_weights={"a": 0.5, "b": 1.0}, metrics={"a": ["mae"], "b": ["accuracy"]})
    return model


def run(model, x, y, xv, yv):
    history = model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, validation_data=(xv, yv))
    return history.history, model.evaluate(xv, yv, batch_size=B, verbose=0, return_dict=True)


@pytest.mark.parametrize("val_rows", [41, 37])
def test_per_output_losses_match_one_process(world, strategy, val_rows):
    x, y = arrays(41, 8 * B)
    xv, yv = arrays(42, val_rows)
    w0 = initial_weights(build(), seed=43)
    with strategy.scope():
        model = build(w0)
    history, evaluated = run(model, x, y, xv, yv)
    with fit_hook.local():
        ref_history, ref_evaluated = run(build(w0), x, y, xv, yv)
    assert sorted(history) == sorted(ref_history)
    assert {"a_loss", "b_loss", "val_a_loss", "val_b_loss"} <= set(history)
    for key in sorted(history):
        np.testing.assert_allclose(history[key], ref_history[key], rtol=2e-6, atol=1e-7, err_msg=key)
    for key in sorted(ref_evaluated):
        np.testing.assert_allclose(evaluated[key], ref_evaluated[key], rtol=2e-6, atol=1e-7, err_msg=key)
    flat = [v for k in sorted(history) for v in history[k]] + [evaluated[k] for k in sorted(evaluated)]
    assert_identical_across_ranks(world, [np.array(flat, np.float64)], "per-output logs")
