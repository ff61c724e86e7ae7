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
