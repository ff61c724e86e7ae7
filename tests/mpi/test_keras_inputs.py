"""Plain ``model.fit`` / ``evaluate`` / ``predict`` inputs under TorusStrategy: ``batch_size`` is the global
batch, and N ranks give what one process gives on the global batch (the reference: Keras' own unwrapped
methods on a model built from the same seed, on every rank, on the full data).

No ``strategy.callbacks()`` here: models start equal on every rank by construction (same seed), so these
tests do not rely on the initial broadcast. Runs at 1, 2 and 3 ranks only.
"""
import warnings

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

from torus.integrations.keras import TorusStrategy  # noqa: E402
from torus.integrations.keras.fit.inputs import epoch_order, per_rank  # noqa: E402

B = 12  # global batch, divisible by 1, 2 and 3


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


def plain(method):
    """Keras' own fit/evaluate/predict, whatever TorusStrategy wraps around them."""
    wrapped = getattr(TensorFlowTrainer, method)
    return getattr(wrapped, "_torus_original", wrapped)


def data(n, seed=0):
    rng = np.random.default_rng(seed)  # same on every rank
    return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 3, n)


def build(strategy=None):
    def make():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(7, activation="tanh"),
                                  keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.2, momentum=0.5),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                      jit_compile=False)
        return model
    if strategy is None:
        return make()
    with strategy.scope():
        return make()


def assert_matches(world, model, ref, what, tol=1e-5):
    got = model.get_weights()
    blob = b"".join(np.ascontiguousarray(w).tobytes() for w in got)
    assert all(b == blob for b in world.allgather(blob)), f"{what}: weights differ between ranks"
    for g, w in zip(got, ref.get_weights()):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=what)


def test_numpy_shuffled_with_validation_split(world, strategy):
    """fit's defaults (shuffle=True) plus validation_split; 66 rows: the last training batch is partial."""
    x, y = data(66)
    model = build(strategy)
    np.random.seed(5)  # rank 0 draws the shuffle seed from numpy's generator
    model.fit(x, y, batch_size=B, epochs=2, validation_split=1 / 11, verbose=0)
    seed = np.random.RandomState(5).randint(2 ** 31 - 1)
    ref = build()
    xt, yt = x[:60], y[:60]
    for epoch in range(2):
        order = epoch_order(seed, epoch, 60)
        plain("fit")(ref, xt[order], yt[order], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_matches(world, model, ref, "numpy shuffled")


def test_partial_last_batch_and_validation_data(world, strategy):
    x, y = data(66, seed=1)  # 5 full batches and one of 6 rows
    xv, yv = data(31, seed=2)
    model = build(strategy)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, validation_data=(xv, yv), verbose=0)
    ref = build()
    plain("fit")(ref, x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_matches(world, model, ref, "partial last batch")


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="any split works on one rank")
def test_uneven_global_batches_are_refused(world, strategy):
    x, y = data(B * 2 + 1)  # a last batch of one row
    model = build(strategy)
    with pytest.raises(ValueError, match=r"last batch of each epoch holds 1 rows"):
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    with pytest.raises(ValueError, match=rf"batch_size={B + 1} is not a multiple of {world.size} ranks"):
        model.fit(x[:B * 2], y[:B * 2], batch_size=B + 1, verbose=0)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    with pytest.raises(tf.errors.InvalidArgumentError, match="does not split evenly"):
        model.fit(dataset, verbose=0)


