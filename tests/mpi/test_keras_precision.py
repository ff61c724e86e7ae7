"""Mixed precision and gradient clipping under TorusStrategy act on the global gradient, as one process on the
global batch does.

- ``mixed_float16``: one rank's rows overflow in step 1 (an input beyond float16's range, so that rank's local
  gradient is nan and the others' are finite). Every rank must skip that step, halve its loss scale and keep
  going in step, as one process skips it (the row is in its batch too).
- ``mixed_bfloat16`` (no loss scaling) follows one process to bfloat16 rounding.
- ``clipnorm`` / ``global_clipnorm`` / ``clipvalue`` (and ``gradient_accumulation_steps``) clip the all-reduced
  gradient: within 1e-5 of one process in float32, where clipping each rank's local gradient was 0.05 off.

Runs at 1, 2 and 3 ranks only.
"""
import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from kerasref import B, Record, assert_identical_across_ranks, assert_steps_match, data, dense_model, initial_weights  # noqa: E402

from torus.integrations.keras import TorusStrategy  # noqa: E402
from torus.integrations.keras.fit import fit_hook  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


@pytest.fixture
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def run(model, x, y, batch, optimizer_fn, strategy=None):
    """Fit one epoch; return the weights after every step. ``strategy`` None: a plain single-process fit."""
    rec = Record()
    if strategy is None:
        with fit_hook.local():
            model.compile(optimizer_fn(), loss())
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    else:
        with strategy.scope():
            model.compile(optimizer_fn(), loss())
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    return rec.steps


def pair(strategy, optimizer_fn, x, y, seed):
    """(distributed steps, distributed model, reference steps, reference model) from the same start."""
    w0 = initial_weights(dense_model(), seed)
    ref = dense_model()
    ref.set_weights(w0)
    ref_steps = run(ref, x, y, B, optimizer_fn)
    with strategy.scope():
        model = dense_model()
    model.set_weights([w + strategy.rank for w in w0])  # the initial broadcast must undo this
    steps = run(model, x, y, B, optimizer_fn, strategy)
    return steps, model, ref_steps, ref


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_float16_overflow_on_one_rank_skips_the_step_everywhere(world, strategy, policy):
    x, y = data(seed=2, n=B * STEPS)
    x[2 * B - 1] = 1e5  # step 1, the last rank's rows: inf in float16, so that rank's gradient is nan
    steps, model, ref_steps, ref = pair(strategy, lambda: keras.optimizers.SGD(0.3, momentum=0.5), x, y, 3)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    # float16 forward and backward passes: a rank's 1/size of the batch rounds differently from all of it.
    assert_steps_match(world, steps, ref_steps, atol=2e-3, what="mixed_float16 step")
    for k, (a, b) in enumerate([(steps[0], steps[1]), (ref_steps[0], ref_steps[1])]):
        assert all(np.array_equal(u, v) for u, v in zip(a, b)), f"step 1 was applied ({'ref' if k else 'fit'})"
    assert not all(np.array_equal(u, v) for u, v in zip(steps[1], steps[2])), "step 2 was skipped"
    scale, ref_scale = (float(np.asarray(m.optimizer.dynamic_scale)) for m in (model, ref))
    assert scale == ref_scale == 2.0 ** 14
    assert_identical_across_ranks(world, [np.asarray(v) for v in model.optimizer.variables], "optimizer state")
    assert int(np.asarray(model.optimizer.iterations)) == int(np.asarray(ref.optimizer.iterations)) == STEPS - 1


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_bfloat16_matches_one_process(world, strategy, policy):
    x, y = data(seed=4, n=B * STEPS)
    steps, _, ref_steps, _ = pair(strategy, lambda: keras.optimizers.SGD(0.3, momentum=0.5), x, y, 5)
    assert_steps_match(world, steps, ref_steps, atol=2e-2, what="mixed_bfloat16 step")


CLIPPING = {
    "clipnorm": dict(clipnorm=0.05),
    "global_clipnorm": dict(global_clipnorm=0.05),
    "clipvalue": dict(clipvalue=0.01),
    "global_clipnorm+accumulation": dict(global_clipnorm=0.05, gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("name", list(CLIPPING))
def test_clipping_acts_on_the_global_gradient(world, strategy, name):
    x, y = data(seed=6, n=B * STEPS)
    steps, _, ref_steps, _ = pair(strategy, lambda: keras.optimizers.SGD(0.5, **CLIPPING[name]), x, y, 7)
    assert_steps_match(world, steps, ref_steps, what=f"{name} step")
    unclipped = dense_model()
    unclipped.set_weights(initial_weights(dense_model(), 7))
    accumulation = CLIPPING[name].get("gradient_accumulation_steps")
    plain = run(unclipped, x, y, B, lambda: keras.optimizers.SGD(0.5, gradient_accumulation_steps=accumulation))
    assert max(np.abs(a - b).max() for a, b in zip(plain[-1], ref_steps[-1])) > 1e-3, "clipping never acted"
