"""Global metric results: every metric's state variables are combined over ranks before ``result()``.

Keras builds both a step's logs (``compute_metrics``, in the step function) and the epoch's logs and
``evaluate``'s return value (``_get_metrics_result_or_logs``, eager) from ``Trainer.get_metrics_result()``.
``install()`` wraps that method once per process: for a model under a ``TorusStrategy`` it all-reduces the
state variables of all the model's metrics (one fused ``tf.numpy_function``, uncompressed), assigns the global
values, calls the original ``get_metrics_result()``, and assigns the local values back (the next step keeps
accumulating its own). Each variable is combined by its Keras ``aggregation``, as ``tf.distribute``'s on-read
variables are: "sum" (every built-in metric: totals, counts, confusion matrices) summed, "mean" averaged,
"only_first_replica" rank 0's, "none" left local. So every metric is exact, not only means: AUC, precision,
recall, IoU, R2 come out as one process on the global data would compute them (up to float summation order),
and bitwise equal on every rank, so callbacks decide alike.

Collective: under a ``TorusStrategy`` every call of ``model.get_metrics_result()`` (in a step or eagerly) is
one all-reduce that every rank must make; ranks must therefore run the same number of steps.
"""
from __future__ import annotations

import functools

import tensorflow as tf

from torus.integrations.keras.loop import allreduce_tensors


def _state_variables(model) -> list:
    seen, out = set(), []
    for metric in model.metrics:
        for v in metric.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def _contribution(value, aggregation: str, rank: int, size: int):
    if aggregation == "mean":
        return value / tf.cast(size, value.dtype)
    if aggregation == "only_first_replica":
        return value * tf.cast(rank == 0, value.dtype)
    return value


def global_results(original, model, strategy) -> dict:
    """``original(model)`` (``get_metrics_result``) computed from the metric states summed over ranks."""
    variables = [v for v in _state_variables(model) if getattr(v, "aggregation", "sum") != "none"]
    if not variables:
        return original(model)
    local = [tf.identity(v.value) for v in variables]
    rank, size = strategy.rank, strategy.size
    shares = [_contribution(x, v.aggregation, rank, size) for x, v in zip(local, variables)]
    for v, total in zip(variables, allreduce_tensors(strategy.metrics_host, shares, "sum")):
        v.assign(total)
    # Variable reads and writes keep program order (eagerly, and by tf.function's automatic control
    # dependencies), so the results read the global values and the restore comes after them.
    results = tf.nest.map_structure(tf.identity, original(model))
    for v, x in zip(variables, local):
        v.assign(x)
    return results


def install() -> None:
    """Wrap ``keras.src.trainers.trainer.Trainer.get_metrics_result`` once per process."""
    from keras.src.trainers.trainer import Trainer

    from torus.integrations.keras.strategy import TorusStrategy

    current = Trainer.get_metrics_result
    if hasattr(current, "_torus_original"):
        return

    @functools.wraps(current)
    def get_metrics_result(self):
        strategy = getattr(self, "_distribute_strategy", None)
        if not isinstance(strategy, TorusStrategy):
            return current(self)
        return global_results(current, self, strategy)

    get_metrics_result._torus_original = current  # type: ignore[attr-defined]
    Trainer.get_metrics_result = get_metrics_result
