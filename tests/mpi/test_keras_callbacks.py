"""Plain Keras callbacks under TorusStrategy, no ``strategy.callbacks()``: the initial broadcast and global
metrics happen inside fit / evaluate / predict, so History, EarlyStopping, ReduceLROnPlateau and CSVLogger see
the values one process on the global batch sees, on every rank, and every rank stops at the same epoch with the
same learning rate. Metrics include AUC and Precision (states that are not means).

Runs at 1, 2 and 3 ranks only (TensorFlow is heavy on the 2-core test machine).
"""
import csv

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from kerasref import B, Record, assert_identical_across_ranks, assert_steps_match, data, dense_model, initial_weights  # noqa: E402

from torus.integrations.keras import TorusStrategy  # noqa: E402
from torus.integrations.keras.fit import fit_hook  # noqa: E402

EPOCHS, STEPS = 6, 3


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


def binary_data(seed, n):
    x, _ = data(seed, n)
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.float32)


def compile_(model):
    model.compile(keras.optimizers.SGD(0.2, momentum=0.5), keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy(threshold=0.0), keras.metrics.AUC(from_logits=True, name="auc"),
                           keras.metrics.Precision(thresholds=0.0, name="precision")])


def user_callbacks(min_delta_val, min_delta_loss, csv_path):
    # Listed before and after History-reading callbacks on purpose: the order must not matter.
    return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=min_delta_val),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=min_delta_loss),
            keras.callbacks.CSVLogger(str(csv_path))]


def fit(model, x, y, xv, yv, batch, callbacks):
    rec = Record()
    hist = model.fit(x, y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0,
                     validation_data=(xv, yv), callbacks=[rec] + callbacks)
    return rec.steps, hist.history


def reference(w0, x, y, xv, yv, callbacks):
    model = dense_model(outputs=1)
    model.set_weights(w0)
    compile_(model)
    with fit_hook.local():
        return (*fit(model, x, y, xv, yv, B, callbacks), model)


def midway(series):
    """A min_delta that the 2nd improvement of ``series`` (decreasing) falls short of and the 1st exceeds, so
    the plateau callbacks act in the middle of the run, not at its ends."""
    gains = -np.diff(series)
    return float(np.sort(gains[:3])[1:].mean()) if len(gains) >= 3 else 0.0


def test_plateau_callbacks_and_history_match_one_process(world, strategy, tmp_path):
    x, y = binary_data(0, B * STEPS)
    xv, yv = binary_data(7, 31)
    w0 = initial_weights(dense_model(outputs=1), seed=1)
    _, probe, _ = reference(w0, x, y, xv, yv, [])
    dv, dl = midway(probe["val_loss"]), midway(probe["loss"])
    ref_steps, ref_hist, _ = reference(w0, x, y, xv, yv,
                                               user_callbacks(dv, dl, tmp_path / f"ref{world.rank}.csv"))
    assert len(ref_hist["loss"]) < EPOCHS or min(ref_hist["learning_rate"]) < 0.2, "plateau never reached"

    with strategy.scope():
        model = dense_model(outputs=1)
        model.set_weights([w + strategy.rank for w in w0])  # the broadcast must undo this
        compile_(model)
        model.optimizer.build(model.trainable_variables)
        opt = model.optimizer  # and this: rank 0's optimizer state is a fresh one's
        for v in [opt.iterations] + [v for v in opt.variables if "momentum" in v.name]:
            v.assign(np.full(v.shape, strategy.rank, v.dtype))
    csv_path = tmp_path / f"rank{world.rank}.csv"  # 31 validation rows: uneven shares, counts must weigh
    steps, hist = fit(model, x, y, xv, yv, B, user_callbacks(dv, dl, csv_path))

    assert_steps_match(world, steps, ref_steps)
    assert sorted(hist) == sorted(ref_hist)
    for key, values in hist.items():
        assert values == pytest.approx(ref_hist[key], rel=1e-5, abs=1e-6), key
        assert_identical_across_ranks(world, [np.array(values)], f"history {key}")
    if not strategy.is_chief:  # CSVLogger writes on the chief only (files.py)
        assert not csv_path.exists()
        return
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(ref_hist["loss"])
    for key in ("loss", "val_auc", "learning_rate"):
        assert [float(r[key]) for r in rows] == pytest.approx(ref_hist[key], rel=1e-5, abs=1e-6), key


def test_evaluate_and_predict_are_global(world, strategy):
    x, y = binary_data(3, 31)
    w0 = initial_weights(dense_model(outputs=1), seed=4)
    ref = dense_model(outputs=1)
    ref.set_weights(w0)
    compile_(ref)
    with fit_hook.local():
        want = ref.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
        want_list = ref.evaluate(x, y, batch_size=4, verbose=0)
        want_rows = ref.predict(x, verbose=0)
    with strategy.scope():
        model = dense_model(outputs=1)
        model.set_weights([w + strategy.rank for w in w0])  # evaluate must use rank 0's weights
        compile_(model)
    got = model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
    for key in ("loss", "binary_accuracy", "auc", "precision"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), f"evaluate {key}"
    listed = model.evaluate(x, y, batch_size=4, verbose=0)
    assert listed == pytest.approx(want_list, rel=1e-5, abs=1e-6)
    model.set_weights([w + strategy.rank for w in w0])
    np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0), want_rows,
                               rtol=1e-6, atol=1e-6)
