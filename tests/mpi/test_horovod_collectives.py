"""hvd.allreduce / allgather / broadcast / *_object / broadcast_variables against mpi4py as the oracle, eagerly
and inside a tf.function, on rank-dependent random data; bad input raises on every rank."""
import numpy as np
import pytest
from hvd_common import hvd, init_world, keras, tf


@pytest.fixture(scope="module")
def hvd_world():
    return init_world()


def everyone(world, a):
    return np.stack(world.allgather(a))


@pytest.mark.parametrize("op, reduce", [(hvd.Average, np.mean), (hvd.Sum, np.sum), (hvd.Min, np.min),
                                        (hvd.Max, np.max), (hvd.Product, np.prod)])
def test_allreduce_ops(hvd_world, rng, op, reduce):
    a = rng.standard_normal((3, 5)).astype(np.float32)
    got = hvd.allreduce(a, op=op).numpy()
    np.testing.assert_allclose(got, reduce(everyone(hvd_world, a), axis=0), rtol=1e-6, atol=1e-6)
    assert got.shape == a.shape and got.dtype == a.dtype


def test_allreduce_options(hvd_world, rng):
    a = rng.standard_normal(7)  # float64: travels uncompressed
    total = everyone(hvd_world, a).sum(0)
    np.testing.assert_allclose(hvd.allreduce(a, average=False).numpy(), total, rtol=1e-12)
    np.testing.assert_allclose(hvd.allreduce(a, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0).numpy(),
                               1.5 * total, rtol=1e-12)
    k = rng.integers(-50, 50, (2, 2))
    np.testing.assert_array_equal(hvd.allreduce(k, op=hvd.Sum).numpy(), everyone(hvd_world, k).sum(0))
    f = rng.standard_normal(1000).astype(np.float32)
    np.testing.assert_allclose(hvd.allreduce(f, compression=hvd.Compression.fp16).numpy(),
                               everyone(hvd_world, f).mean(0), atol=5e-3)
    assert hvd.allreduce(np.float32(hvd.rank()), op=hvd.Sum).numpy() == sum(range(hvd.size()))


def test_allreduce_in_tf_function_keeps_program_order(hvd_world, rng):
    a, k = rng.standard_normal(4).astype(np.float32), rng.integers(0, 9, 3)

    @tf.function
    def two(x, y):
        return hvd.allreduce(x, op=hvd.Max), hvd.allreduce(y, op=hvd.Sum)

    got_a, got_k = two(tf.constant(a), tf.constant(k))
    np.testing.assert_array_equal(got_a.numpy(), everyone(hvd_world, a).max(0))
    np.testing.assert_array_equal(got_k.numpy(), everyone(hvd_world, k).sum(0))


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8, np.bool_])
def test_allgather_uneven_first_dimension(hvd_world, rng, dtype):
    rows = hvd.rank() % 2 * 3  # rank 0 contributes no rows
    a = (rng.standard_normal((rows, 2, 3)) * 9).astype(dtype)
    want = np.concatenate(hvd_world.allgather(a))
    got = hvd.allgather(a).numpy()
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    got = tf.function(hvd.allgather)(tf.constant(a)).numpy()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("root", [0, -1])
def test_broadcast(hvd_world, rng, root):
    root = root % hvd.size()
    a = rng.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(hvd.broadcast(a, root).numpy(), hvd_world.bcast(a, root=root))
    obj = {"rank": hvd.rank(), "data": list(range(hvd.rank()))}
    assert hvd.broadcast_object(obj, root) == hvd_world.bcast(obj, root=root)
    assert hvd.allgather_object(obj) == hvd_world.allgather(obj)
    variables = [keras.Variable(rng.standard_normal((4,)).astype(np.float32)), tf.Variable(rng.integers(0, 9, 2))]
    want = [hvd_world.bcast(v.numpy(), root=root) for v in variables]
    hvd.broadcast_variables(variables, root_rank=root)
    for v, w in zip(variables, want):
        np.testing.assert_array_equal(v.numpy(), w)


def test_bad_input_raises_on_every_rank(hvd_world):
    with pytest.raises(TypeError, match="'avg' is not defined for integer"):
        hvd.allreduce(np.arange(3), op=hvd.Average)
    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce(np.ones(2), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="Adasum"):
        hvd.allreduce(np.ones(2), op="adasum")
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(np.ones(2), hvd.size())
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.allgather(np.float32(1))
    if hvd.size() > 1:
        with pytest.raises(ValueError, match="shapes/dtypes differ"):
            hvd.allgather(np.ones((1, 2 + hvd.rank())))  # trailing shapes differ: every rank sees it
        with pytest.raises(ValueError, match="shapes/dtypes differ"):
            hvd.broadcast(np.ones(1 + hvd.rank()), 0)
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum).numpy(), np.full(2, hvd.size()))


