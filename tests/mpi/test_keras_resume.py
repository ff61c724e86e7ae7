"""Batch-size control under TorusStrategy: a run stopped after epoch 2 and resumed from a .keras checkpoint
(written by the chief only) ends with the same weights, global batch and learning rate as an uninterrupted run.

Runs at 1, 2 and 3 ranks only. Took 70 s at 3 ranks (28 CPU-seconds) while the 2-core
machine ran at a load average of 16.
"""
import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras  # noqa: E402

from torus.integrations.keras import LARS, BatchControl, BatchSizeSchedule, LearningRateRule, TorusStrategy  # noqa: E402

EPOCHS, N = 4, 36
SCHEDULE = BatchSizeSchedule("0:6,2:12")  # both divisible by 1, 2 and 3 ranks
RULE = LearningRateRule(0.3, base_batch=6, warmup_epochs=1, decay="poly", total_epochs=EPOCHS)


def train(strategy, model, x, y, initial_epoch, epochs):
    control = BatchControl(SCHEDULE, RULE, lambda e: SCHEDULE.steps_per_epoch(e, N))
    logs = {}
    for start, stop, global_batch in SCHEDULE.segments(epochs, initial_epoch):
        hist = model.fit(x, y, batch_size=global_batch,  # the global batch: each rank trains on its share
                         initial_epoch=start, epochs=stop, shuffle=False, verbose=0,
                         callbacks=strategy.callbacks() + [control])
        logs = {k: v[-1] for k, v in hist.history.items()}
    return logs


def fresh(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(11)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(LARS(learning_rate=0.0, trust_coefficient=0.02, weight_decay=1e-4),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    return model


def test_resume_matches_uninterrupted(world, tmp_path):
    strategy = TorusStrategy()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((N, 5)).astype(np.float32), rng.integers(0, 3, N)

    straight = fresh(strategy)
    train(strategy, straight, x, y, 0, 2)
    path = world.bcast(str(tmp_path / "ckpt.keras"))
    if strategy.is_chief:
        straight.save(path)
    world.Barrier()
    logs = train(strategy, straight, x, y, 2, EPOCHS)  # the uninterrupted run goes on

    with strategy.scope():
        resumed = keras.models.load_model(path)
    resumed_logs = train(strategy, resumed, x, y, 2, EPOCHS)

    assert resumed_logs["global_batch"] == logs["global_batch"] == 12
    last_epoch_lr = RULE.lr(EPOCHS - 1 + 2 / 3, 12)  # last of 3 steps in epoch 3
    assert resumed_logs["learning_rate"] == pytest.approx(logs["learning_rate"], rel=1e-6)
    assert logs["learning_rate"] == pytest.approx(last_epoch_lr, rel=1e-6)
    assert int(resumed.optimizer.iterations) == int(straight.optimizer.iterations) == 2 * 6 + 2 * 3
    for a, b in zip(resumed.get_weights(), straight.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
