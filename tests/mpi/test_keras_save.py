"""model.save / save_weights / export and keras.saving's functions under TorusStrategy (saving.py): called on
every rank, the file is written once, by rank 0, and every rank then loads rank 0's values; called on rank 0
alone, nothing hangs; rank 0's error is raised on every rank, as one process raises it.

The ranks save into one folder (rank 0's, broadcast), holding different weights when they save (rank r adds
r), so a file written by any other rank than 0 shows; the expected values are rank 0's ``get_weights()``,
broadcast with mpi4py. Keras' writers are counted per rank. Runs at 1, 2 and 3 ranks only.
"""
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras  # noqa: E402
import keras.src.export  # noqa: E402
from keras.src.legacy.saving import legacy_h5_format  # noqa: E402
from keras.src.saving import saving_lib  # noqa: E402
from keras.src.utils import io_utils  # noqa: E402
from kerasref import small_model as build  # noqa: E402

from torus.integrations.keras import TorusStrategy  # noqa: E402

B, N = 12, 24


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


@pytest.fixture
def writes(monkeypatch):
    """The names of Keras' file writers this rank called (save_model, save_weights_only, ...)."""
    calls = []
    for module, name in ((saving_lib, "save_model"), (saving_lib, "save_weights_only"),
                         (legacy_h5_format, "save_model_to_hdf5"), (keras.src.export, "export_saved_model")):
        def spy(*args, _original=getattr(module, name), _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    return calls


def diverge(world, model, offset=0.0):
    """Rank r's weights become its own plus r + offset; returns rank 0's (what the file must hold)."""
    model.set_weights([w + world.rank + offset for w in model.get_weights()])
    return world.bcast(model.get_weights(), root=0)


def load(path, strategy):
    if str(path).endswith(".weights.h5"):
        model = build(strategy)
        model.load_weights(path)
        return model.get_weights()
    return keras.models.load_model(path).get_weights()


def assert_weights(got, want, what):
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w, err_msg=what)


def listing(folder):
    return sorted(os.listdir(folder))


SAVES = {
    "model.save .keras": (lambda m, p: m.save(p), "m.keras", ["save_model"]),
    "keras.saving.save_model": (lambda m, p: keras.saving.save_model(m, p), "m.keras", ["save_model"]),
    "keras.models.save_model": (lambda m, p: keras.models.save_model(m, p), "m.keras", ["save_model"]),
    "model.save .h5": (lambda m, p: m.save(p), "m.h5", ["save_model_to_hdf5"]),
    "model.save_weights": (lambda m, p: m.save_weights(p), "w.weights.h5", ["save_weights_only"]),
    "keras.saving.save_weights": (lambda m, p: keras.saving.save_weights(m, p), "w.weights.h5",
                                  ["save_weights_only"]),
}


@pytest.mark.parametrize("how", SAVES)
def test_every_rank_saves_once_and_loads_rank_0s_values(world, strategy, shared, writes, how):
    save, name, writer = SAVES[how]
    model = build(strategy)
    want = diverge(world, model)
    save(model, shared / name)
    assert writes == (writer if world.rank == 0 else []), f"rank {world.rank} called Keras' writers {writes}"
    assert listing(shared) == [name]  # no temporary file left
    assert_weights(load(shared / name, strategy), want, f"{how}: rank {world.rank} loaded other values")


def test_same_function_objects_are_wrapped(strategy):
    assert keras.saving.save_model is keras.models.save_model
    assert hasattr(keras.saving.save_model, "_torus_original")
    assert hasattr(keras.saving.save_weights, "_torus_original")


@pytest.mark.skipif(not hasattr(keras.Model, "export"), reason="this Keras has no Model.export")
def test_export_writes_once(world, strategy, shared, writes):
    model = build(strategy)
    diverge(world, model)
    x = np.random.default_rng(1).standard_normal((4, 5)).astype(np.float32)
    want = world.bcast(np.asarray(model(x)), root=0)
    model.export(str(shared / "exported"), verbose=False)
    assert writes == (["export_saved_model"] if world.rank == 0 else [])
    assert listing(shared) == ["exported"]
    loaded = tf.saved_model.load(str(shared / "exported"))
    np.testing.assert_allclose(np.asarray(loaded.serve(x)), want, rtol=1e-6, atol=1e-6)
    world.Barrier()
    model.export(str(shared / "exported"), verbose=False)  # over an existing SavedModel: swapped in whole
    assert listing(shared) == ["exported"]