def test_tf_data_global_batches(world, strategy):
    x, y = data(60, seed=3)
    model = build(strategy)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=2, verbose=0)
    ref = build()
    plain("fit")(ref, x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    assert_matches(world, model, ref, "tf.data global batches")


def test_sharded_dataset_is_per_rank(world, strategy):
    """strategy.shard before batch: each rank's batch of B / N is its share (rows r, r + N, ...)."""
    x, y = data(60, seed=4)
    size, b = strategy.size, B // strategy.size
    model = build(strategy)
    model.fit(strategy.shard(tf.data.Dataset.from_tensor_slices((x, y))).batch(b), epochs=1, verbose=0)
    # global batch k = rank 0's k-th batch, then rank 1's, ...: rows r + size * (k * b + j)
    order = np.array([r + size * (k * b + j) for k in range(60 // B) for r in range(size) for j in range(b)])
    ref = build()
    plain("fit")(ref, x[order], y[order], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_matches(world, model, ref, "sharded dataset")


@pytest.mark.parametrize("cardinality", ["known", "unknown"])
def test_unequal_step_counts_are_equalised(world, strategy, cardinality):
    """Rank r holds 3 + r per-rank batches of 4 rows; every rank runs 3 steps with a warning naming the counts."""
    rank, size = strategy.rank, strategy.size
    counts = [3 + r for r in range(size)]
    offsets = np.concatenate([[0], np.cumsum(counts) * 4])
    x, y = data(int(offsets[-1]), seed=5)
    mine = np.arange(offsets[rank], offsets[rank + 1])
    dataset = tf.data.Dataset.from_tensor_slices((x[mine], y[mine]))
    if cardinality == "unknown":
        dataset = dataset.filter(lambda a, b: True)
    model = build(strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(per_rank(dataset.batch(4)), epochs=2, verbose=0)
    said = [str(w.message) for w in caught if "different numbers of batches" in str(w.message)]
    if size > 1 and rank == 0:
        listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        assert said and f"({listed})" in said[0] and "every rank runs 3 per epoch" in said[0], said
    # step k's global batch: rank 0's k-th batch of 4 rows, then rank 1's, ...
    order = np.array([offsets[r] + 4 * k + j for k in range(3) for r in range(size) for j in range(4)])
    ref = build()
    plain("fit")(ref, x[order], y[order], batch_size=4 * size, epochs=2, shuffle=False, verbose=0)
    assert_matches(world, model, ref, f"equalised steps ({cardinality} cardinality)")


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // B

    def __getitem__(self, i):
        return self.x[i * B:(i + 1) * B], self.y[i * B:(i + 1) * B]


def test_pydataset_shuffled_and_generator(world, strategy):
    x, y = data(60, seed=6)
    model = build(strategy)
    np.random.seed(8)
    model.fit(Batches(x, y), epochs=2, shuffle=True, verbose=0)

    def generator():
        for i in range(60 // B):
            yield x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]
    model.fit(generator(), epochs=1, verbose=0)

    seed = np.random.RandomState(8).randint(2 ** 31 - 1)
    ref = build()
    for epoch in range(2):
        rows = np.concatenate([np.arange(i * B, (i + 1) * B) for i in epoch_order(seed, epoch, 60 // B)])
        plain("fit")(ref, x[rows], y[rows], batch_size=B, epochs=1, shuffle=False, verbose=0)
    plain("fit")(ref, x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_matches(world, model, ref, "PyDataset then generator")


@pytest.mark.parametrize("n", [31, 2])
def test_predict_and_evaluate_every_row(world, strategy, n):
    """31 rows in batches of 12 (uneven per-rank shares), and 2 rows (a rank may get an empty batch)."""
    x, y = data(n, seed=9)
    model, ref = build(strategy), build()
    for inputs in (x, tf.data.Dataset.from_tensor_slices(x).batch(B)):
        got = model.predict(inputs, batch_size=None if isinstance(inputs, tf.data.Dataset) else B, verbose=0)
        want = plain("predict")(ref, x, batch_size=B, verbose=0)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    logs = strategy.average_logs(model, model.evaluate(x, y, batch_size=B, verbose=0, return_dict=True))
    want = plain("evaluate")(ref, x, y, batch_size=B, verbose=0, return_dict=True)
    for key in ("loss", "accuracy"):
        assert logs[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_plain_dataset_shard_is_per_rank(world, strategy):
    """``Dataset.shard(N, rank)`` without strategy.shard is recognised as per rank too."""
    x, y = data(36, seed=10)
    size, rank, b = strategy.size, strategy.rank, B // strategy.size
    model = build(strategy)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).shard(size, rank).batch(b), epochs=1, verbose=0)
    order = np.array([r + size * (k * b + j) for k in range(36 // B) for r in range(size) for j in range(b)])
    ref = build()
    plain("fit")(ref, x[order], y[order], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_matches(world, model, ref, "Dataset.shard")


def _same_everywhere(world, text):
    return all(t == text for t in world.allgather(text))


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="one rank has nothing to disagree with")
def test_hand_sharded_arrays_are_refused_before_any_step(world, strategy):
    """x[rank::size] (Horovod's habit), other row counts, other batch sizes: a MismatchError on every rank
    naming the ranks, and the weights still the initial ones (no step ran)."""
    rank, size = strategy.rank, strategy.size
    x, y = data(12 * B, seed=11)
    model, fresh = build(strategy), build()
    others = "rank 1" if size == 2 else "ranks 1, 2"
    cases = [
        ("fit", dict(x=x[rank::size], y=y[rank::size], batch_size=B), r"ranks passed different x \(0x"),
        ("fit", dict(x=x[:B * (4 + (rank > 0))], y=y[:B * (4 + (rank > 0))], batch_size=B),
         rf"row count \({4 * B} on rank 0; {5 * B} on {others}\)"),
        ("fit", dict(x=x, y=y, batch_size=B * (1 + (rank > 0))), rf"batch_size \({B} on rank 0; {2 * B} on {others}\)"),
        ("fit", dict(x=x, y=y, batch_size=B, validation_data=(x[rank::size], y[rank::size])),
         r"validation data \(0x"),
        ("evaluate", dict(x=x[rank::size], y=y[rank::size], batch_size=B), r"ranks passed different x \(0x"),
        ("predict", dict(x=x[rank::size], batch_size=B), r"ranks passed different x \(0x"),
    ]
    for method, kwargs, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as caught:
            getattr(model, method)(verbose=0, **kwargs)
        said = str(caught.value)
        assert said.startswith(f"TorusStrategy {method} on rank {rank}: ranks passed different"), said
        assert _same_everywhere(world, said.split(": ", 1)[1]), said
        if "x (" in said or "row count" in said:
            assert "not a shard (x[rank::size])" in said and "inputs.per_rank(" in said, said
    for got, want in zip(model.get_weights(), fresh.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_fingerprint_sees_first_last_rows_order_shape_dtype():
    from torus.integrations.keras.fit.agree import SAMPLE_NBYTES, fingerprint
    rng = np.random.default_rng(12)
    x = rng.standard_normal((5000, 300)).astype(np.float32)  # 1.2 KiB rows: a sample of ~870 of 5000
    base = fingerprint(x)
    assert fingerprint(x.copy()) == base and fingerprint(tf.constant(x)) == base
    for changed in (0, len(x) - 1):
        other = x.copy()
        other[changed, 7] += 1
        assert fingerprint(other) != base, changed
    assert fingerprint(x[::-1]) != base and fingerprint(x[:-1]) != base
    assert fingerprint(x.astype(np.float64)) != base and fingerprint(x.reshape(5000, 30, 10)) != base
    assert fingerprint((x, None)) == base and fingerprint((x, x[:, :1])) != base
    assert SAMPLE_NBYTES == 1 << 20


def test_even_fix_satisfies_the_check():
    """The suggested (batch_size, rows) split every batch evenly, with the most rows any even split keeps
    (a brute-force search over all batch sizes) and the largest batch_size multiple not above the given one."""
    from torus.integrations.keras.fit.inputs import even_fix

    def splits(rows, batch, size):
        return rows > 0 and all(min(batch, rows - s) % size == 0 for s in range(0, rows, batch))
    for size in range(1, 7):
        for rows in range(1, 90):
            best = max([r for r in range(1, rows + 1) if any(splits(r, b, size) for b in range(1, r + 1))],
                       default=0)
            for batch in range(1, 40):
                b, keep = even_fix(rows, batch, size)
                assert keep == best, (rows, batch, size)
                if keep:
                    assert splits(keep, b, size), (rows, batch, size, b, keep)
                assert b % size == 0 and (b <= batch or b == size), (batch, size, b)
                assert b > batch - size, (batch, size, b)
    assert even_fix(1000, 64, 3) == (63, 999)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="any split works on one rank")
def test_refusal_names_a_fix_for_both(world, strategy):
    """101 rows in batches of 13: one refusal whose suggested pair then trains like one process."""
    size = strategy.size
    x, y = data(101, seed=13)
    model = build(strategy)
    with pytest.raises(ValueError, match=rf"batch_size=13 is not a multiple of {size} ranks") as caught:
        model.fit(x, y, batch_size=13, shuffle=False, verbose=0)
    batch, keep = 13 - 13 % size, 101 - 101 % size
    assert f"e.g. batch_size={batch} and the first {keep} training rows" in str(caught.value), caught.value
    assert "rank counts that split it evenly: 1." in str(caught.value)  # 13 and the last 101 % 13 = 10 rows
    model.fit(x[:keep], y[:keep], batch_size=batch, shuffle=False, verbose=0)
    ref = build()
    plain("fit")(ref, x[:keep], y[:keep], batch_size=batch, shuffle=False, verbose=0)
    assert_matches(world, model, ref, "the suggested fix")


class Says(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"user callback on rank {MPI.COMM_WORLD.Get_rank()}")


def test_only_the_chief_prints(world, strategy, capfd, tmp_path):
    """verbose=1 and Keras' callbacks with verbose=1 print on rank 0 only; a user callback prints everywhere."""
    x, y = data(48, seed=14)
    model = build(strategy)
    callbacks = [keras.callbacks.ModelCheckpoint(str(tmp_path / "m.weights.h5"), save_weights_only=True, verbose=1),
                 keras.callbacks.ReduceLROnPlateau("loss", patience=0, min_delta=1e9, verbose=1),
                 keras.callbacks.EarlyStopping("loss", patience=0, min_delta=1e9, verbose=1), Says()]
    capfd.readouterr()
    model.fit(x, y, batch_size=B, epochs=3, callbacks=callbacks, verbose=1)
    model.evaluate(x, y, batch_size=B, verbose=1)
    model.predict(x, batch_size=B, verbose="auto")
    out = capfd.readouterr().out
    assert out.count(f"user callback on rank {strategy.rank}") == 2, out  # stopped after epoch 2
    chief = ("saving model to", "reducing learning rate", "early stopping", "/step")
    for text in chief:
        assert (text in out) == strategy.is_chief, (text, out)
    assert out.count("/step") >= 4 or not strategy.is_chief, out  # 2 epochs, evaluate, predict
    assert [c.verbose for c in callbacks[:3]] == [int(strategy.is_chief)] * 3


def test_generator_shuffle_warning_says_generator(world, strategy):
    x, y = data(24, seed=15)
    model = build(strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(((x[i:i + B], y[i:i + B]) for i in range(0, 24, B)), verbose=0)
    said = [w for w in caught if "`shuffle=True` was passed" in str(w.message)]
    assert not any("tf.data.Dataset" in str(w.message) for w in said), said
    assert [w.filename for w in said if "provided as a generator" in str(w.message)] \
        == [__file__] * strategy.is_chief, said  # pointing at the user's fit call, as Keras' own does
