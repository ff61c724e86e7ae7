"""Models created, compiled or loaded outside ``strategy.scope()`` and then fit while a TorusStrategy exists train
data-parallel (moved under the strategy, with a warning on the chief), matching one process on the global
batch; a model of another tf.distribute strategy and ``jit_compile=True`` (asked for, or Keras' "auto" on a
machine with a GPU, faked here) are refused on every rank with an error naming the rank.

Runs at 1, 2 and 3 ranks only.
"""
import warnings

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from kerasref import B, Record, assert_steps_match, data, dense_model, initial_weights  # noqa: E402

from torus.integrations.keras import TorusStrategy  # noqa: E402
from torus.integrations.keras.fit import fit_hook  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


def compile_(model, **kw):
    model.compile(keras.optimizers.SGD(0.3, momentum=0.5), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"], **kw)


def fit(model, x, y, batch):
    rec = Record()
    hist = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=[rec])
    return rec.steps, hist.history


def fit_moved(strategy, model):
    """Fit ``model`` (outside the scope) under the strategy; the chief must warn that it moved it."""
    x, y = data(seed=1, n=B * STEPS)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = fit(model, x, y, B)
    moved = [w for w in seen if "outside strategy.scope()" in str(w.message)]
    assert len(moved) == (1 if strategy.is_chief else 0)
    return got


def reference(model):
    x, y = data(seed=1, n=B * STEPS)
    with fit_hook.local():
        return fit(model, x, y, B)


def test_model_built_and_compiled_outside_the_scope(world, strategy):
    w0 = initial_weights(dense_model(), seed=2)
    ref = dense_model()
    ref.set_weights(w0)
    compile_(ref)
    ref_steps, ref_hist = reference(ref)
    model = dense_model()
    model.set_weights([w + strategy.rank for w in w0])
    compile_(model)
    steps, hist = fit_moved(strategy, model)
    assert_steps_match(world, steps, ref_steps, what="moved model step")
    assert hist["loss"] == pytest.approx(ref_hist["loss"], rel=1e-5)
    assert model.distribute_strategy is strategy


def test_loaded_model_continues_like_one_process(world, strategy, tmp_path):
    """A .keras file with optimizer state (momentum after a first fit), loaded outside the scope."""
    first = dense_model()
    first.set_weights(initial_weights(first, seed=3))
    compile_(first)
    x, y = data(seed=4, n=B * 2)
    with fit_hook.local():
        first.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / f"rank{world.rank}.keras"  # same contents on every rank
    first.save(path)
    ref = keras.models.load_model(path)
    ref_steps, ref_hist = reference(ref)
    model = keras.models.load_model(path)
    model.set_weights([w + strategy.rank for w in model.get_weights()])
    for v in model.optimizer.variables:
        if "momentum" in v.name:
            v.assign(np.asarray(v) + strategy.rank)
    steps, hist = fit_moved(strategy, model)
    assert_steps_match(world, steps, ref_steps, what="loaded model step")
    assert hist["accuracy"] == pytest.approx(ref_hist["accuracy"], rel=1e-5)


def test_model_of_another_strategy_is_refused(strategy):
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = dense_model()
        compile_(model)
    x, y = data(seed=5, n=B)
    with pytest.raises(ValueError, match=f"on rank {strategy.rank}: .*OneDeviceStrategy"):
        model.fit(x, y, batch_size=B, verbose=0)


def test_jit_compile_true_is_refused(strategy):
    with strategy.scope():
        model = dense_model()
        compile_(model, jit_compile=True)
    x, y = data(seed=6, n=B)
    for call in (lambda: model.fit(x, y, batch_size=B, verbose=0),
                 lambda: model.evaluate(x, y, batch_size=B, verbose=0)):
        with pytest.raises(ValueError, match=f"on rank {strategy.rank}: .*jit_compile=False"):
            call()


def test_jit_compile_auto_with_a_gpu(strategy, monkeypatch):
    """Keras' "auto" resolves to XLA on a machine with a GPU unless the model is compiled under a strategy."""
    devices = [tf.config.PhysicalDevice("/physical_device:CPU:0", "CPU"),
               tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")]
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [
        d for d in devices if kind is None or d.device_type == kind])
    x, y = data(seed=7, n=B)
    outside = dense_model()
    compile_(outside)
    assert outside.jit_compile
    with pytest.raises(ValueError, match=f"on rank {strategy.rank}: .*'auto'"):
        outside.fit(x, y, batch_size=B, verbose=0)
    with strategy.scope():
        inside = dense_model()
        compile_(inside)
    assert not inside.jit_compile
    inside.fit(x, y, batch_size=B, verbose=0)