def test_chief_only_save_does_not_hang(world, strategy, shared):
    """Horovod's idiom: rank 0 alone saves, then (here) a barrier of the user's; the notices rank 0 leaves
    behind do not confuse a later save on every rank of the same path (after a fit)."""
    x = np.random.default_rng(0).standard_normal((N, 5)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 3, N)
    model = build(strategy)
    want = diverge(world, model)
    t0 = time.monotonic()
    if strategy.is_chief:
        model.save(shared / "m.keras")
        model.save_weights(shared / "w.weights.h5")
    assert time.monotonic() - t0 < 60
    world.Barrier()
    assert_weights(load(shared / "m.keras", strategy), want, "chief-only .keras")
    assert_weights(load(shared / "w.weights.h5", strategy), want, "chief-only .weights.h5")
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    want = diverge(world, model, offset=10.0)
    model.save(shared / "m.keras")  # every rank
    model.save_weights(shared / "w.weights.h5")
    assert_weights(load(shared / "m.keras", strategy), want, "every-rank .keras after chief-only saves")
    assert_weights(load(shared / "w.weights.h5", strategy), want, "every-rank .weights.h5 after chief-only saves")


class ChiefSaves(keras.callbacks.Callback):
    """A user callback in Horovod's style: rank 0 alone saves at every epoch's end."""

    def __init__(self, strategy, path):
        super().__init__()
        self.strategy, self.path = strategy, path

    def on_epoch_end(self, epoch, logs=None):
        if self.strategy.is_chief:
            self.model.save(self.path)


def test_chief_only_saves_inside_fit_then_every_rank_after(world, strategy, shared):
    """The notices of a callback's saves on rank 0 alone, inside fit, are skipped by the save on every rank
    of the same path after fit."""
    x = np.random.default_rng(0).standard_normal((N, 5)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 3, N)
    model = build(strategy)
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0,
              callbacks=[ChiefSaves(strategy, shared / "latest.keras")])
    want = diverge(world, model)
    model.save(shared / "latest.keras")
    assert_weights(load(shared / "latest.keras", strategy), want, "every-rank save after chief-only ones in fit")


@pytest.mark.parametrize("how,name", [("save", "missing/m.keras"), ("save_weights", "missing/w.weights.h5"),
                                      ("save", "m.h6"), ("save_weights", "w.h5")])
def test_errors_are_raised_on_every_rank_as_one_process_raises_them(world, strategy, shared, how, name):
    with pytest.raises(Exception) as one:  # a plain model: one process' error
        getattr(build(), how)(shared / name)
    model = build(strategy)
    with pytest.raises(type(one.value)) as got:
        getattr(model, how)(shared / name)
    if world.rank == 0:
        assert str(got.value) == str(one.value)
    else:
        assert "rank 0 failed" in str(got.value) and str(one.value) in str(got.value), str(got.value)
    assert listing(shared) == []


def test_relative_path_and_overwrite(world, strategy, shared, monkeypatch):
    monkeypatch.chdir(shared)
    model = build(strategy)
    want = diverge(world, model)
    model.save("rel.keras", overwrite=False)  # not there yet: written, no question asked
    assert_weights(load(shared / "rel.keras", strategy), want, "relative path")
    asked = []
    monkeypatch.setattr(io_utils, "ask_to_proceed_with_overwrite", lambda path: asked.append(path) or False)
    diverge(world, model, offset=10.0)
    model.save("rel.keras", overwrite=False)  # there: Keras' question, on rank 0 alone, answered "no"
    assert asked == (["rel.keras"] if world.rank == 0 else [])
    assert_weights(load("rel.keras", strategy), want, "not overwritten")
    assert listing(shared) == ["rel.keras"]


def test_per_rank_paths_are_written_by_their_rank(world, strategy, shared):
    """MultiWorkerMirroredStrategy's idiom: rank 0 saves the real path, the others a path of their own."""
    model = build(strategy)
    diverge(world, model)
    mine = model.get_weights()
    model.save(shared / f"m-{world.rank}.keras")
    assert_weights(load(shared / f"m-{world.rank}.keras", strategy), mine, "own path")
    world.Barrier()
    assert listing(shared) == sorted(f"m-{r}.keras" for r in range(world.size))
