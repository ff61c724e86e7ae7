"""Snapshots inside ``fit`` and the resume from them (fit/snapshots.py, issue 42), as a user's script meets them:
the job has an id (``TORUS_JOB_ID``, which torus-run sets), training stops part-way on every rank (a lost rank
ends the job; here an exception on every rank stands for it, the snapshots already on disk), and the job runs
again on one rank fewer (K -> K - 1; 1 -> 1 at one rank), from the top of the script.

The oracle: the same script run to the end without a stop, on all K ranks (weights within float rounding:
the rank count changes the order of the gradient sum) and, for the skipped and resumed fits, the step count
and the batches trained. Runs at 1 to 4 ranks.
"""
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() > 4:
    pytest.skip("the snapshot tests run at 1 to 4 ranks", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras  # noqa: E402

import torus  # noqa: E402
from torus.integrations.keras import TorusStrategy  # noqa: E402

B, ROWS, EPOCHS = 24, 240, 3  # 10 steps per epoch; B splits over 1, 2, 3 and 4 ranks


class Stop(Exception):
    pass


class StopAt(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.step:
            raise Stop(f"stopped at step {self.step}")


@pytest.fixture
def job(world, monkeypatch):
    """A fresh job id and snapshot folder (rank 0's, shared: one host)."""
    folder = world.bcast(tempfile.mkdtemp(prefix="torus-snap-") if world.rank == 0 else None)
    monkeypatch.setenv("TORUS_SNAPSHOT_DIR", folder)
    monkeypatch.setenv("TORUS_JOB_ID", "job")
    yield folder
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


def data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((ROWS, 8)).astype("float32")
    return x, (x[:, :3].sum(axis=1) > 0).astype("int32")


class Logged(keras.callbacks.Callback):
    """Each epoch's logs as the run that stopped saw them: the oracle of the History a resumed run returns."""

    def __init__(self):
        super().__init__()
        self.epochs: list = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


def script(comm, callbacks=(), fits=1, batch_size=B, every=4, activation="tanh"):
    """The user's script: a model built under the scope, then ``fits`` fit calls of EPOCHS epochs each. A
    snapshot every ``every`` steps from the first step on (steps 1 + k * every). Returns the model and each
    fit's History (``history.history``)."""
    strategy = TorusStrategy(comm=torus.TorusComm(comm, timeout=60), snapshot_steps=every, snapshot_seconds=0)
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation=activation),
                                  keras.layers.Dense(2)])
        model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
    x, y = data()
    epochs_run = []
    for _ in range(fits):
        history = model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, verbose=0, callbacks=list(callbacks))
        epochs_run.append(history.history)
    if strategy.snapshots is not None:
        strategy.snapshots.store(next(iter(strategy.snapshots._stores))).wait()
    return model, epochs_run


_references: dict = {}


def reference_weights(world, monkeypatch, fits=1):
    """The final weights of the run that lost nothing, on all ranks, without snapshots (computed once)."""
    if fits not in _references:
        monkeypatch.delenv("TORUS_JOB_ID")
        _references[fits] = script(world, fits=fits)[0].get_weights()
    return _references[fits]


def survivors(world):
    """The ranks of the relaunch: all but the last (all at one rank)."""
    keep = world.rank < max(world.size - 1, 1)
    return world.Split(0 if keep else MPI.UNDEFINED, world.rank), keep


# A user callback runs before the snapshot's, so the stop at a due step comes before that step's snapshot.
@pytest.mark.parametrize("every, stop_at", [(4, 13), (4, 22), (3, 11)])  # snapshots at 9 and 21 (mid-epoch), 10
def test_resume_on_fewer_ranks_equals_the_run_that_lost_nothing(world, job, monkeypatch, every, stop_at):
    want = reference_weights(world, monkeypatch)
    monkeypatch.setenv("TORUS_JOB_ID", "lossy")
    logged = Logged()
    with pytest.raises(Stop):
        script(world, [logged, StopAt(stop_at)], every=every)
    snapped = max(s for s in range(1, stop_at, every))  # the newest snapshot
    before = snapped // (ROWS // B)  # epochs whole at the snapshot
    comm, keep = survivors(world)
    if keep:
        monkeypatch.setenv("TORUS_RESTART", "1")
        model, histories = script(comm, every=every)
        assert int(model.optimizer.iterations.numpy()) == EPOCHS * ROWS // B
        # the History holds every epoch: those before the snapshot as the stopped run logged them
        assert len(histories) == 1 and len(histories[0]["loss"]) == EPOCHS, histories
        assert histories[0]["loss"][:before] == [e["loss"] for e in logged.epochs[:before]]
        for got, expected in zip(model.get_weights(), want):
            np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)
        comm.Free()
    world.Barrier()


