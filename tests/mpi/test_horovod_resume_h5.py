"""Resuming Horovod's way (rank 0 loads the checkpoint, the others build the model, the broadcast callback gives
them rank 0's state) from an ``.h5`` file: Keras 3.15 loads its optimizer built for no variables, so the ranks'
variable lists differ. The error must say that, on every rank, and not blame the user's model; a real model
mismatch keeps its own message, now naming the first variable that differs."""
import tempfile
from contextlib import nullcontext
from pathlib import Path

import pytest
from hvd_common import B, digits, hvd, init_world, keras, mnist_model, rank_rows
from mpi4py import MPI

from torus.errors import MismatchError

LOSS = keras.losses.SparseCategoricalCrossentropy


@pytest.fixture(scope="module")
def hvd_world():
    return init_world()


def _compiled(model):
    model.compile(loss=LOSS(), optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), jit_compile=False)
    return model


def _fit(model, x, y):
    rows = rank_rows(len(x), hvd.size(), hvd.rank())
    model.fit(x[rows], y[rows], batch_size=B // hvd.size(), epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])


def _saved_on_rank_0(world, suffix):
    x, y = digits(2 * B, seed=21)
    model = _compiled(mnist_model())
    _fit(model, x, y)
    path = Path(world.bcast(tempfile.mkdtemp() if world.rank == 0 else None)) / f"checkpoint-1{suffix}"
    if world.rank == 0:
        model.save(path)
    hvd.barrier()
    return path, x, y


def _resume(world, path):
    """Horovod's keras_imagenet_resnet50.py: ``if resume_from_epoch > 0 and hvd.rank() == 0: model =
    hvd.load_model(...)``, else a fresh model compiled with a DistributedOptimizer."""
    if world.rank == 0:
        with pytest.warns(UserWarning, match="no slot variables") if path.suffix == ".h5" else nullcontext():
            return hvd.load_model(path)
    return _compiled(mnist_model())


def test_h5_optimizer_without_slots_is_named_on_every_rank(hvd_world):
    if hvd_world.size == 1:
        pytest.skip("needs 2 ranks or more: only rank 0 loads the .h5, the others build their optimizer")
    path, x, y = _saved_on_rank_0(hvd_world, ".h5")
    model = _resume(hvd_world, path)
    with pytest.raises(MismatchError) as caught:
        _fit(model, x, y)
    text = str(caught.value)
    assert f"on rank {hvd_world.rank}" in text and "on rank(s) [0] says it is built but holds no slot" in text
    assert ".h5" in text and ".keras" in text and f"Keras {keras.__version__}" in text
    assert "build the same model" not in text
    # every rank raised (a rank that passed would now hang here instead of reaching the allgather)
    assert hvd_world.allgather(True) == [True] * hvd_world.size


def test_h5_load_warns_at_any_rank_count(hvd_world):
    """The loader itself says what Keras did (every rank loads here, so no broadcast mismatch follows)."""
    path, _, _ = _saved_on_rank_0(hvd_world, ".h5")
    with pytest.warns(UserWarning, match=r"says it is built but holds no slot variables.*\.keras"):
        model = hvd.load_model(path)
    assert model.optimizer.built and len(model.optimizer.variables) == 2  # iteration and learning rate only


def test_keras_file_resumes_without_error(hvd_world):
    path, x, y = _saved_on_rank_0(hvd_world, ".keras")
    model = _resume(hvd_world, path)
    _fit(model, x, y)
    weights = model.get_weights()
    every = hvd_world.allgather([w.tobytes() for w in weights])
    assert all(e == every[0] for e in every)


def test_a_real_model_mismatch_keeps_blaming_the_model(hvd_world):
    if hvd_world.size == 1:
        pytest.skip("needs 2 ranks or more: one rank builds another model")
    x, y = digits(B, seed=22)
    width = 16 if hvd_world.rank == 0 else 17
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(width),
                              keras.layers.Dense(10)])
    model = _compiled(model)
    with pytest.raises(MismatchError) as caught:
        _fit(model, x, y)
    text = str(caught.value)
    assert "build the same model and optimizer on every rank" in text and "slot" not in text
    assert "first difference: variable 0 is" in text and "(64, 17)" in text and "(64, 16)" in text
    MPI.COMM_WORLD.Barrier()
