"""Gradients all-reduced at the start of ``optimizer.apply``, before anything looks at them.

Keras 3's TensorFlow optimizer sums gradients across replicas late, inside ``_backend_update_step``: after
``LossScaleOptimizer`` checked them for inf/nan and after ``clipnorm`` / ``global_clipnorm`` / ``clipvalue``.
Under data parallelism both would then act on each rank's local gradient: one rank skips a step the others
take (their all-reduces pair off wrongly or hang), and clipping differs from one process. Summing first makes
both act on the global gradient, as one process on the global batch does: a non-finite local gradient makes
the sum non-finite (IEEE sums keep inf and nan), every rank sees the same bits and takes the same branch.
With ``gradient_accumulation_steps`` every micro-step's gradient is summed (the same total, more traffic).

``reduce_first(optimizer, strategy)`` replaces ``optimizer.apply`` on that instance (the outermost optimizer
the model holds, e.g. the ``LossScaleOptimizer``); the inner all-reduce Keras still reaches passes the values
through (``_TorusExtended.gradients_reduced``). The wrapper acts only inside ``strategy.run`` (the replica
context of that strategy), exactly where Keras would all-reduce; a custom loop calling ``apply_gradients``
outside it is untouched.

``as_gradients`` wraps Keras' own gradient all-reduce (``TFOptimizer._all_reduce_sum_gradients``, what an
optimizer without ``reduce_first`` reaches inside ``strategy.run``) so that the strategy knows the values are
gradients (``_TorusExtended.reducing_gradients``): they go to the bucketed host, while the replica context's other
all-reduces (SyncBN's moments, a user's ``ctx.all_reduce``) go to the replica host. Every optimizer that gets
there (the one whose ``update_step`` runs next: a ``LossScaleOptimizer``'s inner one) gets
``sparse.deterministic_scatters`` first, so its sparse updates give the same bits on every rank.
"""
from __future__ import annotations

import functools

import tensorflow as tf

from torus.integrations.keras import compat
from torus.integrations.keras.collectives.sparse import deterministic_scatters, reduce_gradients


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
        extended = strategy.extended
        if context is None or context.strategy is not strategy or extended._passing:
            return original(grads, trainable_variables)
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        for i, g in zip(present, reduce_gradients(strategy.host, [grads[i] for i in present], "sum")):
            grads[i] = g
        with extended.gradients_reduced():
            return original(grads, trainable_variables)

    apply._torus_strategy = strategy  # type: ignore[attr-defined]
    compat.set_on_instance(optimizer, "apply", apply)
    return True


def as_gradients(fn):
    """``TFOptimizer._all_reduce_sum_gradients`` whose all-reduce, under a ``TorusStrategy``, is the gradients'."""

    @functools.wraps(fn)
    def all_reduce_sum_gradients(self, grads_and_vars):
        strategy = tf.distribute.get_strategy()
        reducing = getattr(strategy.extended, "reducing_gradients", None)
        if reducing is None:  # not a TorusStrategy
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
        deterministic_scatters(self)  # before its update_step traces the scatters
        with reducing():
            return fn(self, grads_and_vars)

    return all_reduce_sum_gradients
