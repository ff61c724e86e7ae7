"""What makes ``model.fit`` / ``evaluate`` / ``predict`` data-parallel without opt-in callbacks.

Keras 3's TensorFlow trainer builds its callback list and data iterator inside ``fit``; a strategy alone cannot
reach either before the first step. ``install(strategy)`` (called by ``TorusStrategy.__init__``, idempotent)
wraps the three methods of Keras' ``TensorFlowTrainer`` once per process (``compat.install``). Each
wrapper binds the call's arguments by name, then hands them through the stages below in order, then calls the
original method:

- stage "model": the model must run under the active ``TorusStrategy``, or be moved under it, or the call is
  refused with an error naming the rank and the reason (never a silent local run);
- stage "inputs": how inputs are sharded per rank (``batch_size`` is the global batch);
- stage "callbacks": the internal callbacks go first (initial-state broadcast, global metrics), so every user
  callback in any order sees global values; file callbacks become rank-aware;
- stage "result": what the call returns (e.g. ``evaluate``'s global logs, ``predict``'s rows in the order of
  the inputs).

``PIPELINE`` lists every stage function in the order they run, in one place. A stage function takes the
call, a :class:`Call` (``strategy``, ``method``, ``arguments``, ``scratch``), and changes ``call.arguments``;
a "result" function takes ``(call, result)`` and returns the result. ``arguments`` maps every parameter name
to its value (``"self"`` is the model), plus any extra keyword the call passed (``evaluate``'s private
``_use_cached_eval_dataset=True`` when ``fit`` validates). ``scratch`` is a dict that lives for this one
call: what one stage leaves for a later one (predict's row recorder) goes there, never in module state.
``strategy`` is ``strategy_of(model, adopting=True)``: the model's own ``TorusStrategy``, else the one created
last; every stage reads it there, and the patch wrappers look a model's strategy up with ``strategy_of`` alone.
A process without a ``TorusStrategy`` runs Keras unchanged, and so do every call inside ``with
fit_hook.local():`` and a model whose optimizer all-reduces by itself (Horovod's ``DistributedOptimizer``,
outside any strategy scope). The methods are wrapped by ``compat.install`` (a row of ``compat.PATCH_SITES``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

STAGES = ("model", "inputs", "callbacks", "result")
METHODS = ("fit", "evaluate", "predict")

# (stage, module of torus.integrations.keras, function), in the order they run.
PIPELINE = (
    ("model", "fit.saving", "count_start"),
    ("model", "fit.adopt", "adopt_model"),
    ("inputs", "fit.inputs", "prepare_inputs"),
    ("callbacks", "fit.inputs", "input_callbacks"),
    ("callbacks", "fit.files", "rank_aware_callbacks"),
    ("callbacks", "fit.quiet", "quiet_other_ranks"),
    ("callbacks", "fit.initial_state", "add_initial_state"),
    ("callbacks", "fit.snapshots", "add_snapshots"),
    ("callbacks", "fit.step_timeline", "add_step_timeline"),
    ("result", "fit.inputs", "gather_predictions"),
    ("result", "fit.files", "files_in_place"),
    ("result", "fit.saving", "count_end"),
    ("result", "fit.snapshots", "restore_history"),
)


@dataclasses.dataclass
class Call:
    """One fit / evaluate / predict call as the stages see it (see the module docstring)."""

    strategy: Any  # a TorusStrategy
    method: str
    arguments: dict
    scratch: dict = dataclasses.field(default_factory=dict)


@functools.cache
def stages() -> dict[str, list[Callable]]:
    """``PIPELINE``'s functions by stage, in order (imported on first use: they import TensorFlow)."""
    out: dict[str, list[Callable]] = {stage: [] for stage in STAGES}
    for stage, module, name in PIPELINE:
        out[stage].append(getattr(importlib.import_module(f"torus.integrations.keras.{module}"), name))
    return out


