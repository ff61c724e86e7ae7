"""The keras.io guides' patterns under TorusStrategy, written as the guides write them (issue 41):

- saving inside ``strategy.scope()``: ``fit`` with ``ModelCheckpoint``, ``model.save``, ``save_weights`` and
  ``export`` there, and ``if strategy.is_chief: model.save(...)`` (Keras builds a reference optimizer inside
  every save, so variables are created under the scope on rank 0 alone: the strategy waited for the others);
- global random states after a shuffled ``fit``: numpy's, Python's, TensorFlow's and Keras' next draws are the
  same on every rank (fit's shuffle seed was drawn from ``np.random`` on rank 0 only, and the guides' next
  ``np.random`` data then differed per rank), and so after a save whose own code draws;
- lists of arrays as ``x`` and ``y`` in ``fit`` / ``evaluate`` / ``predict``, as plain Keras takes them.

The oracles: rank 0's values broadcast with mpi4py (every rank must hold them), and one process on the global
batch (plain Keras, no strategy) for the results. Each wait is bounded by a 60 s stall timeout
(``TorusComm(timeout=60)``), so a regression fails instead of hanging. Runs at 1, 2 and 3 ranks only.
"""
import random

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras  # noqa: E402
from kerasref import assert_identical_across_ranks  # noqa: E402

import torus  # noqa: E402
from torus.integrations.keras import TorusStrategy  # noqa: E402
from torus.integrations.keras.fit import fit_hook  # noqa: E402

B = 12  # the global batch: a multiple of 1, 2 and 3


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy(comm=torus.TorusComm(timeout=60))


def classifier():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    return model


def draws() -> list:
    """The next value of every global random source a guide draws from."""
    return [np.random.rand(4), np.array([random.random()]), tf.random.uniform([4]).numpy(),
            keras.random.normal((4,)).numpy()]


def test_save_inside_scope(strategy, world, shared):
    keras.utils.set_random_seed(1)
    x = np.random.default_rng(1).standard_normal((48, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0)
    with strategy.scope():  # keras.io's tf.distribute guide: compile, fit with ModelCheckpoint, all in the scope
        model = classifier()
        model.fit(x, y, batch_size=B, epochs=2, verbose=0,
                  callbacks=[keras.callbacks.ModelCheckpoint(str(shared / "ckpt-{epoch}.keras"))])
        model.save(shared / "model.keras")
        model.save_weights(shared / "model.weights.h5")
        model.export(str(shared / "exported"), verbose=False)
        if strategy.is_chief:
            model.save(shared / "chief.keras")
    strategy.barrier()
    want = world.bcast(model.get_weights(), root=0)
    assert_identical_across_ranks(world, model.get_weights(), "weights after fit")
    for name in ("ckpt-2.keras", "model.keras", "chief.keras"):
        for got, expected in zip(keras.models.load_model(shared / name).get_weights(), want):
            np.testing.assert_array_equal(got, expected, err_msg=name)
    again = classifier()
    again.load_weights(shared / "model.weights.h5")
    for got, expected in zip(again.get_weights(), want):
        np.testing.assert_array_equal(got, expected, err_msg="model.weights.h5")
    exported = tf.saved_model.load(str(shared / "exported"))  # held: its functions' variables live in it
    served = exported.serve(x[:5]).numpy()
    np.testing.assert_allclose(served, model.predict(x[:5], verbose=0), rtol=1e-6, atol=1e-6)


def test_random_state_after_shuffled_fit(strategy, world, shared):
    """keras.io's built-in training guide: fit on shuffled arrays, then draw the next data with np.random and
    fit again; every source draws alike on every rank."""
    keras.utils.set_random_seed(2)
    x = np.random.random((48, 6)).astype("float32")
    y = np.random.randint(0, 3, 48)
    with strategy.scope():
        model = classifier()
    model.fit(x, y, batch_size=B, epochs=2, shuffle=True, verbose=0,
              callbacks=[keras.callbacks.ModelCheckpoint(str(shared / "best.keras"))])
    assert_identical_across_ranks(world, draws(), "the draws after a shuffled fit")
    x2 = np.random.random((24, 6)).astype("float32")  # refused as per-rank data when the states had split
    y2 = np.random.randint(0, 3, 24)
    model.fit(x2, y2, batch_size=B, epochs=1, verbose=0)
    assert_identical_across_ranks(world, model.get_weights(), "weights after the second fit")


@keras.saving.register_keras_serializable("torus_tests")
class DrawsWhenSaved(keras.layers.Layer):
    """A layer whose saving code draws from every global source (as a user layer's may)."""

    def call(self, inputs):
        return inputs

    def save_own_variables(self, store):
        draws()


def test_random_state_after_save(strategy, world, shared):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), DrawsWhenSaved(), keras.layers.Dense(3)])
        model.compile("sgd", "mse", jit_compile=False)
    model.save(shared / "drawn.keras")  # rank 0 writes, and draws, alone
    assert_identical_across_ranks(world, draws(), "the draws after a save")


