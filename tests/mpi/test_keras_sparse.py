"""Sparse gradients (``Embedding``'s ``tf.IndexedSlices``) under ``TorusStrategy``: all-gathered as
IndexedSlices by default, so ``fit`` with Adam (which updates a sparse gradient row by row, unlike the same
gradient made dense) ends where one process on the global batch ends; ``sparse_as_dense=True`` ends where one
process that densifies its gradients ends; ``strategy.allreduce_gradients`` returns every rank's rows and indices
in rank order (mpi4py's allgather as the oracle)."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
from kerasref import B, DensifyingModel, Record, assert_steps_match, initial_weights, token_data  # noqa: E402
from kerasref import embedding_model as build  # noqa: E402

from torus.integrations.keras import TorusStrategy  # noqa: E402
from torus.integrations.keras.fit import fit_hook  # noqa: E402


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


def fit(model, x, y):
    rec = Record()
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[rec])
    return rec.steps


@pytest.mark.parametrize("overlap", [False, True])
def test_sparse_gradients_train_as_one_process(world, strategy, overlap):
    x, y = token_data(31, 4 * B)
    w0 = initial_weights(build(None), seed=32)
    strategy.host.overlap = overlap
    try:
        with strategy.scope():
            model = build(w0)
        steps = fit(model, x, y)
    finally:
        strategy.host.overlap = False
    with fit_hook.local():
        ref = fit(build(w0), x, y)
    assert_steps_match(world, steps, ref, atol=1e-5, what=f"Embedding + Adam, overlap {overlap}")


def test_sparse_as_dense_trains_as_one_process_with_dense_gradients(world, strategy):
    x, y = token_data(33, 4 * B)
    w0 = initial_weights(build(None), seed=34)
    strategy.host.sparse_as_dense = True
    try:
        with strategy.scope():
            model = build(w0)
        steps = fit(model, x, y)
    finally:
        strategy.host.sparse_as_dense = False
    with fit_hook.local():
        ref = fit(build(w0, DensifyingModel), x, y)
    assert_steps_match(world, steps, ref, atol=1e-5, what="sparse_as_dense")


@pytest.mark.parametrize("rows", [0, 1, 7])
def test_allreduce_gradients_gathers_rows_and_indices(world, strategy, rows):
    rank, size = world.rank, world.size
    n = rows + rank if rows else 0  # row counts differ across ranks (and are all zero in one case)
    rng = np.random.default_rng(100 + rank)
    values = rng.standard_normal((n, 3, 2)).astype(np.float32)
    indices = rng.integers(0, 9, n).astype(np.int32)
    dense = rng.standard_normal(5).astype(np.float32)

    @tf.function
    def step(v, i, d):
        return strategy.allreduce_gradients([tf.IndexedSlices(v, i, tf.constant([9, 3, 2], tf.int64)), d], "avg")

    sparse, reduced = step(tf.constant(values), tf.constant(indices), tf.constant(dense))
    assert isinstance(sparse, tf.IndexedSlices)
    want_values = np.concatenate(world.allgather(values)).reshape(-1, 3, 2) / np.float32(size)
    want_indices = np.concatenate(world.allgather(indices.astype(np.int64)))
    np.testing.assert_array_equal(sparse.indices.numpy(), want_indices)
    np.testing.assert_allclose(sparse.values.numpy(), want_values, rtol=1e-6)
    np.testing.assert_array_equal(sparse.dense_shape.numpy(), [9, 3, 2])
    np.testing.assert_allclose(reduced.numpy(), sum(world.allgather(dense)) / size, rtol=1e-5)
