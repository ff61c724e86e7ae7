"""File callbacks under TorusStrategy with the same callback list on every rank: ModelCheckpoint, CSVLogger
and TensorBoard write on the chief only (each rank gets its own folder here, so a write by another rank would
show); BackupAndRestore backs up on the chief and a fit stopped by an exception and rerun with the same
command continues on every rank, ending where one uninterrupted process on the global batch ends.

No ``strategy.callbacks()``: models start equal on every rank by construction (same seed). Runs at 1, 2 and
3 ranks only.
"""
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras  # noqa: E402
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer  # noqa: E402
from kerasref import small_model as build  # noqa: E402

from torus.integrations.keras import TorusStrategy  # noqa: E402

B, N, EPOCHS = 12, 48, 4


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


@pytest.fixture
def tmp_path(world):
    """A folder of this rank's own (not pytest's, whose clean-up other processes may run meanwhile)."""
    folder = tempfile.mkdtemp(prefix=f"torus-files-rank{world.rank}-")
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def plain_fit(model, *args, **kwargs):
    fit = TensorFlowTrainer.fit
    return getattr(fit, "_torus_original", fit)(model, *args, **kwargs)


def data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((N, 5)).astype(np.float32), rng.integers(0, 3, N)


def files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def test_checkpoint_and_loggers_write_on_the_chief_only(world, strategy, tmp_path):
    x, y = data()
    model = build(strategy)
    callbacks = [keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt" / "model-{epoch}.keras")),
                 keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt" / "best.weights.h5"), monitor="loss",
                                                 save_best_only=True, save_weights_only=True),
                 keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
                 keras.callbacks.TensorBoard(str(tmp_path / "tb"))]
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    written = files(tmp_path)
    if strategy.is_chief:
        assert {"ckpt/model-1.keras", "ckpt/model-2.keras", "ckpt/best.weights.h5", "log.csv"} <= set(written)
        assert any(f.startswith("tb/train/") for f in written), written
        assert not any(os.path.basename(f).startswith(".torus-") for f in written), written  # no temp files
        saved = keras.models.load_model(tmp_path / "ckpt" / "model-2.keras")
        for a, b in zip(saved.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)
        assert len((tmp_path / "log.csv").read_text().splitlines()) == 3  # header and two epochs
    else:
        assert written == [], f"rank {strategy.rank} wrote {written}"


def test_tensorboard_per_rank_when_asked(world, strategy, tmp_path):
    x, y = data()
    model = build(strategy)
    model.fit(x, y, batch_size=B, epochs=1, verbose=0,
              callbacks=[keras.callbacks.TensorBoard(str(tmp_path / "tb-{rank}"))])
    assert any(f.startswith(f"tb-{strategy.rank}/train/") for f in files(tmp_path))


class StopAt(keras.callbacks.Callback):
    """Raises at the end of ``epoch`` (after the backup of that epoch was written), as a killed job would."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError(f"stopped after epoch {epoch}")


@pytest.mark.parametrize("shuffle", [False, True])
def test_backup_and_restore_resumes_on_every_rank(world, strategy, tmp_path, shuffle):
    """Each rank has its own backup folder: only the chief's is written, yet every rank resumes."""
    x, y = data()
    backup = str(tmp_path / "backup")

    def run(stop):
        np.random.seed(6)  # the same command: the same shuffle seed
        model = build(strategy)
        callbacks = [keras.callbacks.BackupAndRestore(backup)] + ([StopAt(stop)] if stop is not None else [])
        model.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=shuffle, verbose=0, callbacks=callbacks)
        return model

    with pytest.raises(RuntimeError, match="stopped after epoch 1"):
        run(stop=1)
    backed_up = files(backup)
    assert (backed_up != []) == strategy.is_chief, backed_up
    resumed = run(stop=None)
    assert int(resumed.optimizer.iterations) == EPOCHS * (N // B)  # the optimizer state was restored too
    assert not os.path.exists(backup)  # deleted at the end of a finished fit, by the chief
    if shuffle:
        want = run(stop=None)  # uninterrupted, same command
    else:
        want = build()
        plain_fit(want, x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
    got = resumed.get_weights()
    blob = b"".join(w.tobytes() for w in got)
    assert all(b == blob for b in world.allgather(blob)), "weights differ between ranks"
    for a, b in zip(got, want.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_unreadable_backup_fails_on_every_rank(world, strategy, tmp_path):
    """A corrupt backup on the chief ends fit on every rank with the reason (no rank left waiting)."""
    x, y = data()
    backup = tmp_path / "backup"
    if strategy.is_chief:
        backup.mkdir()
        (backup / "latest.weights.h5").write_bytes(b"not an HDF5 file")
    model = build(strategy)
    with pytest.raises(RuntimeError, match="rank 0 could not restore the backup"):
        model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(str(backup))])