def test_earlier_fits_are_passed_over(world, job, monkeypatch):
    want = reference_weights(world, monkeypatch, fits=2)
    monkeypatch.setenv("TORUS_JOB_ID", "lossy")
    logged = Logged()
    with pytest.raises(Stop):
        script(world, [logged, StopAt(EPOCHS * ROWS // B + 6)], fits=2)  # in the second fit
    monkeypatch.setenv("TORUS_RESTART", "1")
    model, histories = script(world, fits=2)
    # the first fit ran no epoch, yet its History is the stopped run's; the second has all its epochs
    assert histories[0]["loss"] == [e["loss"] for e in logged.epochs[:EPOCHS]], histories
    assert len(histories[1]["loss"]) == EPOCHS
    for got, expected in zip(model.get_weights(), want):
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)


def plateau():
    """Callbacks whose state spans epochs: no epoch counts as an improvement (min_delta), so EarlyStopping
    stops at the end of epoch 2 and puts back epoch 0's weights, and ReduceLROnPlateau halves the rate then."""
    return [keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=10.0, restore_best_weights=True),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=2, min_delta=10.0)]


def test_callbacks_state_survives_the_resume(world, job, monkeypatch):
    monkeypatch.delenv("TORUS_JOB_ID")
    ref, _ = script(world, plateau())
    want, want_lr = ref.get_weights(), float(ref.optimizer.learning_rate.numpy())
    assert want_lr == pytest.approx(0.005)  # the oracle's own check: the rate was halved once
    monkeypatch.setenv("TORUS_JOB_ID", "lossy")
    with pytest.raises(Stop):
        script(world, [*plateau(), StopAt(22)])  # after the snapshot of step 21, in epoch 2
    comm, keep = survivors(world)
    if keep:
        monkeypatch.setenv("TORUS_RESTART", "1")
        model, _ = script(comm, plateau())
        assert float(model.optimizer.learning_rate.numpy()) == want_lr
        for got, expected in zip(model.get_weights(), want):  # epoch 0's, put back by EarlyStopping
            np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)
        comm.Free()
    world.Barrier()


def test_a_changed_model_with_the_same_variables_starts_fresh(world, job, monkeypatch, capfd):
    # the same job id and variable shapes, another activation: the old snapshots are another model's
    with pytest.raises(Stop):
        script(world, [StopAt(14)])
    monkeypatch.setenv("TORUS_RESTART", "1")
    model, histories = script(world, activation="relu")
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * ROWS // B and len(histories[0]["loss"]) == EPOCHS
    assert "torus-run: resumed at step" not in capfd.readouterr().err


def test_another_global_batch_is_refused(world, job):
    with pytest.raises(Stop):
        script(world, [StopAt(6)])
    with pytest.raises(ValueError, match="batch_size=24"):
        script(world, batch_size=2 * B)


def loop(comm, stop_at=None, steps=30, activation="tanh"):
    """A custom training loop (tf.distribute's contract) with strategy.resume / strategy.snapshot."""
    strategy = TorusStrategy(comm=torus.TorusComm(comm, timeout=60), snapshot_steps=4, snapshot_seconds=0)
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation=activation),
                                  keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = data()
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(B))
    state = list(model.variables) + list(optimizer.variables)

    @tf.function
    def step(batch):
        def replica(features, labels):
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(features, training=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        strategy.run(replica, args=batch)

    resumed = strategy.resume(state, model=model)
    start = 0 if resumed is None else resumed["step"]
    iterator = iter(dataset.skip(start))  # the loop's own data position: batch i is step i's
    for i in range(start, steps):
        step(next(iterator))
        if i + 1 == stop_at:
            raise Stop(f"stopped at step {stop_at}")
        strategy.snapshot(state, i + 1, batch=i + 1)
    if strategy.snapshots is not None:
        strategy.snapshots.store(next(iter(strategy.snapshots._stores))).wait()
    return model, start


def test_a_custom_loop_resumes_on_fewer_ranks(world, job, monkeypatch):
    monkeypatch.delenv("TORUS_JOB_ID")  # the run that lost nothing takes no snapshot
    reference, _ = loop(world)
    monkeypatch.setenv("TORUS_JOB_ID", "lossy")
    with pytest.raises(Stop):
        loop(world, stop_at=15)
    comm, keep = survivors(world)
    if keep:
        monkeypatch.setenv("TORUS_RESTART", "1")
        model, start = loop(comm)
        assert start == 13  # snapshots after steps 1 + 4k (the first counts from step 1): the newest below 15
        for got, expected in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)
        comm.Free()
    world.Barrier()


def test_a_custom_loop_with_a_changed_model_starts_fresh(world, job, monkeypatch, capfd):
    # strategy.resume(state, model=model): the layers' configurations key the snapshots, as under fit
    monkeypatch.delenv("TORUS_JOB_ID")
    reference, _ = loop(world, activation="relu")
    monkeypatch.setenv("TORUS_JOB_ID", "changed")
    with pytest.raises(Stop):
        loop(world, stop_at=15)
    monkeypatch.setenv("TORUS_RESTART", "1")
    model, start = loop(world, activation="relu")
    assert start == 0 and "torus-run: resumed at step" not in capfd.readouterr().err
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)
