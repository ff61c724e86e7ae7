"""hvd.callbacks against their closed forms: the warm-up and schedule learning rates per batch and epoch,
momentum correction against a numpy replay of Horovod's rule, the sample-weighted metric average, and the
broadcast that makes differing initial states equal before the first update."""
from contextlib import nullcontext

import numpy as np
import pytest
from hvd_common import assert_close, assert_identical_across_ranks, hvd, init_world, keras


@pytest.fixture(scope="module")
def hvd_world():
    return init_world()


def linear_model(w0=None):
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    if w0 is not None:
        model.set_weights(w0)
    return model


def linear_data(n, seed=0):
    rng = np.random.default_rng(seed)  # the same on every rank
    return rng.standard_normal((n, 5)).astype(np.float32), rng.standard_normal((n, 3)).astype(np.float32)


class LearningRates(keras.callbacks.Callback):
    """The learning rate each batch runs with (read after the schedule callbacks placed before this one)."""

    def __init__(self):
        super().__init__()
        self.seen, self.epoch = [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append((self.epoch, batch, float(np.asarray(self.model.optimizer.learning_rate))))


def fit(callbacks, optimizer, epochs, steps, per_rank_batch=2, seed=0):
    """Linear regression on this rank's shard, ``steps`` batches per epoch."""
    n, rank = hvd.size(), hvd.rank()
    x, y = linear_data(per_rank_batch * n * steps, seed)
    rows = np.arange(len(x)).reshape(steps, n, per_rank_batch)[:, rank].reshape(-1)
    model = linear_model([w.astype(np.float32) for w in (np.full((5, 3), 0.1), np.zeros(3))])
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer), loss="mse", jit_compile=False)
    hist = model.fit(x[rows], y[rows], batch_size=per_rank_batch, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), *callbacks])
    return model, hist.history, (x, y)


def test_warmup_learning_rate_per_batch(hvd_world):
    n, steps, lr0, warmup = hvd.size(), 3, 0.2, 2
    seen = LearningRates()
    _, hist, _ = fit([hvd.callbacks.LearningRateWarmupCallback(lr0, warmup_epochs=warmup), seen],
                     keras.optimizers.SGD(lr0), epochs=3, steps=steps)
    for epoch, batch, lr in seen.seen:
        e = min(epoch + (batch + 1) / steps, warmup)  # after the warm-up the last value (lr0) stays
        assert lr == pytest.approx(lr0 / n * (e * (n - 1) / warmup + 1), rel=1e-6), (epoch, batch)
    assert hist["lr"] == pytest.approx([lr0 / n * ((n - 1) / warmup + 1), lr0, lr0], rel=1e-6)


def test_schedule_staircase_and_smooth(hvd_world):
    steps, lr0 = 2, 0.1
    seen = LearningRates()
    fit([hvd.callbacks.LearningRateScheduleCallback(lr0, 0.5, start_epoch=1, end_epoch=3), seen],
        keras.optimizers.SGD(0.3), epochs=4, steps=steps)
    want = {0: 0.3, 1: lr0, 2: lr0 * 0.5, 3: lr0 * 0.5}  # before start: untouched; after end: kept
    for epoch, batch, lr in seen.seen:
        assert lr == pytest.approx(want[epoch], rel=1e-6), (epoch, batch)
    seen = LearningRates()
    fit([hvd.callbacks.LearningRateScheduleCallback(lr0, lambda e: 1 + e, staircase=False), seen],
        keras.optimizers.SGD(0.3), epochs=2, steps=steps)
    for epoch, batch, lr in seen.seen:
        assert lr == pytest.approx(lr0 * (1 + epoch + batch / steps), rel=1e-6), (epoch, batch)


def test_warmup_momentum_correction_matches_horovods_rule(hvd_world):
    """Replay in numpy: each step uses momentum mu * lr_new / lr_old (Horovod's rule), then mu again."""
    n, steps, epochs, lr0, mu, b = hvd.size(), 3, 2, 0.05, 0.9, 2
    seen = LearningRates()
    model, _, (x, y) = fit([hvd.callbacks.LearningRateWarmupCallback(lr0, warmup_epochs=1), seen],
                           keras.optimizers.SGD(lr0, momentum=mu), epochs=epochs, steps=steps, per_rank_batch=b)
    w, bias = np.full((5, 3), 0.1), np.zeros(3)
    vw, vb, old = np.zeros_like(w), np.zeros_like(bias), lr0
    for k in range(epochs * steps):
        xs, ys = x[k % steps * n * b:(k % steps + 1) * n * b], y[k % steps * n * b:(k % steps + 1) * n * b]
        r = xs @ w + bias - ys
        gw, gb = 2 * xs.T @ r / r.size, 2 * r.sum(0) / r.size  # d mean((xW + b - y)^2), global batch
        epoch, batch = divmod(k, steps)
        lr = lr0 / n * ((epoch + (batch + 1) / steps) * (n - 1) + 1) if epoch < 1 else old
        assert seen.seen[k][2] == pytest.approx(lr, rel=1e-6)
        m = mu * lr / old
        vw, vb = m * vw - lr * gw, m * vb - lr * gb
        w, bias, old = w + vw, bias + vb, lr
    assert_identical_across_ranks(hvd_world, model.get_weights(), "momentum-corrected weights")
    assert_close(model.get_weights(), [w, bias], "momentum-corrected weights vs numpy")


