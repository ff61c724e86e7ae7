"""BatchNormalization under TorusStrategy: ``synchronized=True`` all-reduces the batch statistics through the
strategy, so fit matches one process on the global batch (moving statistics included) and ranks stay bitwise
identical; a model with unsynchronized layers trains, with a warning on the chief.

Runs at 1, 2 and 3 ranks only.
"""
import warnings

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from kerasref import B, Record, assert_steps_match, data, initial_weights  # noqa: E402

from torus.integrations.keras import TorusStrategy  # noqa: E402
from torus.integrations.keras.fit import fit_hook  # noqa: E402


def bn_model(synchronized):
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5),
                             keras.layers.BatchNormalization(synchronized=synchronized), keras.layers.Dense(3)])


def compile_(model):
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.parametrize("synchronized", [True, False])
def test_batch_norm(world, synchronized):
    strategy = TorusStrategy()
    x, y = data(seed=8, n=B * 4)
    w0 = initial_weights(bn_model(False), seed=9)
    w0[5] = np.abs(w0[5]) + 0.5  # the moving variance must be positive
    ref = bn_model(synchronized)
    ref.set_weights(w0)
    compile_(ref)
    rec = Record()
    with fit_hook.local():
        ref.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    with strategy.scope():
        model = bn_model(synchronized)
        model.set_weights(w0)
        compile_(model)
    got = Record()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
                  callbacks=[got])
    warned = [w for w in seen if "synchronized=True" in str(w.message)]
    assert len(warned) == (1 if strategy.is_chief and not synchronized else 0)
    if synchronized:
        assert_steps_match(world, got.steps, rec.steps, what="synchronized BatchNormalization step")