def lists_model():
    a, b = keras.Input((4,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([a, b]))
    model = keras.Model([a, b], [keras.layers.Dense(1, name="score")(h),
                                 keras.layers.Dense(1, activation="sigmoid", name="flag")(h)])
    model.compile(keras.optimizers.SGD(0.05), ["mse", "binary_crossentropy"], jit_compile=False)
    return model


def test_lists_of_arrays(strategy, world):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((36, 4)).astype("float32"), rng.standard_normal((36, 3)).astype("float32")
    c, d = rng.standard_normal((36, 1)).astype("float32"), rng.integers(0, 2, (36, 1)).astype("float32")
    keras.utils.set_random_seed(4)
    reference = lists_model()  # one process, the global batch, in order
    w0 = [w.copy() for w in reference.get_weights()]
    with fit_hook.local():  # plain Keras: not moved under the strategy
        want_loss = reference.fit([a, b], [c, d], batch_size=B, epochs=2, shuffle=False, verbose=0).history["loss"]
        want_eval = reference.evaluate([a, b], [c, d], batch_size=B, verbose=0)
        want_pred = reference.predict([a, b], batch_size=B, verbose=0)
    with strategy.scope():
        model = lists_model()
    model.set_weights(w0)
    got_loss = model.fit([a, b], [c, d], batch_size=B, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(model.evaluate([a, b], [c, d], batch_size=B, verbose=0), want_eval, rtol=1e-5)
    for got, want in zip(model.predict([a, b], batch_size=B, verbose=0), want_pred):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # shuffled, and as a validation split: lists take the route tuples take, to the same bits
    model.set_weights(w0)
    keras.utils.set_random_seed(5)
    from_lists = model.fit([a, b], [c, d], batch_size=B, epochs=2, validation_split=1 / 3, verbose=0).history
    after_lists = model.get_weights()
    model.set_weights(w0)
    keras.utils.set_random_seed(5)
    from_tuples = model.fit((a, b), (c, d), batch_size=B, epochs=2, validation_split=1 / 3, verbose=0).history
    assert from_lists == from_tuples
    for got, want in zip(after_lists, model.get_weights()):
        np.testing.assert_array_equal(got, want)
    assert_identical_across_ranks(world, after_lists, "weights after the shuffled fit on lists")


class TwoNets(keras.Model):
    """keras.io's GAN guide's shape: sub-models, its own compile and train_step, no call()."""

    def __init__(self):
        super().__init__()
        self.net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                                     keras.layers.Dense(1)])
        self.tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.tracker]

    def compile(self, optimizer):
        super().compile()
        self.opt = optimizer

    def train_step(self, x):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(tf.ones_like(x[:, :1]), self.net(x))
        grads = tape.gradient(loss, self.net.trainable_weights)
        self.opt.apply(grads, self.net.trainable_weights)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


def test_a_model_without_call_trains_as_one_process(strategy, world):
    x = np.random.default_rng(6).standard_normal((48, 4)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(B)
    keras.utils.set_random_seed(6)
    reference = TwoNets()  # one process
    w0 = [w.copy() for w in reference.net.get_weights()]
    reference.compile(keras.optimizers.Adam(0.01))
    with fit_hook.local():  # plain Keras: not moved under the strategy
        reference.fit(dataset, epochs=2, verbose=0)
    with strategy.scope():
        model = TwoNets()
        model.compile(keras.optimizers.Adam(0.01))
    model.net.set_weights(w0)
    model.fit(dataset, epochs=2, verbose=0)  # Keras' symbolic build fails on it under any strategy
    assert_identical_across_ranks(world, model.net.get_weights(), "weights")
    for got, want in zip(model.net.get_weights(), reference.net.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_save_of_a_model_built_outside_the_scope(strategy, world, shared):
    """keras.io's saving guide builds models without a strategy and saves them on every rank: the file is
    written once, by rank 0 (every rank writing it raced: h5py's lock, a damaged zip)."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    model.set_weights([w + world.rank for w in model.get_weights()])  # rank r's differ: the file shows who wrote
    want = world.bcast(model.get_weights(), root=0)
    for _ in range(5):
        model.save_weights(shared / "outside.weights.h5")
        model.save(shared / "outside.keras")
        for got, expected in zip(keras.models.load_model(shared / "outside.keras").get_weights(), want):
            np.testing.assert_array_equal(got, expected)
    again = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    again.load_weights(shared / "outside.weights.h5")
    for got, expected in zip(again.get_weights(), want):
        np.testing.assert_array_equal(got, expected)


def test_apply_inside_the_scope_outside_run_says_what_to_do(strategy):
    """keras.io's custom loop with its loop moved inside the scope: a clear error (it was Keras' AttributeError
    "'NoneType' object has no attribute 'merge_call'")."""
    x = np.random.default_rng(8).standard_normal((B, 6)).astype("float32")
    with strategy.scope():
        model = classifier()
        optimizer = keras.optimizers.Adam(1e-3)
        with tf.GradientTape() as tape:
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(np.zeros(B), model(x))
        grads = tape.gradient(loss, model.trainable_weights)
        with pytest.raises(RuntimeError, match=r"outside strategy\.run.*strategy\.run\(step_fn"):
            optimizer.apply(grads, model.trainable_weights)