def test_layout_and_init(hvd_world):
    from mpi4py import MPI
    node = hvd_world.Split_type(MPI.COMM_TYPE_SHARED, key=hvd_world.rank)
    assert (hvd.rank(), hvd.size()) == (hvd_world.rank, hvd_world.size)
    assert (hvd.local_rank(), hvd.local_size()) == (node.rank, node.size)
    same_local = hvd_world.Split(node.rank, hvd_world.rank)
    assert (hvd.cross_rank(), hvd.cross_size()) == (same_local.rank, same_local.size)
    hvd.init()  # a second init is a no-op
    assert hvd.is_initialized()
    hvd.shutdown()
    with pytest.raises(ValueError, match="call hvd.init"):
        hvd.rank()
    with pytest.raises(TypeError, match="Intracomm"):
        hvd.init([0, 1])
    hvd.init()
    assert hvd.allreduce(np.ones(1), op=hvd.Sum).numpy()[0] == hvd.size()


# Gradients: each rank's loss is sum(w_r * f(collective(x))**2), w_r its own random weights; the oracle is the
# closed form of d(sum over ranks of every rank's loss)/dx_i, from every rank's x and w gathered with mpi4py.

def tape_gradient(loss, x, in_function):
    """d loss(x)/dx under a tf.GradientTape: eagerly (False), tape and loss inside a tf.function (True), or an
    eager tape around a tf.function loss ("outside": TensorFlow builds the function's backward graph)."""
    if in_function == "outside":
        loss = tf.function(loss)

    def grad(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = loss(x)
        return tape.gradient(y, x)
    return (tf.function(grad) if in_function is True else grad)(tf.constant(x))


@pytest.mark.parametrize("in_function", [False, True, "outside"])
@pytest.mark.parametrize("op, n_div", [(hvd.Sum, False), (hvd.Average, True)])
def test_allreduce_gradient(hvd_world, rng, op, n_div, in_function):
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))  # float64: exact oracle
    pre, post = 0.5, 3.0
    xs, ws = everyone(hvd_world, x), everyone(hvd_world, w)
    n = hvd.size()
    y = post * pre * (xs.mean(0) if n_div else xs.sum(0))
    # d/dx_i of sum_r sum(w_r * y**2) + sum(x_i): the allreduce term plus the local one
    want = pre * post * (2 * ws * y).sum(0) / (n if n_div else 1) + 1.0

    def loss(t):
        y = hvd.allreduce(t, op=op, prescale_factor=pre, postscale_factor=post)
        return tf.reduce_sum(w * y ** 2) + tf.reduce_sum(t)

    got = tape_gradient(loss, x, in_function)
    assert got is not None
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("in_function", [False, True, "outside"])
def test_allreduce_gradient_float32_and_issue_example(hvd_world, rng, in_function):
    x = rng.standard_normal(5).astype(np.float32)
    got = tape_gradient(lambda t: tf.reduce_sum(hvd.allreduce(t * (hvd.rank() + 1), op=hvd.Sum)), x, in_function)
    # d/dx_i sum_r sum(sum_j (j+1) x_j) = size * (i+1)
    np.testing.assert_allclose(got.numpy(), np.full(5, hvd.size() * (hvd.rank() + 1.0)), rtol=1e-6)


@pytest.mark.parametrize("op", [hvd.Min, hvd.Max, hvd.Product])
def test_allreduce_gradient_of_min_max_product_raises(hvd_world, rng, op):
    x = rng.standard_normal(3)
    with pytest.raises(NotImplementedError, match=f"no gradient for op '{op}'"):
        tape_gradient(lambda t: tf.reduce_sum(hvd.allreduce(t, op=op)), x, in_function=False)
    assert tape_gradient(lambda t: tf.reduce_sum(hvd.allreduce(tf.stop_gradient(t), op=op)) + tf.reduce_sum(t),
                         x, in_function=False).numpy().tolist() == [1.0] * 3


@pytest.mark.parametrize("in_function", [False, True, "outside"])
def test_allgather_gradient_uneven_rows(hvd_world, rng, in_function):
    rows = [(r * 2) % 5 for r in range(hvd.size())]  # 0, 2, 4 rows: rank 0 contributes none
    x = rng.standard_normal((rows[hvd.rank()], 3))
    w = rng.standard_normal((sum(rows), 3))
    ys, ws = np.concatenate(hvd_world.allgather(x)), everyone(hvd_world, w)
    start = sum(rows[:hvd.rank()])
    want = (2 * ws * ys).sum(0)[start:start + rows[hvd.rank()]]

    got = tape_gradient(lambda t: tf.reduce_sum(w * hvd.allgather(t) ** 2), x, in_function)
    assert got.shape == x.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("in_function", [False, True, "outside"])
@pytest.mark.parametrize("root", [0, -1])
def test_broadcast_gradient(hvd_world, rng, root, in_function):
    root = root % hvd.size()
    x, w = rng.standard_normal((2, 2)), rng.standard_normal((2, 2))
    x_root, ws = hvd_world.bcast(x, root=root), everyone(hvd_world, w)
    want = (2 * ws * x_root).sum(0) if hvd.rank() == root else np.zeros_like(x)
    want = want + 1.0  # the local term

    got = tape_gradient(lambda t: tf.reduce_sum(w * hvd.broadcast(t, root) ** 2) + tf.reduce_sum(t),
                        x, in_function)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
