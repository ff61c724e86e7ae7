"""hvd.DistributedGradientTape and hvd.broadcast_variables written as Horovod's TF2 custom loops are: each rank
takes the gradient of the mean loss over its contiguous part of every global batch of random data; the tape's
gradients must equal those of one process on the global batch (plain tf.GradientTape, no torus), eagerly and
inside a tf.function, for dense and IndexedSlices gradients, with None gradients left alone. Horovod's
``if first_batch: hvd.broadcast_variables(...)`` inside a tf.function must give what one process computes for
Horovod's order (step 1 from each rank's own weights, then rank 0's state everywhere)."""
import numpy as np
import pytest
from hvd_common import B, assert_close, assert_identical_across_ranks, hvd, init_world, keras, tf
from kerasref import embedding_model, token_data

STEPS = 3
LOSS = keras.losses.SparseCategoricalCrossentropy


@pytest.fixture(scope="module")
def hvd_world():
    return init_world()


def dense_model(seed, shift=0.0):
    """Two Dense layers plus one unused Dense (its gradients are None), weights from ``seed`` (+ ``shift``)."""
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.standard_normal(w.shape).astype(np.float32) * 0.5 + shift for w in model.get_weights()])
    return model


def random_batch(seed, n=B):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 3, n)


def shard(array, world):
    b = len(array) // world.size
    return array[world.rank * b:(world.rank + 1) * b]


def one_process_gradients(model, x, y, sources=None):
    with tf.GradientTape() as tape:
        loss = LOSS(from_logits=True)(y, model(x, training=True))
    return tape.gradient(loss, sources if sources is not None else model.trainable_variables)


