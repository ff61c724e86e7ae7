"""tf.distribute's contract for MirroredStrategy-style custom code under TorusStrategy (issue 22).

- ``distribute_datasets_from_function``: the ``tf.distribute.InputContext`` says one input pipeline and one
  replica per rank, so TF's tutorial ``dataset_fn`` (``shard(num_input_pipelines, input_pipeline_id)``,
  ``get_per_replica_batch_size``) gives each rank its own rows, and the dataset is taken as per rank (a custom
  loop and ``fit`` train on it as it is).
- ``replica_id_in_sync_group`` in ``strategy.run`` is the rank (the multi-worker strategy's replica ids run
  over the workers), eagerly and traced; the replica context's ``all_reduce`` still sums over every rank.
- variables created under ``strategy.scope()`` start from rank 0's initial values (creation.py), so an unseeded
  ``strategy.run`` loop starts, and stays, equal on every rank.

Each result is compared with one process on the global batch, computed here with plain Keras outside the
strategy (no all-reduce) from the same start. Runs at 1, 2 and 3 ranks.
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
from kerasref import Record, assert_identical_across_ranks, assert_steps_match  # noqa: E402

from torus.errors import MismatchError  # noqa: E402
from torus.integrations.keras import TorusStrategy  # noqa: E402
from torus.integrations.keras.fit import fit_hook, inputs  # noqa: E402
from torus.integrations.keras.fit.initial_state import SEED_SPREAD  # noqa: E402

G, STEPS = 12, 4  # global batch (divisible by 1, 2, 3) and steps


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


def data(seed, n=G * STEPS):
    rng = np.random.default_rng(seed)  # the same on every rank
    return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 3, n)


def dense_model(**init):
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(9, activation="tanh", **init.get("first", {})),
                             keras.layers.Dense(3, **init.get("second", {}))])


def fixed_weights(seed):
    return [np.random.default_rng([seed, k]).standard_normal(w.shape).astype(np.float32) * 0.5
            for k, w in enumerate(dense_model().get_weights())]


def tutorial_dataset_fn(x, y, contexts):
    """TF's dataset_fn (tutorials/distribute/input, distribute_datasets_from_function), recording its context."""
    def dataset_fn(input_context):
        contexts.append(input_context)
        batch_size = input_context.get_per_replica_batch_size(G)
        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return dataset.batch(batch_size).prefetch(2)
    return dataset_fn


