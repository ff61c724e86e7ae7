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
arguments, result) -> result``) registered with ``register(stage, fn)``; stages run in registration order. A
process without a ``TorusStrategy`` (or a model of another strategy, when no TorusStrategy exists) runs Keras
unchanged.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

STAGES = ("model", "inputs", "callbacks", "result")
METHODS = ("fit", "evaluate", "predict")

_stages: dict[str, list[Callable]] = {stage: [] for stage in STAGES}
_active = {"strategy": None}


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


def _wrap(original: Callable, method: str) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(model, *args, **kwargs):
        strategy = _active["strategy"]
        if strategy is None:
            return original(model, *args, **kwargs)
        bound = signature.bind(model, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        extra = arguments.pop("kwargs", {}) if "kwargs" in signature.parameters else {}
        for stage in ("model", "inputs", "callbacks"):
            for fn in _stages[stage]:
                arguments = fn(strategy, method, arguments)
        result = original(**arguments, **extra)
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
