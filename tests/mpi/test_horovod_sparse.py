"""Sparse gradients through ``hvd.DistributedOptimizer`` (Horovod's script shape: each rank fits its own rows):
all-gathered as IndexedSlices by default (``sparse_as_dense=False``), so ``Embedding`` + Adam ends where one
process on the global batch ends; ``sparse_as_dense=True`` ends where one process that densifies its gradients
ends. Every rank ends bitwise equal."""
from __future__ import annotations

import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

from hvd_common import assert_close, assert_identical_across_ranks, hvd, init_world, rank_rows  # noqa: E402
from kerasref import B, DensifyingModel, Record, embedding_model, initial_weights, token_data  # noqa: E402

from torus.integrations.keras.fit import fit_hook  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def hvd_world():
    return init_world()


def _fit(model, x, y, batch, callbacks=()):
    rec = Record()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[*callbacks, rec])
    return rec.steps


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_embedding_adam_trains_as_one_process(hvd_world, sparse_as_dense):
    x, y = token_data(41 + sparse_as_dense, B * STEPS)
    w0 = initial_weights(embedding_model(None), seed=43)
    model = embedding_model(w0)
    model.compile(optimizer=hvd.DistributedOptimizer(model.optimizer, sparse_as_dense=sparse_as_dense),
                  loss=model.loss, jit_compile=False)
    rows = rank_rows(len(x), hvd.size(), hvd.rank(), B)
    steps = _fit(model, x[rows], y[rows], B // hvd.size())
    with fit_hook.local():
        reference = embedding_model(w0, DensifyingModel) if sparse_as_dense else embedding_model(w0)
        ref = _fit(reference, x, y, B)
    assert len(steps) == len(ref) == STEPS
    for k in range(STEPS):
        assert_identical_across_ranks(hvd_world, steps[k], f"step {k}")
        assert_close(steps[k], ref[k], f"sparse_as_dense={sparse_as_dense} vs one process, step {k}")
