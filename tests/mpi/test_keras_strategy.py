"""TorusStrategy and the custom-loop helpers: N ranks with global batch B step exactly like one process with
batch B (the reference runs on every rank, on the full batch), and ranks stay bitwise identical.

Runs at 1, 2 and 3 ranks only (TensorFlow is heavy on the 2-core test machine). Took 68 s at 3 ranks
(35 CPU-seconds) while the 2-core machine ran at a load average of 15.
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
from kerasref import Record, assert_identical_across_ranks  # noqa: E402

from torus.integrations.keras import LARS, HostAllreduce, TorusStrategy, allreduce_tensors  # noqa: E402
from torus.integrations.keras.fit import fit_hook  # noqa: E402

B, STEPS = 12, 5  # global batch (divisible by 1, 2, 3) and steps per test


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


def data(seed=0, n=B * STEPS, features=6):
    rng = np.random.default_rng(seed)  # same on every rank
    return rng.standard_normal((n, features)).astype(np.float32), rng.integers(0, 3, n)


def dense_model():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(9, activation="tanh"), keras.layers.Dense(3)])


def initial_weights(model, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(w.shape).astype(np.float32) * 0.5 for w in model.get_weights()]


def compile_(model, optimizer=None, **kw):
    model.compile(optimizer or LARS(learning_rate=0.5, trust_coefficient=0.02, weight_decay=1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False, **kw)


def reference_fit(x, y, build=dense_model, weights=None, **fit_kw):
    model = build()
    model.set_weights(weights)
    compile_(model, metrics=["accuracy"])
    rec = Record()
    with fit_hook.local():
        hist = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[rec], **fit_kw)
    return rec.steps, hist.history, model


def strategy_fit(strategy, x, y, build=dense_model, weights=None, perturb=True, **fit_kw):
    """Fit on the global arrays (batch_size is the global batch: each rank trains on its contiguous 1/size
    of every batch); ranks start from different weights so the broadcast is exercised."""
    with strategy.scope():
        model = build()
        model.set_weights([w + (strategy.rank if perturb else 0) for w in weights])
        compile_(model, metrics=["accuracy"])
    rec = Record()
    hist = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
                     callbacks=strategy.callbacks() + [rec], **fit_kw)
    return rec.steps, hist.history, model


def test_fit_matches_one_process_and_metrics_are_global(world, strategy):
    x, y = data()
    xv, yv = data(seed=7, n=31)
    w0 = initial_weights(dense_model())
    # 31 validation rows split unevenly over N ranks: checks the sample-count weighting.
    steps, hist, model = strategy_fit(strategy, x, y, weights=w0, validation_data=(xv, yv))
    ref_steps, ref_hist, ref_model = reference_fit(x, y, weights=w0, validation_data=(xv, yv))
    assert len(steps) == len(ref_steps) == STEPS
    for k, (got, want) in enumerate(zip(steps, ref_steps)):
        assert_identical_across_ranks(world, got, f"fit step {k}")
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"fit step {k}")
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert hist[key][0] == pytest.approx(ref_hist[key][0], rel=1e-5, abs=1e-6), key
    got = strategy.average_logs(model, model.evaluate(xv, yv, batch_size=4, verbose=0, return_dict=True))
    with fit_hook.local():
        want = ref_model.evaluate(xv, yv, batch_size=4, verbose=0, return_dict=True)
    for key in ("loss", "accuracy"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), f"evaluate {key}"


def test_fp16_compression_close_to_float32(world):
    strategy = TorusStrategy(compression="fp16", algorithm="ring")
    x, y = data(seed=3)
    w0 = initial_weights(dense_model(), seed=4)
    steps, _, _ = strategy_fit(strategy, x, y, weights=w0)
    ref_steps, _, _ = reference_fit(x, y, weights=w0)
    for k, got in enumerate(steps):
        assert_identical_across_ranks(world, got, f"fp16 step {k}")
    # fp16 keeps 11 significant bits: each reduced gradient element is off by <= ~2**-11 relative per hop.
    for g, w in zip(steps[-1], ref_steps[-1]):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-3)


@pytest.mark.parametrize("compression, rtol", [("none", 1e-6), ("fp16", 2e-3), ("bf16", 2e-2)])
def test_allreduce_tensors_against_mpi(world, strategy, rng, compression, rtol):
    """Mixed dtypes and shapes (0-d, empty, IndexedSlices) in one call; only float32 is compressed."""
    host = HostAllreduce(strategy.torus_comm, "ring", compression)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    s = np.float32(rng.standard_normal())
    d = rng.standard_normal(5)
    k = rng.integers(-9, 9, 7)
    rows = rng.standard_normal((2, 4)).astype(np.float32)
    sparse = tf.IndexedSlices(tf.constant(rows), tf.constant([4, 1]), tf.constant([6, 4]))
    dense_sparse = np.zeros((6, 4), np.float32)
    dense_sparse[[4, 1]] = rows
    inputs = [tf.constant(a), tf.constant(s), tf.constant(d), tf.zeros((0,)), tf.constant(k), sparse]
    got = allreduce_tensors(host, inputs, op="sum")
    for g, local in zip(got, [a, s, d, np.zeros(0, np.float32), k, dense_sparse]):
        want = np.empty_like(np.asarray(local))
        world.Allreduce(np.asarray(local), want)
        assert g.shape == want.shape and g.dtype.as_numpy_dtype == want.dtype
        tol = rtol if want.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(g.numpy(), want, rtol=tol, atol=tol * np.abs(want).max(initial=1))


def test_custom_loop_matches_one_process(world, strategy):
    x, y = data(seed=5)
    model, ref = dense_model(), dense_model()
    w0 = initial_weights(model, seed=6)
    model.set_weights([w + strategy.rank for w in w0])
    ref.set_weights(w0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = LARS(learning_rate=0.5, trust_coefficient=0.02, weight_decay=1e-3, nesterov=True)
    ref_opt = LARS(learning_rate=0.5, trust_coefficient=0.02, weight_decay=1e-3, nesterov=True)
    opt.build(model.trainable_variables)
    strategy.broadcast_variables(model.variables + opt.variables)

    def make_step(m, o, reduce):
        @tf.function(jit_compile=False)
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, m(xb, training=True))
            grads = tape.gradient(loss, m.trainable_variables)
            if reduce:
                grads = strategy.allreduce_gradients(grads)
            o.apply_gradients(zip(grads, m.trainable_variables))
        return step

    step, ref_step = make_step(model, opt, True), make_step(ref, ref_opt, False)
    b = B // strategy.size
    for k in range(STEPS):
        lo = k * B + strategy.rank * b
        step(x[lo:lo + b], y[lo:lo + b])
        ref_step(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
        got = model.get_weights()
        assert_identical_across_ranks(world, got, f"custom loop step {k}")
        for g, w in zip(got, ref.get_weights()):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"custom loop step {k}")


def embedding_model():
    return keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(20, 5),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])


def test_embedding_sparse_gradient_matches_one_process(world, strategy):
    rng = np.random.default_rng(8)
    x = rng.integers(0, 20, (B * 3, 4)).astype(np.int32)
    y = rng.integers(0, 3, B * 3)
    w0 = initial_weights(embedding_model(), seed=9)
    steps, _, _ = strategy_fit(strategy, x, y, build=embedding_model, weights=w0)
    ref_steps, _, _ = reference_fit(x, y, build=embedding_model, weights=w0)
    for k, (got, want) in enumerate(zip(steps, ref_steps)):
        assert_identical_across_ranks(world, got, f"embedding step {k}")
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"embedding step {k}")


def test_jit_compile_is_refused(strategy):
    with strategy.scope():
        model = dense_model()
        model.compile(LARS(), keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    x, y = data(n=B)
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.fit(x, y, batch_size=B, verbose=0, callbacks=strategy.callbacks())


def test_distributed_dataset_is_this_ranks_share_of_each_batch(world, strategy):
    """experimental_distribute_dataset (custom loops; Keras' fit/evaluate) yields rows
    [n*rank//size, n*(rank+1)//size) of every global batch of n rows, as a plain tf.data dataset: TF's
    DistributedDataset wrapper brought a MultiDeviceIterator whose teardown crashed (strategy.py)."""
    x = np.random.default_rng(10).standard_normal((31, 3)).astype(np.float32)  # batches of 7, last one 3
    shares = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(7))
    assert isinstance(shares, tf.data.Dataset)
    r, n = strategy.rank, strategy.size
    want = [x[i:i + 7][len(x[i:i + 7]) * r // n:len(x[i:i + 7]) * (r + 1) // n] for i in range(0, 31, 7)]
    got = [b.numpy() for b in shares]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_repeated_evaluate_peeks_and_drops_iterators_safely(world, strategy):
    """Every evaluate under a strategy starts an iterator, peeks one batch and deletes it; with TF's
    MultiDeviceIterator that teardown could crash the job (SIGSEGV). The loss each time equals one process
    on the global data."""
    x, y = data(seed=11, n=31)
    w0 = initial_weights(dense_model(), seed=12)
    with strategy.scope():
        model = dense_model()
        model.set_weights(w0)
        compile_(model)
    ref = dense_model()
    ref.set_weights(w0)
    compile_(ref)
    with fit_hook.local():
        want = ref.evaluate(x, y, batch_size=4, verbose=0)
    for _ in range(15):
        assert model.evaluate(x, y, batch_size=4, verbose=0) == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="masks of other ranks need a second rank")
def test_dropout_draws_other_masks_on_every_rank(world, strategy):
    """Rank 0's variables are broadcast, seed states included, yet after fit each rank's Dropout draws masks
    of its own (with rank 0's stream on every rank, row i of every rank's share would be dropped alike)."""
    keras.utils.set_random_seed(3)
    x, y = data()
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dropout(0.5), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    kept = np.asarray(model.layers[0](np.ones((64, 6), np.float32), training=True)) != 0
    masks = world.allgather(kept)
    assert 0.3 < kept.mean() < 0.7, kept.mean()  # a Dropout(0.5) mask, not all kept
    assert all((m != masks[0]).any() for m in masks[1:]), "every rank drew rank 0's mask"
