"""hvd.DistributedOptimizer in Keras 3's model.fit (the Horovod MNIST example's recipe on 8x8 digits) and in a
custom loop: N ranks on their shards step like one process on the global batch and like TorusStrategy, and
stay bitwise identical; backward_passes_per_step, fp16 compression, saving, and what is refused."""
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hvd_common import (
    B,
    Record,
    assert_close,
    assert_identical_across_ranks,
    digits,
    hvd,
    init_world,
    initial_weights,
    keras,
    mnist_model,
    rank_rows,
    tf,
)

from torus.integrations.keras import TorusStrategy
from torus.integrations.keras.fit import fit_hook
from torus.integrations.keras.horovod.optimizer import is_distributed

STEPS = 4
LOSS = keras.losses.SparseCategoricalCrossentropy


@pytest.fixture(scope="module")
def hvd_world():
    return init_world()


def hvd_fit(x, y, w0, optimizer, batch=B, callbacks=(), **opt_kw):
    """This rank's rows of every global batch, ranks starting from different weights (rank added)."""
    model = mnist_model()
    model.set_weights([w + hvd.rank() for w in w0])
    opt = hvd.DistributedOptimizer(optimizer, **opt_kw)
    model.compile(loss=LOSS(), optimizer=opt, metrics=["accuracy"], jit_compile=False)
    rows = rank_rows(len(x), hvd.size(), hvd.rank(), batch)
    rec = Record()
    hist = model.fit(x[rows], y[rows], batch_size=batch // hvd.size(), epochs=1, shuffle=False, verbose=0,
                     callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                hvd.callbacks.MetricAverageCallback(), rec, *callbacks])
    return rec, hist.history, model


def reference_fit(x, y, w0, optimizer, batch=B):
    model = mnist_model()
    model.set_weights(w0)
    model.compile(loss=LOSS(), optimizer=optimizer, metrics=["accuracy"], jit_compile=False)
    rec = Record()
    with fit_hook.local():  # plain Keras even after a TorusStrategy was created in this process
        hist = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    return rec, hist.history


def strategy_fit(x, y, w0, make_optimizer):
    strategy = TorusStrategy()
    with strategy.scope():
        model = mnist_model()
        model.set_weights([w + strategy.rank for w in w0])
        model.compile(loss=LOSS(), optimizer=make_optimizer(), metrics=["accuracy"], jit_compile=False)
    rec = Record()
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    return rec


