"""What rank 0 writes alone, every rank reads afterwards: ``fit`` returns only once rank 0's
``ModelCheckpoint`` file is in place (also when only rank 0 passes the callback, Horovod's habit), and
``strategy.barrier()`` / ``hvd.barrier()`` order a chief-only ``model.save`` before a load on every rank.
Rank 0 is made slow before it writes, so a rank that did not wait would look for the file too early. Each
loaded model is compared with the trained one (rank 0's weights, equal on every rank). Runs at 1-3 ranks."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from kerasref import B, data, small_model  # noqa: E402

import torus.integrations.keras.horovod as hvd  # noqa: E402
from torus.integrations.keras import TorusStrategy  # noqa: E402

SLOW_S = 1.0  # rank 0's delay before it writes: far longer than the other ranks need to reach their load


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


@pytest.fixture
def folder(world):
    made = tempfile.mkdtemp(prefix="torus-barrier-") if world.rank == 0 else None
    return Path(world.bcast(made))


class SlowChief(keras.callbacks.Callback):
    """Placed before ModelCheckpoint: rank 0 sleeps at the end of each epoch before the checkpoint is written."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def on_epoch_end(self, epoch, logs=None):
        if self.rank == 0:
            time.sleep(SLOW_S)


def _same_weights(a, b):
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("everywhere", [True, False], ids=["every-rank", "rank-0-only"])
def test_checkpoint_is_in_place_when_fit_returns(world, strategy, folder, everywhere):
    x, y = data(seed=61, n=2 * B, features=5)
    model = small_model(strategy)
    path = folder / f"ckpt-{everywhere}.keras"
    callbacks = [SlowChief(world.rank)]
    if everywhere or world.rank == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint(str(path)))
    model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=callbacks)
    _same_weights(keras.models.load_model(path), model)  # every rank, right after fit


def test_strategy_barrier_orders_a_chief_only_save(world, strategy, folder):
    x, y = data(seed=62, n=2 * B, features=5)
    model = small_model(strategy)
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    path = folder / "chief.keras"
    if strategy.is_chief:
        time.sleep(SLOW_S)
        model.save(path)
    strategy.barrier()
    _same_weights(keras.models.load_model(path), model)


def test_hvd_barrier_orders_a_chief_only_write(world, folder):
    hvd.init()
    path = folder / "hvd.npy"
    if hvd.rank() == 0:
        time.sleep(SLOW_S)
        np.save(path, np.arange(5))
    hvd.barrier()
    np.testing.assert_array_equal(np.load(path), np.arange(5))