def custom_loop(strategy, model, optimizer, dataset, global_batch_size=None):
    """The tutorial's loop (tutorials/distribute/custom_training): per-example loss averaged over the global
    batch, ``strategy.run`` and ``strategy.reduce(SUM)``. Returns the reduced losses and every batch's x."""
    def train_step(batch):
        xb, yb = batch
        with tf.GradientTape() as tape:
            per_example = keras.losses.sparse_categorical_crossentropy(yb, model(xb, training=True),
                                                                       from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(batch):
        per_replica_losses = strategy.run(train_step, args=(batch,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    losses, seen = [], []
    for batch in dataset:
        seen.append(batch[0].numpy())
        losses.append(float(distributed_train_step(batch)))
    return losses, seen


def one_process(x, y, weights, optimizer):
    """One process on the global batches of G rows: plain Keras, no strategy, mean loss over each batch."""
    model = dense_model()
    model.set_weights(weights)
    losses = []
    for k in range(0, len(x), G):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y[k:k + G], model(x[k:k + G], training=True), from_logits=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        losses.append(float(loss))
    return losses, model.get_weights()


def test_input_context_is_one_pipeline_and_replica_per_rank(world, strategy):
    x, y = data(seed=1)
    contexts = []
    shards = strategy.distribute_datasets_from_function(tutorial_dataset_fn(x, y, contexts))
    (ctx,) = contexts
    r, n = world.rank, world.size
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (n, r, n)
    assert ctx.get_per_replica_batch_size(G) == G // n
    if n > 1:
        with pytest.raises(ValueError, match="is not divisible by `num_replicas_in_sync`"):  # TF's own
            ctx.get_per_replica_batch_size(G + 1)
    assert isinstance(shards, tf.data.Dataset) and inputs.is_per_rank(shards)
    got = [b[0].numpy() for b in shards]
    assert len(got) == STEPS
    for k, g in enumerate(got):  # rows r, r + n, r + 2n, ... of the data: this rank's shard
        np.testing.assert_array_equal(g, x[r::n][k * (G // n):(k + 1) * (G // n)], err_msg=f"batch {k}")


@pytest.mark.parametrize("traced", [False, True])
def test_replica_id_in_sync_group_is_the_rank(world, strategy, traced):
    def replica_fn():
        ctx = tf.distribute.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        return rid, ctx.all_reduce("sum", tf.cast(rid, tf.float32) + 1.0), ctx.num_replicas_in_sync

    run = tf.function(lambda: strategy.run(replica_fn)) if traced else (lambda: strategy.run(replica_fn))
    rid, total, replicas = run()
    n = world.size
    assert int(rid) == world.rank and int(replicas) == n
    assert float(total) == n * (n + 1) / 2  # 1 + 2 + ... + n: every rank's id, summed once


@pytest.mark.parametrize("global_batch_size", [None, G], ids=["replica_context", "explicit"])
def test_tutorial_dataset_fn_custom_loop_equals_one_process(world, strategy, global_batch_size):
    """Each rank trains on its shard; the union of the shards of one step is the global batch of one process
    (the same rows, another order), so the weights and losses equal one process' (float summation order)."""
    x, y = data(seed=2)
    w0 = fixed_weights(seed=3)
    with strategy.scope():
        model = dense_model()
        model.set_weights(w0)
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    shards = strategy.distribute_datasets_from_function(tutorial_dataset_fn(x, y, []))
    losses, seen = custom_loop(strategy, model, optimizer, shards, global_batch_size)
    assert [len(b) for b in seen] == [G // world.size] * STEPS
    everyone = world.allgather(seen)
    for k in range(STEPS):  # the ranks' batches of step k: disjoint, together the global batch k
        rows = np.concatenate([every[k] for every in everyone])
        assert sorted(map(bytes, rows)) == sorted(map(bytes, x[k * G:(k + 1) * G])), f"step {k}"
    ref_losses, ref_weights = one_process(x, y, w0, keras.optimizers.SGD(0.1, momentum=0.9))
    assert_identical_across_ranks(world, model.get_weights() + [np.array(losses)], "tutorial loop")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for g, w in zip(model.get_weights(), ref_weights):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["distribute_datasets_from_function", "experimental_distribute_dataset"])
def test_fit_takes_distributed_datasets_as_they_are(world, strategy, how):
    """A dataset the strategy distributed already is this rank's: fit does not split it again."""
    x, y = data(seed=4)
    w0 = fixed_weights(seed=5)
    if how == "distribute_datasets_from_function":
        dataset = strategy.distribute_datasets_from_function(tutorial_dataset_fn(x, y, []))
    else:
        dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(G))

    def compiled(model):
        model.set_weights(w0)
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        return model

    with strategy.scope():
        model = compiled(dense_model())
    rec, ref_rec = Record(), Record()
    model.fit(dataset, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    ref = compiled(dense_model())
    with fit_hook.local():
        ref.fit(x, y, batch_size=G, epochs=1, shuffle=False, verbose=0, callbacks=[ref_rec])
    assert_steps_match(world, rec.steps, ref_rec.steps, what=f"fit on {how}, step")


class Drawn(keras.initializers.Initializer):
    """An unseeded initializer that keeps what it drew on this rank."""

    def __init__(self, inner):
        self.inner, self.drawn = inner, []

    def __call__(self, shape, dtype=None):
        value = self.inner(shape, dtype=dtype)
        self.drawn.append(np.array(value))
        return value


def test_unseeded_custom_loop_starts_from_rank_0s_weights(world, strategy):
    """No seed: every rank draws its own initial weights, the variables take rank 0's when created; after an
    Adam loop (slots created inside the first traced step) the weights are bitwise equal across ranks and
    equal one process started from rank 0's draws."""
    # Keras' unseeded initializers take their seeds from Python's generator: one per rank here (as in separate
    # processes), whatever an earlier test in this process seeded
    random.seed(1000 + world.rank)
    draws = [Drawn(keras.initializers.GlorotUniform()), Drawn(keras.initializers.RandomNormal()),
             Drawn(keras.initializers.GlorotUniform()), Drawn(keras.initializers.RandomNormal())]
    init = {"first": {"kernel_initializer": draws[0], "bias_initializer": draws[1]},
            "second": {"kernel_initializer": draws[2], "bias_initializer": draws[3]}}
    with strategy.scope():
        model = dense_model(**init)
        optimizer = keras.optimizers.Adam(0.05)
    own = [d.drawn[0] for d in draws]  # in model.get_weights() order: kernel, bias, kernel, bias
    every = world.allgather(own)
    for r in range(1, world.size):  # else this test could not tell
        assert all(not np.array_equal(a, b) for a, b in zip(every[r], every[0])), f"rank {r} drew rank 0's"
    for g, w in zip(model.get_weights(), every[0]):
        np.testing.assert_array_equal(g, w, err_msg="at creation: not rank 0's initial weights")

    x, y = data(seed=6)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(G))
    losses, _ = custom_loop(strategy, model, optimizer, dataset, global_batch_size=G)
    assert_identical_across_ranks(world, model.get_weights() + [v.numpy() for v in optimizer.variables],
                                  "unseeded loop: weights and optimizer state")
    ref_losses, ref_weights = one_process(x, y, every[0], keras.optimizers.Adam(0.05))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for g, w in zip(model.get_weights(), ref_weights):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_seed_generator_states_are_rank_0s_offset_by_rank(world, strategy):
    """Random layers draw each rank's own stream, as in fit (initial_state.py): rank 0's state + rank * spread."""
    with strategy.scope():
        layer = keras.layers.Dropout(0.5)
    state = layer.seed_generator.state.numpy()
    every = world.allgather(state)
    for r, s in enumerate(every):
        np.testing.assert_array_equal(s, every[0] + np.array([r * SEED_SPREAD, 0], s.dtype), err_msg=f"rank {r}")


def test_a_variable_of_another_shape_is_refused_on_every_rank(world, strategy):
    if world.size == 1:
        pytest.skip("needs two ranks")
    with strategy.scope(), pytest.raises(MismatchError, match=r"rank\(s\) \[1\] created a variable of another "
                                                               r"shape or dtype than rank 0 where this rank"):
        tf.Variable(tf.zeros((3 + (world.rank == 1),)), name="odd")
    with strategy.scope():  # nothing left half-done: the next creation agrees and broadcasts
        v = tf.Variable(tf.fill((2,), float(world.rank)), name="even")
    np.testing.assert_array_equal(v.numpy(), [0.0, 0.0])
