"""What makes ``model.fit`` / ``evaluate`` / ``predict`` data-parallel without opt-in callbacks.

Keras 3's TensorFlow trainer builds its callback list and data iterator inside ``fit``; a strategy alone cannot
reach either before the first step. ``install(strategy)`` (called by ``TorusStrategy.__init__``, idempotent)
wraps the three methods of ``keras.src.backend.tensorflow.trainer.TensorFlowTrainer`` once per process. Each
wrapper binds the call's arguments by name, then hands them through the stages below in order, then calls the
original method:

- ``check_model`` (stage "model"): the model must run under the active ``TorusStrategy``, or be moved under it,
  or the call is refused with an error naming the rank and the reason (never a silent local run).
- ``prepare_inputs`` (stage "inputs"): how inputs are sharded per rank (``batch_size`` is the global batch).
- ``prepare_callbacks`` (stage "callbacks"): the internal callbacks go first (initial-state broadcast, global
  metrics), so every user callback in any order sees global values; file callbacks become rank-aware.
- ``finish`` (stage "result"): what the call returns (e.g. ``evaluate``'s global logs, ``predict``'s rows in
  the order of the inputs).

A stage is a function ``(strategy, method, arguments) -> arguments`` (``finish``: ``(strategy, method,
arguments, result) -> result``) registered with ``register(stage, fn)``; stages run in registration order.
``arguments`` maps every parameter name to its value (``"self"`` is the model), plus any extra keyword the call
passed (``evaluate``'s private ``_use_cached_eval_dataset=True`` when ``fit`` validates). ``strategy`` is the
model's own ``TorusStrategy`` when it was created under one, else the one created last. A process without a
``TorusStrategy`` (or a model of another strategy, when no TorusStrategy exists) runs Keras unchanged, and so
do every call inside ``with fit_hook.local():`` and a model whose optimizer all-reduces by itself (Horovod's
``DistributedOptimizer``, outside any strategy scope).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable

STAGES = ("model", "inputs", "callbacks", "result")
METHODS = ("fit", "evaluate", "predict")

_stages: dict[str, list[Callable]] = {stage: [] for stage in STAGES}
_active = {"strategy": None, "local": 0}


def register(stage: str, fn: Callable) -> Callable:
    """Add ``fn`` to ``stage`` (one of ``STAGES``); returns ``fn`` (usable as a decorator factory's result)."""
    if stage not in _stages:
        raise ValueError(f"fit_hook.register: unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    if fn not in _stages[stage]:
        _stages[stage].append(fn)
    return fn


def active_strategy():
    """The ``TorusStrategy`` this process created last, or ``None``."""
    return _active["strategy"]


@contextlib.contextmanager
def local():
    """Inside the block, fit/evaluate/predict run as plain Keras on this rank alone: no stage runs, so a model
    created outside any strategy scope is not moved under the TorusStrategy. For single-process references
    (tests) and a chief-only evaluation of a plain model. A model created under the strategy keeps
    all-reducing in its step functions, so every rank must still call it."""
    _active["local"] += 1
    try:
        yield
    finally:
        _active["local"] -= 1


def strategy_for(model):
    """The ``TorusStrategy`` a call on ``model`` runs under: the model's own, else the active one (or None)."""
    from torus.integrations.keras.strategy import TorusStrategy

    own = getattr(model, "_distribute_strategy", None)
    active = _active["strategy"]
    return own if active is not None and isinstance(own, TorusStrategy) else active


def _self_distributed(model) -> bool:
    """True when the model's optimizer (or one it wraps) all-reduces by itself and the model is of no strategy:
    Horovod's ``DistributedOptimizer`` (``torus.integrations.keras.horovod``), whose users feed per-rank data
    and average metrics with callbacks, as in Horovod. Such a model runs as plain Keras on every rank."""
    if getattr(model, "_distribute_strategy", None) is not None:
        return False
    optimizer, seen = getattr(model, "optimizer", None), 0
    while optimizer is not None and seen < 8:
        if getattr(optimizer, "_torus_self_distributed", False):
            return True
        optimizer, seen = getattr(optimizer, "inner_optimizer", None), seen + 1
    return False


def _wrap(original: Callable, method: str) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(model, *args, **kwargs):
        strategy = strategy_for(model)
        if strategy is None or _active["local"] or _self_distributed(model):
            return original(model, *args, **kwargs)
        bound = signature.bind(model, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.update(arguments.pop("kwargs", {}) if "kwargs" in signature.parameters else {})
        for stage in ("model", "inputs", "callbacks"):
            for fn in _stages[stage]:
                arguments = fn(strategy, method, arguments)
        result = original(**arguments)
        for fn in _stages["result"]:
            result = fn(strategy, method, arguments, result)
        return result

    wrapper._torus_original = original  # type: ignore[attr-defined]
    return wrapper


def install(strategy) -> None:
    """Make ``strategy`` the active one and wrap fit/evaluate/predict (once per process)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    _active["strategy"] = strategy
    for method in METHODS:
        current = getattr(TensorFlowTrainer, method)
        if not hasattr(current, "_torus_original"):
            setattr(TensorFlowTrainer, method, _wrap(current, method))


def add_callback(arguments: dict, cls, *args) -> dict:
    """For a stage "callbacks": ``arguments`` with ``cls(*args)`` appended to the call's callbacks unless one
    of ``cls`` is there already (a ``CallbackList`` that Keras built is extended in place, the callback given
    the model and the list's params; a list or single callback becomes a new list)."""
    import keras

    callbacks = arguments.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        if not any(isinstance(c, cls) for c in callbacks.callbacks):
            mine = cls(*args)
            mine.set_model(arguments["self"])
            mine.set_params(callbacks.params)
            callbacks.callbacks.append(mine)
        return arguments
    listed = keras.tree.flatten(callbacks) if callbacks else []
    if not any(isinstance(c, cls) for c in listed):
        listed.append(cls(*args))
    return {**arguments, "callbacks": listed}