def as_arrays(grads):
    return [None if g is None else np.asarray(tf.convert_to_tensor(g)) for g in grads]


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("kwargs,scale,tol", [
    ({}, 1.0, 1e-6),
    ({"op": hvd.Sum}, None, 1e-6),  # None: size()
    ({"gradient_predivide_factor": 2.0}, 1.0, 1e-6),
    ({"compression": hvd.Compression.fp16}, 1.0, 2e-3),
])
def test_dense_gradients_are_the_global_batch_gradients(hvd_world, graph, kwargs, scale, tol):
    model, unused = dense_model(1), keras.layers.Dense(2)
    unused.build((None, 6))
    x, y = random_batch(2)
    sources = model.trainable_variables + unused.trainable_variables

    def local_gradients(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(from_logits=True)(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape, **kwargs)
        return tape.gradient(loss, sources)

    fn = tf.function(local_gradients) if graph else local_gradients
    got = fn(tf.constant(shard(x, hvd_world)), tf.constant(shard(y, hvd_world)))
    want = as_arrays(one_process_gradients(model, x, y, sources))
    factor = hvd.size() if scale is None else scale
    assert got[-2:] == [None, None] and want[-2:] == [None, None]  # the unused layer: None, left out
    assert_identical_across_ranks(hvd_world, as_arrays(got[:-2]), "gradients")
    assert_close(as_arrays(got[:-2]), [w * factor for w in want[:-2]], f"{kwargs} graph={graph}", tol=tol)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_embedding_gradient(hvd_world, graph, sparse_as_dense):
    """IndexedSlices are all-gathered: the rows and indices of one process on the global batch, in the same
    order; sparse_as_dense gives the dense sum."""
    x, y = token_data(5, B)
    model = embedding_model(None)
    rng = np.random.default_rng(6)
    model.set_weights([rng.standard_normal(w.shape).astype(np.float32) for w in model.get_weights()])

    def local_gradients(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(from_logits=True)(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, model.trainable_variables)

    fn = tf.function(local_gradients) if graph else local_gradients
    got = fn(tf.constant(shard(x, hvd_world)), tf.constant(shard(y, hvd_world)))
    want = one_process_gradients(model, x, y)
    assert isinstance(want[0], tf.IndexedSlices)
    if sparse_as_dense:
        assert not isinstance(got[0], tf.IndexedSlices)
    else:
        assert isinstance(got[0], tf.IndexedSlices)
        np.testing.assert_array_equal(got[0].indices.numpy(), want[0].indices.numpy())
        assert_close([got[0].values.numpy()], [want[0].values.numpy()], "embedding rows", tol=1e-6)
    assert_identical_across_ranks(hvd_world, as_arrays(got), "embedding gradients")
    assert_close(as_arrays(got), as_arrays(want), f"sparse_as_dense={sparse_as_dense}", tol=1e-6)


def test_structure_persistent_tape_and_local_sources(hvd_world):
    """Sources as a dict or a single variable come back in that structure; a persistent tape gives both its
    local gradients (the original tape) and reduced ones; a registered local source keeps its own gradient
    divided by size() (Horovod's scale_local_gradients)."""
    model = dense_model(7)
    x, y = random_batch(8)
    xs, ys = shard(x, hvd_world), shard(y, hvd_world)
    kernel, bias = model.layers[0].kernel, model.layers[0].bias
    want = as_arrays(one_process_gradients(model, x, y, [kernel, bias]))
    own = as_arrays(one_process_gradients(model, xs, ys, [kernel, bias]))
    with tf.GradientTape(persistent=True) as tape:
        loss = LOSS(from_logits=True)(ys, model(xs, training=True))
    dtape = hvd.DistributedGradientTape(tape)
    got = dtape.gradient(loss, {"k": kernel, "b": bias})
    assert set(got) == {"k", "b"}
    assert_close(as_arrays([got["k"], got["b"]]), want, "dict sources", tol=1e-6)
    assert_close(as_arrays([dtape.gradient(loss, bias)]), [want[1]], "one source", tol=1e-6)
    assert_close(as_arrays(tape.gradient(loss, [kernel, bias])), own, "the wrapped tape stays local", tol=1e-6)
    dtape.register_local_source(bias)
    local, shared = dtape.get_local_and_global_gradients(loss, [kernel, bias])
    assert [s for s, _ in local] == [bias] and [s for s, _ in shared] == [kernel]
    assert_close(as_arrays([local[0][1], shared[0][1]]), [own[1] / hvd.size(), want[0]], "local source", tol=1e-6)
    partial = hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[1])
    got = partial.gradient(loss, model.trainable_variables)
    every = as_arrays(one_process_gradients(model, x, y))
    mine = as_arrays(one_process_gradients(model, xs, ys))
    assert_close(as_arrays(got), every[:2] + [m / hvd.size() for m in mine[2:]], "partial tape", tol=1e-6)
    del tape


@pytest.mark.parametrize("graph", [False, True])
def test_horovod_tf2_loop_matches_one_process(hvd_world, graph):
    """Horovod's tensorflow2_mnist.py step: ranks start from different weights; step 1 averages the gradients
    taken at each rank's own weights and applies them to each rank's own weights, then rank 0's model and
    optimizer state (opt.variables(), Keras 2's spelling) go everywhere; later steps are global-batch steps."""
    size, rank = hvd.size(), hvd.rank()
    x, y = random_batch(11, B * STEPS)
    model, opt = dense_model(12, shift=0.1 * rank), keras.optimizers.Adam(0.01)
    loss_fn = LOSS(from_logits=True)

    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss_value = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)
        return loss_value

    step = tf.function(training_step) if graph else training_step
    got = []
    for k in range(STEPS):
        batch = slice(k * B, (k + 1) * B)
        step(tf.constant(shard(x[batch], hvd_world)), tf.constant(shard(y[batch], hvd_world)), k == 0)
        got.append([v.numpy() for v in model.variables + opt.variables])

    # One process: every rank's first gradient at its own weights, averaged, applied from rank 0's weights.
    first = [as_arrays(one_process_gradients(dense_model(12, shift=0.1 * r), x[r * (B // size):(r + 1) * (B // size)],
                                             y[r * (B // size):(r + 1) * (B // size)])) for r in range(size)]
    ref, ref_opt = dense_model(12), keras.optimizers.Adam(0.01)
    ref_opt.apply_gradients(zip([np.mean(g, axis=0) for g in zip(*first)], ref.trainable_variables))
    want = [[v.numpy() for v in ref.variables + ref_opt.variables]]
    for k in range(1, STEPS):
        grads = one_process_gradients(ref, x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
        ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
        want.append([v.numpy() for v in ref.variables + ref_opt.variables])
    for k in range(STEPS):
        assert_identical_across_ranks(hvd_world, got[k], f"step {k}")
        assert_close(got[k], want[k], f"step {k} vs one process", tol=1e-5)


def test_broadcast_variables_inside_tf_function(hvd_world):
    """Every dtype, from the last rank; the graph's assignments come after what the function did before."""
    rank, last = hvd.rank(), hvd.size() - 1
    rng = np.random.default_rng([3, rank])
    floats = tf.Variable(rng.standard_normal((4, 3)).astype(np.float32))
    counts = tf.Variable(rng.integers(0, 100, 5), dtype=tf.int64)
    kv = keras.Variable(rng.standard_normal(2).astype(np.float64))
    want = hvd_world.bcast([floats.numpy() + 1, counts.numpy(), kv.numpy()], root=last)

    @tf.function
    def bump_then_broadcast():
        floats.assign_add(tf.ones_like(floats))
        hvd.broadcast_variables([floats, counts, kv], root_rank=last)

    bump_then_broadcast()
    assert_close([floats.numpy(), counts.numpy(), np.asarray(kv.numpy())], want, "broadcast in a graph", tol=0)


def test_broadcast_variables_mismatch_in_a_graph_fails_on_every_rank(hvd_world):
    if hvd_world.size == 1:
        pytest.skip("needs 2 ranks or more: ranks pass lists of different lengths")
    variables = [tf.Variable(tf.zeros(3)) for _ in range(1 + (hvd_world.rank > 0))]

    @tf.function
    def broadcast():
        hvd.broadcast_variables(variables, root_rank=0)

    with pytest.raises(tf.errors.OpError, match="hold other variables than rank 0"):
        broadcast()


def test_optimizer_variables_callable_as_in_keras_2(hvd_world):
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(dense_model(1).trainable_variables)
    assert opt.variables() == opt.variables and len(opt.variables) == 2 + 4
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    assert lso.variables() == lso.variables


def test_refused(hvd_world):
    with tf.GradientTape() as tape:
        pass
    for kwargs, text in [({"op": hvd.Max}, "op must be"), ({"gradient_predivide_factor": 2.0, "op": hvd.Sum},
                                                             "predivide"),
                         ({"process_set": object()}, "process sets"), ({"groups": -1}, "groups"),
                         ({"compression": "fp16"}, "compression must be")]:
        with pytest.raises(ValueError, match=text):
            hvd.DistributedGradientTape(tape, **kwargs)
    with pytest.raises(ValueError, match="already distributed"):
        hvd.DistributedGradientTape(hvd.DistributedGradientTape(tape))
    with pytest.raises(TypeError, match="tf.GradientTape"):
        hvd.DistributedGradientTape(object())
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast_variables([tf.Variable(1.0)], root_rank=hvd.size())


def test_names_horovod_has_and_torus_does_not(hvd_world):
    for name in ("alltoall", "Adasum", "grouped_allreduce", "nccl_built", "SyncBatchNormalization"):
        with pytest.raises(AttributeError, match=rf"hvd\.{name} is not provided by torus.*HOROVOD\.md"):
            getattr(hvd, name)
        assert not hasattr(hvd, name)
    with pytest.raises(AttributeError, match=r"has no attribute 'DistributedGradientTap'.*HOROVOD\.md") as caught:
        hvd.DistributedGradientTap  # noqa: B018 - a typo
    assert "not provided" not in str(caught.value)
    with pytest.raises(AttributeError, match="BestModelCheckpoint is not provided"):
        hvd.callbacks.BestModelCheckpoint  # noqa: B018
    assert hvd.DistributedGradientTape and hvd.PartialDistributedGradientTape