@contextlib.contextmanager
def local():
    """Inside the block, fit/evaluate/predict run as plain Keras on this rank alone: no stage runs, so a model
    created outside any strategy scope is not moved under the TorusStrategy. For single-process references
    (tests) and a chief-only evaluation of a plain model. A model created under the strategy keeps
    all-reducing in its step functions, so every rank must still call it."""
    from torus.integrations.keras.strategy import TorusStrategy

    TorusStrategy.local_depth += 1
    try:
        yield
    finally:
        TorusStrategy.local_depth -= 1


def strategy_of(model, *, adopting: bool = False):
    """The ``TorusStrategy`` of ``model``: the one it was created (or moved) under, else None. With ``adopting``
    (``fit`` / ``evaluate`` / ``predict`` and the saves, which move a model of no TorusStrategy under one, or
    refuse a model of another strategy): else the one this process created last (None where it created none).
    Every patch wrapper with a model at hand looks its strategy up here."""
    from torus.integrations.keras.compat import model_strategy
    from torus.integrations.keras.strategy import TorusStrategy

    own = model_strategy(model)
    if isinstance(own, TorusStrategy):
        return own
    return TorusStrategy.latest if adopting else None


def strategy_in_scope():
    """The ``TorusStrategy`` whose scope or replica context is open here, or None: for a patch wrapper with no
    model at hand (``metrics.share_weighted``, inside the step that Keras runs under ``model.distribute_strategy``,
    which is this one for a model of no strategy)."""
    import tensorflow as tf

    from torus.integrations.keras.strategy import TorusStrategy

    strategy = tf.distribute.get_strategy()
    return strategy if isinstance(strategy, TorusStrategy) else None


def _self_distributed(model) -> bool:
    """True when the model's optimizer (or one it wraps) all-reduces by itself and the model is of no strategy:
    Horovod's ``DistributedOptimizer`` (``torus.integrations.keras.horovod``), whose users feed per-rank data
    and average metrics with callbacks, as in Horovod. Such a model runs as plain Keras on every rank."""
    from torus.integrations.keras.compat import model_strategy

    if model_strategy(model) is not None:
        return False
    optimizer, seen = getattr(model, "optimizer", None), 0
    while optimizer is not None and seen < 8:
        if getattr(optimizer, "_torus_self_distributed", False):
            return True
        optimizer, seen = getattr(optimizer, "inner_optimizer", None), seen + 1
    return False


def wrap(original: Callable, method: str) -> Callable:
    """``original`` (Keras' ``fit`` / ``evaluate`` / ``predict``) run through ``PIPELINE``."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(model, *args, **kwargs):
        strategy = strategy_of(model, adopting=True)
        if strategy is None or strategy.local_depth or _self_distributed(model):
            return original(model, *args, **kwargs)
        bound = signature.bind(model, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.update(arguments.pop("kwargs", {}) if "kwargs" in signature.parameters else {})
        call = Call(strategy, method, arguments)
        for stage in ("model", "inputs", "callbacks"):
            for fn in stages()[stage]:
                fn(call)
        result = original(**call.arguments)
        for fn in stages()["result"]:
            result = fn(call, result)
        return result

    return wrapper


def install(strategy) -> None:
    """Make ``strategy`` the one a model of no TorusStrategy runs under (``TorusStrategy.latest``) and wrap Keras'
    patch sites (once per process: ``compat.install``)."""
    from torus.integrations.keras import compat
    from torus.integrations.keras.strategy import TorusStrategy

    TorusStrategy.latest = strategy
    compat.install()


def add_callback(call: Call, cls, *args) -> None:
    """For a stage "callbacks": ``call.arguments`` get ``cls(*args)`` appended to the call's callbacks unless one
    of ``cls`` is there already (a ``CallbackList`` that Keras built is extended in place, the callback given
    the model and the list's params; a list or single callback becomes a new list)."""
    import keras

    callbacks = call.arguments.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        if not any(isinstance(c, cls) for c in callbacks.callbacks):
            mine = cls(*args)
            mine.set_model(call.arguments["self"])
            mine.set_params(callbacks.params)
            callbacks.callbacks.append(mine)
        return
    listed = keras.tree.flatten(callbacks) if callbacks else []
    if not any(isinstance(c, cls) for c in listed):
        listed.append(cls(*args))
    call.arguments = {**call.arguments, "callbacks": listed}