def test_fit_matches_one_process_and_torus_strategy(hvd_world):
    x, y = digits(B * STEPS)
    w0 = initial_weights(mnist_model())
    rec, hist, _ = hvd_fit(x, y, w0, keras.optimizers.Adam(0.01))
    ref, ref_hist = reference_fit(x, y, w0, keras.optimizers.Adam(0.01))
    torus = strategy_fit(x, y, w0, lambda: keras.optimizers.Adam(0.01))
    assert len(rec.steps) == len(ref.steps) == STEPS
    assert_close(rec.first, w0, "after the broadcast, before step 1", tol=0)
    for k in range(STEPS):
        assert_identical_across_ranks(hvd_world, rec.steps[k], f"hvd step {k}")
        assert_close(rec.steps[k], ref.steps[k], f"hvd vs one process, step {k}")
        assert_close(rec.steps[k], torus.steps[k], f"hvd vs TorusStrategy, step {k}")
    for key in ("loss", "accuracy"):
        assert hist[key][0] == pytest.approx(ref_hist[key][0], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("average", [True, False])
def test_backward_passes_per_step_2_is_one_step_on_both_batches(hvd_world, average):
    """Two passes, then one update with the (averaged or summed) accumulated global gradient: for SGD the
    sum equals the mean with twice the learning rate."""
    x, y = digits(2 * B * STEPS, seed=2)
    w0 = initial_weights(mnist_model(), seed=3)
    rec, _, model = hvd_fit(x, y, w0, keras.optimizers.SGD(0.05, momentum=0.5), backward_passes_per_step=2,
                            average_aggregated_gradients=average)
    ref, _ = reference_fit(x, y, w0, keras.optimizers.SGD(0.05 if average else 0.1, momentum=0.5), batch=2 * B)
    assert len(rec.steps) == 2 * STEPS and int(model.optimizer.iterations) == 2 * STEPS
    previous = w0
    for k in range(STEPS):
        assert_close(rec.steps[2 * k], previous, f"pass {2 * k} does not update", tol=0)
        assert_identical_across_ranks(hvd_world, rec.steps[2 * k + 1], f"pass {2 * k + 1}")
        assert_close(rec.steps[2 * k + 1], ref.steps[k], f"update {k}")
        previous = rec.steps[2 * k + 1]


def test_fp16_compression_close_to_uncompressed(hvd_world):
    x, y = digits(B * STEPS, seed=4)
    w0 = initial_weights(mnist_model(), seed=5)
    rec, _, _ = hvd_fit(x, y, w0, keras.optimizers.SGD(0.1), compression=hvd.Compression.fp16)
    ref, _ = reference_fit(x, y, w0, keras.optimizers.SGD(0.1))
    for k in range(STEPS):
        assert_identical_across_ranks(hvd_world, rec.steps[k], f"fp16 step {k}")
    # fp16 keeps 11 significant bits; four SGD steps of lr 0.1 move weights by O(0.1).
    assert_close(rec.steps[-1], ref.steps[-1], "fp16 after 4 steps", tol=2e-3)


@pytest.mark.parametrize("eager", [True, False])
def test_custom_loop_apply_gradients(hvd_world, eager):
    x, y = digits(B * STEPS, seed=6)
    w0 = initial_weights(mnist_model(), seed=7)
    rows = rank_rows(len(x), hvd.size(), hvd.rank())
    models = {}
    for who in ("hvd", "ref"):
        model = mnist_model()
        model.set_weights(w0)
        opt = keras.optimizers.Adam(0.01)
        opt = hvd.DistributedOptimizer(opt) if who == "hvd" else opt
        loss_fn = LOSS()

        def step(xb, yb, model=model, opt=opt, loss_fn=loss_fn):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

        step = step if eager else tf.function(step)
        b = B // hvd.size() if who == "hvd" else B
        xs, ys = (x[rows], y[rows]) if who == "hvd" else (x, y)
        for k in range(STEPS):
            step(tf.constant(xs[k * b:(k + 1) * b]), tf.constant(ys[k * b:(k + 1) * b]))
        models[who] = model
    got = models["hvd"].get_weights()
    assert_identical_across_ranks(hvd_world, got, "custom loop")
    assert_close(got, models["ref"].get_weights(), "custom loop vs one process")


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_saved_model_holds_a_plain_optimizer(hvd_world, suffix):
    """As in Horovod: the file names the wrapped class and config, and loads without torus."""
    x, y = digits(B * 2, seed=8)
    _, _, model = hvd_fit(x, y, initial_weights(mnist_model()), keras.optimizers.Adam(0.01, beta_1=0.8))
    path = Path(tempfile.mkdtemp()) / f"model{suffix}"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is keras.optimizers.Adam and not is_distributed(loaded.optimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert_close(loaded.get_weights(), model.get_weights(), "weights", tol=0)
    assert_close([v.numpy() for v in loaded.optimizer.variables],
                 [v.numpy() for v in model.optimizer.variables], "optimizer state", tol=0)


def test_load_model_resumes_with_the_saved_optimizer_state(hvd_world):
    """2 steps, save, hvd.load_model, 2 more steps == 4 steps of one process (Adam's moments carried over)."""
    x, y = digits(B * 4, seed=10)
    w0 = initial_weights(mnist_model(), seed=11)
    _, _, model = hvd_fit(x[:2 * B], y[:2 * B], w0, keras.optimizers.Adam(0.01))
    path = Path(tempfile.mkdtemp()) / "model.keras"
    model.save(path)
    loaded = hvd.load_model(path)
    assert is_distributed(loaded.optimizer) and int(loaded.optimizer.iterations) == 2
    rows = rank_rows(2 * B, hvd.size(), hvd.rank()) + 2 * B
    loaded.fit(x[rows], y[rows], batch_size=B // hvd.size(), epochs=1, shuffle=False, verbose=0)
    ref, _ = reference_fit(x, y, w0, keras.optimizers.Adam(0.01))
    assert_identical_across_ranks(hvd_world, loaded.get_weights(), "resumed")
    assert_close(loaded.get_weights(), ref.steps[-1], "resumed vs one process")


def test_loss_scale_optimizer_inside_the_distributed_one(hvd_world):
    """float16 compute: the loss-scale optimizer sees the all-reduced gradients, so every rank takes the same
    finite/non-finite branch; the result matches one process."""
    x, y = digits(B * STEPS, seed=12)

    def model_fp16():
        return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                 keras.layers.Dense(16, activation="relu", dtype="mixed_float16"),
                                 keras.layers.Dense(10, dtype="float32")])

    w0 = initial_weights(model_fp16(), seed=13)
    runs = {}
    for who in ("hvd", "ref"):
        model = model_fp16()
        model.set_weights([w + (hvd.rank() if who == "hvd" else 0) for w in w0])
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        opt = hvd.DistributedOptimizer(opt) if who == "hvd" else opt
        model.compile(loss=LOSS(from_logits=True), optimizer=opt, jit_compile=False)
        rows = rank_rows(len(x), hvd.size(), hvd.rank()) if who == "hvd" else np.arange(len(x))
        with fit_hook.local():  # the reference stays plain Keras after a TorusStrategy was created
            model.fit(x[rows], y[rows], batch_size=len(rows) // STEPS, shuffle=False, verbose=0,
                      callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)] if who == "hvd" else [])
        runs[who] = model.get_weights()
    assert_identical_across_ranks(hvd_world, runs["hvd"], "mixed precision")
    assert_close(runs["hvd"], runs["ref"], "mixed precision vs one process", tol=1e-3)


def test_refused(hvd_world):
    x, y = digits(B, seed=9)
    model = mnist_model()
    model.compile(loss=LOSS(), optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD()), jit_compile=True)
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    model = mnist_model()
    model.compile(loss=LOSS(), jit_compile=False,
                  optimizer=keras.optimizers.LossScaleOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD())))
    with pytest.raises(ValueError, match="LossScaleOptimizer wraps"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    sgd = keras.optimizers.SGD()
    for kwargs, error, text in [({"op": hvd.Max}, ValueError, "op must be"),
                                ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step"),
                                ({"gradient_predivide_factor": 2.0, "op": hvd.Sum}, ValueError, "predivide"),
                                ({"compression": "fp16"}, ValueError, "compression must be")]:
        with pytest.raises(error, match=text):
            hvd.DistributedOptimizer(sgd, **kwargs)
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        hvd.DistributedOptimizer("adam")
    with pytest.raises(ValueError, match="already distributed"):
        hvd.DistributedOptimizer(hvd.DistributedOptimizer(sgd))