class RawLogs(keras.callbacks.Callback):
    """Copies this rank's epoch logs before MetricAverageCallback (placed after this one) averages them."""

    def on_epoch_end(self, epoch, logs=None):
        self.logs = dict(logs)


def test_metric_average_is_sample_weighted(hvd_world):
    """Rank r trains on 3 batches of r + 1 rows and validates on 2 + 3 r rows: uneven counts."""
    n, rank = hvd.size(), hvd.rank()
    x, y = linear_data(200, seed=5)
    train = np.arange(3 * sum(range(1, n + 1)))
    mine = np.split(train, np.cumsum([3 * (r + 1) for r in range(n)])[:-1])[rank]
    val_counts = [2 + 3 * r for r in range(n)]
    val = np.split(np.arange(100, 100 + sum(val_counts)), np.cumsum(val_counts)[:-1])
    model = linear_model([np.full((5, 3), 0.1, np.float32), np.zeros(3, np.float32)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse",
                  metrics=["mae"], jit_compile=False)
    raw = RawLogs()
    hist = model.fit(x[mine], y[mine], batch_size=rank + 1, epochs=1, shuffle=False, verbose=0,
                     validation_data=(x[val[rank]], y[val[rank]]),
                     callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), raw,
                                hvd.callbacks.MetricAverageCallback()]).history
    every = hvd_world.allgather(raw.logs)
    for key, counts in [("loss", [3 * (r + 1) for r in range(n)]), ("mae", [3 * (r + 1) for r in range(n)]),
                        ("val_loss", val_counts), ("val_mae", val_counts)]:
        want = sum(c * logs[key] for c, logs in zip(counts, every)) / sum(counts)
        assert hist[key][0] == pytest.approx(want, rel=1e-6), key
    rows = np.concatenate(val)
    oracle = model.evaluate(x[rows], y[rows], batch_size=7, verbose=0, return_dict=True)
    assert hist["val_loss"][0] == pytest.approx(oracle["loss"], rel=1e-5)
    assert hist["val_mae"][0] == pytest.approx(oracle["mae"], rel=1e-5)


def test_broadcast_makes_differing_states_equal_before_step_one(hvd_world):
    n, rank = hvd.size(), hvd.rank()
    root = n - 1
    w0 = [np.full((5, 3), 0.1, np.float32), np.zeros(3, np.float32)]
    model = linear_model([w + rank for w in w0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    opt.build(model.trainable_variables)
    opt.iterations.assign(7 * rank)
    local = model.layers[0].bias
    first = {}

    class First(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            first.setdefault("w", [np.array(v) for v in self.model.get_weights()])
            first.setdefault("it", int(self.model.optimizer.iterations))

    x, y = linear_data(4 * n, seed=6)
    model.fit(x[rank::n], y[rank::n], batch_size=2, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=[local]), First()])
    assert_close(first["w"][:1], [w0[0] + root], "kernel from the root", tol=0)
    assert_close(first["w"][1:], [w0[1] + rank], "local bias kept", tol=0)
    assert first["it"] == 7 * root


def test_broadcast_of_a_model_built_lazily_follows_the_first_batch(hvd_world):
    """A Sequential without keras.Input has no variables when fit starts (Keras builds it while tracing the
    first step, without a distribution strategy): the callback then broadcasts after batch 0, as Horovod."""
    n, rank = hvd.size(), hvd.rank()
    root = n - 1
    keras.utils.set_random_seed(100 + rank)  # different initial weights on every rank
    model = keras.Sequential([keras.layers.Dense(3)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse", jit_compile=False)
    seen = {}

    class Before(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.setdefault("before", [np.array(v) for v in self.model.get_weights()])

    class After(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.setdefault("after", [np.array(v) for v in self.model.get_weights()])

    x, y = linear_data(4 * n, seed=7)
    with pytest.warns(UserWarning, match="not built when fit starts") if rank == 0 else nullcontext():
        model.fit(x[rank::n], y[rank::n], batch_size=2, epochs=1, shuffle=False, verbose=0,
                  callbacks=[Before(), hvd.callbacks.BroadcastGlobalVariablesCallback(root), After()])
    assert_close(seen["after"], hvd_world.bcast(seen["before"], root=root), "after batch 0: the root's", tol=0)
    assert_identical_across_ranks(hvd_world, model.get_weights(), "weights after fit")
