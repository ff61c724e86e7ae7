"""The optimizer patch, the one entry of gradients into the reducer: all-reduced at the start of ``optimizer.apply``.

Keras 3's TensorFlow optimizer sums gradients across replicas late, inside ``_backend_update_step``: after
``LossScaleOptimizer`` checked them for inf/nan and after ``clipnorm`` / ``global_clipnorm`` / ``clipvalue``.
Under data parallelism both would then act on each rank's local gradient: one rank skips a step the others
take (their all-reduces pair off wrongly or hang), and clipping differs from one process. Summing first makes
both act on the global gradient, as one process on the global batch does: a non-finite local gradient makes
the sum non-finite (IEEE sums keep inf and nan), every rank sees the same bits and takes the same branch.
With ``gradient_accumulation_steps`` every micro-step's gradient is summed (the same total, more traffic).

``reduce_first(optimizer, strategy)`` replaces ``optimizer.apply`` on that instance (the outermost optimizer
the model holds, e.g. the ``LossScaleOptimizer``). It acts only inside ``strategy.run`` (the replica context of
that strategy), exactly where Keras would all-reduce; a custom loop calling ``apply_gradients`` outside it is
untouched. ``as_gradients`` wraps Keras' own gradient all-reduce (``TFOptimizer._all_reduce_sum_gradients``,
which every TF optimizer reaches): under a ``TorusStrategy`` it sums the gradients with the same reducer
(``reducer.reduce_gradients`` on ``strategy.host``: the buckets), unless ``reduce_first`` already did for this
apply (``_reduced``, this module's own flag), and never through the replica context's ``all_reduce``, which
stays for the other collectives (SyncBN's moments, a user's ``ctx.all_reduce``). Every optimizer that gets there
(the one whose ``update_step`` runs next: a ``LossScaleOptimizer``'s inner one) gets
``sparse.deterministic_scatters`` first, so its sparse updates give the same bits on every rank.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import tensorflow as tf

from torus.integrations.keras import compat
from torus.integrations.keras.collectives.reducer import reduce_gradients
from torus.integrations.keras.collectives.sparse import deterministic_scatters
from torus.integrations.keras.fit import fit_hook

_reduced: contextvars.ContextVar = contextvars.ContextVar("torus_gradients_reduced", default=None)


@contextlib.contextmanager
def _reduced_for(strategy):
    """While open (at trace time), the gradients that reach Keras' all-reduce under ``strategy`` are summed."""
    token = _reduced.set(strategy)
    try:
        yield
    finally:
        _reduced.reset(token)


def _sum_present(strategy, grads: list) -> list:
    """``grads`` summed over ranks where not None (the Nones stay in place)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    out = list(grads)
    for i, g in zip(present, reduce_gradients(strategy.host, [grads[i] for i in present], "sum")):
        out[i] = g
    return out


def reduce_first(optimizer, strategy) -> bool:
    """Make ``optimizer.apply`` (and so ``apply_gradients``) sum the gradients over ranks first; idempotent.
    Returns True when it changed ``optimizer`` now (a step function traced before must be traced again)."""
    current = optimizer.__dict__.get("apply")
    if current is not None and getattr(current, "_torus_strategy", None) is strategy:
        return False
    original = type(optimizer).apply.__get__(optimizer)

    @functools.wraps(original)
    def apply(grads, trainable_variables=None):
        context = tf.distribute.get_replica_context()
        if context is None or context.strategy is not strategy or _reduced.get() is strategy:
            return original(grads, trainable_variables)
        grads = _sum_present(strategy, list(grads))
        with _reduced_for(strategy):
            return original(grads, trainable_variables)

    apply._torus_strategy = strategy  # type: ignore[attr-defined]
    compat.set_on_instance(optimizer, "apply", apply)
    return True


def as_gradients(fn):
    """``TFOptimizer._all_reduce_sum_gradients`` that, under a ``TorusStrategy``, sums through the reducer."""

    @functools.wraps(fn)
    def all_reduce_sum_gradients(self, grads_and_vars):
        strategy = fit_hook.strategy_in_scope()
        if strategy is None:
            return fn(self, grads_and_vars)
        if tf.distribute.get_replica_context() is None:  # Keras would fail on with "'NoneType' ... merge_call"
            raise RuntimeError(
                f"TorusStrategy on rank {strategy.rank}: optimizer.apply / apply_gradients was called inside "
                "strategy.scope() but outside strategy.run, where no replica context exists to all-reduce the "
                "gradients. In a custom loop, run the step as tf.distribute's contract says: "
                "strategy.run(step_fn, args=(batch,)) on batches of strategy.experimental_distribute_dataset(...) "
                "(docs/keras.md, 'Custom loops'); or build the optimizer under the scope "
                "(optimizer.build(model.trainable_variables)), leave the scope, and all-reduce yourself with "
                "strategy.allreduce_gradients(grads) before apply")
        grads_and_vars = list(grads_and_vars)
        compat.filter_empty_gradients(grads_and_vars)  # Keras' warning for Nones, its error for no gradient
        deterministic_scatters(self)  # before its update_step traces the scatters, reduced here or already
        if _reduced.get() is strategy:
            return grads_and_vars
        grads = _sum_present(strategy, [g for g, _ in grads_and_vars])
        return [(g, v) for g, (_, v) in zip(grads, grads_and_vars)]

    return all_reduce_sum_gradients
