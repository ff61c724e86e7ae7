"""The Keras all-reduce through a shared ``TorusComm.alloc`` buffer (integrations/keras/collectives/window.py):
where it is taken, results against MPI and the out-of-place path (bitwise identical across ranks), outputs TensorFlow
still holds never overwritten, the bound on shared buffers, and ``fit`` equal to one process with it.

Runs at 1, 2 and 3 ranks (TensorFlow is heavy on the 2-core test machine); at 1 rank the path is never taken
and the tests check that.
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
from kerasref import B, Record, assert_identical_across_ranks, assert_steps_match, data, dense_model, initial_weights  # noqa: E402

from oracle import one_node  # noqa: E402
from torus import TorusComm  # noqa: E402
from torus.integrations.keras import HostAllreduce, TorusStrategy, allreduce_tensors  # noqa: E402
from torus.integrations.keras.collectives import window as window_module  # noqa: E402
from torus.integrations.keras.collectives.buckets import MAX_STAGING  # noqa: E402
from torus.integrations.keras.fit import fit_hook  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()
SHM = SIZE > 1 and one_node()  # where auto picks shm for these small buffers (torus/select.py)


@pytest.fixture(scope="module")
def tc():
    return TorusComm()


def _mpi_sum(world, local):
    want = np.empty_like(local)
    world.Allreduce(local, want)
    return want


def _tensors(rng):
    """Mixed shapes and dtypes (0-d, odd sizes, a float32 group of several tensors)."""
    return [rng.standard_normal((3, 5)).astype(np.float32), np.float32(rng.standard_normal()),
            rng.standard_normal(7), rng.integers(-9, 9, (2, 3)).astype(np.int32),
            rng.standard_normal(1001).astype(np.float32)]


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
def test_window_matches_mpi_and_the_copy_path(world, tc, rng, compression):
    local = _tensors(rng)
    win = HostAllreduce(tc, "auto", compression)
    copy = HostAllreduce(tc, "auto", compression, window=False)
    assert win.in_window([tf.constant(local[0]), tf.constant(local[4])]) == SHM
    assert not copy.in_window([tf.constant(local[0])])
    got = allreduce_tensors(win, [tf.constant(x) for x in local], "sum")
    ref = allreduce_tensors(copy, [tf.constant(x) for x in local], "sum")
    assert win.windows.made == (3 if SHM else 0)  # float32, float64, int32
    assert_identical_across_ranks(world, [g.numpy() for g in got], "window path")
    for g, r, x in zip(got, ref, local):
        want = _mpi_sum(world, np.asarray(x))
        assert g.shape == want.shape and g.dtype.as_numpy_dtype == want.dtype
        # the two paths may sum in another rank order (shm's small calls reduce in rank order), so only
        # integers are compared exactly
        tol = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-2}[compression] if want.dtype == np.float32 else 1e-12
        for other in (r.numpy(), want):
            np.testing.assert_allclose(g.numpy(), other, rtol=tol, atol=tol * np.abs(want).max(initial=1))
        if want.dtype.kind == "i":
            np.testing.assert_array_equal(g.numpy(), want)


def test_only_where_shm_runs(tc):
    x = [tf.zeros((4, 4)), tf.zeros(3)]
    assert not HostAllreduce(tc, "ring").in_window(x)
    assert HostAllreduce(tc, "shm").in_window(x) == SHM
    assert not HostAllreduce(tc, "shm").in_window([tf.zeros((0,))])  # nothing to reduce
    assert not HostAllreduce(tc, "shm").in_window([tf.constant([True])])  # a dtype torus does not reduce


def test_held_outputs_are_never_overwritten(world, tc, rng):
    """A tf.function returning the reduced tensors: TensorFlow keeps the returned arrays as their memory, so
    later calls of the same layout must write elsewhere; once they are dropped the buffers are reused."""
    host = HostAllreduce(tc, "auto")
    step = tf.function(lambda g: allreduce_tensors(host, g, "avg"))
    kept = []
    for _ in range(4):
        local = [rng.standard_normal((6, 2)).astype(np.float32), rng.standard_normal(33).astype(np.float32)]
        want = [_mpi_sum(world, x) / SIZE for x in local]
        kept.append((step([tf.constant(x) for x in local]), want))
    for got, want in kept:
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w, rtol=1e-6, atol=1e-6)
    if SHM:
        pool = next(iter(host.windows._outputs.values()))
        assert len(pool) == window_module.POOL
        del kept, got
        assert all(window_module._unused(e) for e in pool)


def test_more_layouts_than_kept(world, tc, rng):
    """Cycling through more layouts than MAX_STAGING: the least recently used shared buffer is freed (on
    every rank at the same call) and results stay right."""
    host = HostAllreduce(tc, "auto")
    n = MAX_STAGING + 2
    for _ in range(2):
        for k in range(1, n + 1):
            x = rng.integers(-50, 50, k).astype(np.int64)
            (got,) = allreduce_tensors(host, [tf.constant(x)], "sum")
            np.testing.assert_array_equal(got.numpy(), _mpi_sum(world, x))
    assert host.windows.windows == (MAX_STAGING if SHM else 0)
    assert host.windows.made == (2 * n if SHM else 0)


def test_a_full_dev_shm_keeps_ordinary_buffers(world, tc, rng, monkeypatch):
    """Where the node's /dev/shm cannot hold a shared buffer (here: alloc asks for more headroom than any
    machine has), alloc raises MemoryError on every rank and the window path all-reduces an ordinary array
    instead, with the same results; more layouts than kept then still cycle without freeing those."""
    import torus.runtime.shm as shm_module
    monkeypatch.setattr(shm_module, "SHM_HEADROOM_BYTES", 1 << 62)
    host = HostAllreduce(tc, "auto")
    for _ in range(2):
        for k in range(1, MAX_STAGING + 3):
            x = rng.integers(-50, 50, k).astype(np.int64)
            (got,) = allreduce_tensors(host, [tf.constant(x)], "sum")
            np.testing.assert_array_equal(got.numpy(), _mpi_sum(world, x))
    if SHM:
        with pytest.raises(MemoryError, match=f"alloc on rank {world.Get_rank()}: a shared buffer of 4096 bytes"):
            tc.alloc(10, np.float32)


def test_fit_through_the_window_matches_one_process(world):
    strategy = TorusStrategy()
    x, y = data(seed=11, n=B * 4)
    w0 = initial_weights(dense_model(), seed=12)

    def build():
        model = dense_model()
        model.set_weights(w0)
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        return model

    def fit(model):
        rec = Record()
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
        return rec.steps

    with strategy.scope():
        model = build()
    steps = fit(model)
    with fit_hook.local():
        ref_steps = fit(build())
    assert strategy.host.windows.made == (1 if SHM else 0)
    assert_steps_match(world, steps, ref_steps)


def test_shapes_unknown_when_traced_keep_the_copy_path(world, tc, rng):
    host = HostAllreduce(tc, "auto")
    step = tf.function(lambda a, b: allreduce_tensors(host, [a, b], "sum"),
                       input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([2, 2], tf.float32)])
    for n in (3, 40):
        a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal((2, 2)).astype(np.float32)
        got = step(tf.constant(a), tf.constant(b))
        for g, x in zip(got, (a, b)):
            np.testing.assert_allclose(g.numpy(), _mpi_sum(world, x), rtol=1e-6, atol=1e-6)
    assert host.windows.made == 0
