"""Stage "model" of ``fit_hook``: the model of a ``fit`` / ``evaluate`` / ``predict`` call runs under the strategy.

Keras binds a model to the ``tf.distribute`` strategy whose scope was open when the model was created
(``model._distribute_strategy``), and an optimizer to the one open when it was created. A model created,
loaded (``keras.models.load_model``) or compiled outside ``strategy.scope()`` would otherwise train with no
all-reduce and silently drift apart on each rank. ``adopt_model``:

- a model of no strategy (or an optimizer of none) is moved under this one: ``_distribute_strategy`` /
  ``_distribution_strategy`` set, the step functions dropped so Keras traces them again under the strategy
  (its loss then scales by ``1 / size`` and its gradients are all-reduced); the chief warns once per model;
- a model of another ``tf.distribute`` strategy is refused (``ValueError`` naming the rank);
- ``fit`` / ``evaluate`` with ``jit_compile=True`` are refused (XLA cannot compile the ``tf.numpy_function``
  that calls MPI), before any communication;
- ``fit``: the optimizer all-reduces gradients first (``fit/optimizer.py``, ``reduce_first``; a step function traced
  before is traced again); the chief warns once per model that has ``BatchNormalization(synchronized=False)``
  layers (they normalize over each rank's part of the batch and keep per-rank moving statistics, as Keras
  declares for them; ``synchronized=True`` all-reduces the batch statistics through the strategy and matches
  one process).

Variables created outside the scope are ordinary variables, which is what the one-device strategy underneath
creates too, so a moved model trains exactly as one created under the scope (tests/mpi/test_keras_adopt.py).
"""
from __future__ import annotations

import warnings

from torus.integrations.keras import compat
from torus.integrations.keras.fit.optimizer import reduce_first


def _optimizers(optimizer) -> list:
    """The optimizer and the ones it wraps (``LossScaleOptimizer.inner_optimizer``)."""
    out = []
    while optimizer is not None and optimizer not in out:
        out.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return out


def _move(model, strategy, method: str) -> None:
    own = compat.model_strategy(model)
    if own is not None and own is not strategy:
        raise ValueError(f"TorusStrategy on rank {strategy.rank}: model.{method}() on a model created under "
                         f"{type(own).__name__}; create (or load) it under the TorusStrategy's scope()")
    outer = getattr(model, "optimizer", None)
    foreign = [opt for opt in _optimizers(outer) if compat.optimizer_strategy(opt) is not strategy]
    for opt in foreign:
        theirs = compat.optimizer_strategy(opt)
        if theirs is not None and theirs is not compat.default_strategy():
            raise ValueError(f"TorusStrategy on rank {strategy.rank}: model.{method}() with an optimizer created "
                             f"under {type(theirs).__name__}; create it under the TorusStrategy's scope()")
    if foreign and outer is not None and not outer.built and model.built:
        # Its slots must be colocated by the strategy that created the variables (none, here).
        outer.build(model.trainable_variables)
    for opt in foreign:
        compat.set_optimizer_strategy(opt, strategy)
    moved = own is None or bool(foreign)
    if not moved:
        return
    compat.set_model_strategy(model, strategy)
    model.train_function = model.test_function = model.predict_function = None
    if strategy.is_chief:
        warnings.warn(f"TorusStrategy: model {model.name!r} (or its optimizer) was created outside "
                      "strategy.scope(); moved under the strategy for this and later calls", stacklevel=4)


def _warn_local_batch_norm(model, strategy) -> None:
    if not strategy.is_chief or getattr(model, "_torus_warned_batch_norm", False):
        return
    import keras

    local = [layer.name for layer in compat.flatten_layers(model)
             if isinstance(layer, keras.layers.BatchNormalization) and not layer.synchronized]
    if local:
        compat.set_on_instance(model, "_torus_warned_batch_norm", True)
        warnings.warn(f"TorusStrategy: BatchNormalization layers {local[:3]}{' ...' if len(local) > 3 else ''} "
                      "normalize over each rank's part of the batch and keep per-rank moving statistics; pass "
                      "synchronized=True to normalize over the global batch as one process does", stacklevel=4)


def adopt_model(call) -> None:
    """Stage "model": move the model under ``call.strategy`` or refuse it; see the module docstring."""
    strategy, method, model = call.strategy, call.method, call.arguments["self"]
    _move(model, strategy, method)
    if method in ("fit", "evaluate") and model.jit_compile:
        raise ValueError(f"TorusStrategy on rank {strategy.rank}: model.{method}() with jit_compile=True; "
                         "compile the model with jit_compile=False (XLA cannot compile the tf.numpy_function "
                         "that calls MPI; Keras' default 'auto' turns XLA on when a GPU is visible and the model "
                         "was compiled outside strategy.scope())")
    if method == "fit":
        if reduce_first(model.optimizer, strategy):
            model.train_function = None  # e.g. traced by train_on_batch before, with Keras' late all-reduce
        _warn_local_batch_norm(model, strategy)
