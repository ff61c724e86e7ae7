"""Global metric results: every metric's state variables are combined over ranks before ``result()``.

Keras builds both a step's logs (``compute_metrics``, in the step function) and the epoch's logs and
``evaluate``'s return value (``_get_metrics_result_or_logs``, eager) from ``Trainer.get_metrics_result()``.
``global_metrics_result`` wraps that method (``compat.install``, once per process): for a model under a
``TorusStrategy`` it all-reduces the state variables of all the model's metrics (one fused ``tf.numpy_function``,
uncompressed), assigns the global values, calls the original ``get_metrics_result()``, and assigns the local values
back (the next step keeps accumulating its own). Each variable is combined by its Keras ``aggregation``, as
``tf.distribute``'s on-read variables are: "sum" (every built-in metric: totals, counts, confusion matrices) summed,
"mean" averaged, "only_first_replica" rank 0's, "none" left local. So every metric is exact, not only means: AUC,
precision, recall, IoU, R2 come out as one process on the global data would compute them (up to float summation order),
and bitwise equal on every rank, so callbacks decide alike.

A model that overrides ``train_step`` or ``test_step`` (the keras.io guide's ``return {m.name: m.result() for m
in self.metrics}``) gets the same: ``global_step_maker`` wraps ``make_train_function`` / ``make_test_function``, which
give such a model a per-instance step that calls the user's and then makes its logs global (``global_logs``):
an entry named after one of ``model.metrics`` is replaced by that metric's result from the global states (exact,
as above); any other floating entry is averaged over ranks (what Keras' ``reduce_per_replica(..., "auto")``
does under ``MirroredStrategy``); other entries are left as they are. A loss the step computed with
``compute_loss`` and tracked itself is, as under every ``tf.distribute`` strategy, the rank's loss scaled by
``1 / num_replicas_in_sync`` (Keras' built-in step unscales it before tracking); its global value is then the
global loss over the number of ranks.

Several outputs' losses over unevenly split rows (``share_weighted``): docs/design.md ("Metrics of
several outputs").

Collective: under a ``TorusStrategy`` every call of ``model.get_metrics_result()`` (in a step or eagerly) and
every custom step is one all-reduce that every rank must make; ranks must therefore run the same number of
steps.
"""
from __future__ import annotations

import functools

import tensorflow as tf

from torus.integrations.keras import compat
from torus.integrations.keras.collectives.reducer import allreduce_tensors
from torus.integrations.keras.fit import fit_hook


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
    # dependencies), so the results read the global values and the restore comes after them. Python numbers (Keras
    # pythonifies eager results) stay numbers, as one process returns them.
    results = tf.nest.map_structure(lambda r: tf.identity(r) if tf.is_tensor(r) else r, original(model))
    for v, x in zip(variables, local):
        v.assign(x)
    return results


def global_logs(model, strategy, logs):
    """A custom step's ``logs`` made global (module docstring); the same structure."""
    if not isinstance(logs, dict):
        return logs
    names = {m.name for m in model.metrics}
    logs = dict(logs)
    if names & set(logs):
        results = global_results(lambda m: {x.name: x.result() for x in m.metrics}, model, strategy)
        logs.update({k: results[k] for k in logs if k in names})
    others = [k for k, v in logs.items() if k not in names and tf.is_tensor(v) and v.dtype.is_floating]
    if others:
        averaged = allreduce_tensors(strategy.metrics_host, [logs[k] for k in others], "avg")
        logs.update(zip(others, averaged))
    return logs


def _global_step(model, strategy, name: str) -> None:
    """Give ``model`` a per-instance ``name`` (``train_step`` / ``test_step``) whose logs are global, where its
    class overrides Keras' own; once per model."""
    if getattr(type(model), name) is getattr(compat.TensorFlowTrainer, name) or name in vars(model):
        return
    user_step = getattr(model, name)

    @functools.wraps(user_step)
    def step(data):
        return global_logs(model, strategy, user_step(data))

    compat.set_on_instance(model, name, step)  # past Keras' attribute tracking: a method, not state


def share_weighted(call):
    """``CompileLoss.call`` with its per-output loss trackers weighted by this rank's share of the batch."""

    @functools.wraps(call)
    def wrapped(self, y_true, y_pred, sample_weight=None):
        strategy = fit_hook.strategy_in_scope()  # a CompileLoss knows no model
        trackers = [t for t in self.metrics if t is not None]
        if strategy is None or not trackers or tf.distribute.in_cross_replica_context():
            return call(self, y_true, y_pred, sample_weight)
        rows = tf.cast(tf.shape(tf.nest.flatten(y_pred)[0])[0], tf.float32)
        share = rows / allreduce_tensors(strategy.metrics_host, [rows], "sum")[0]

        def weighted(update):
            def update_state(values, sample_weight=None):
                values = tf.where(share > 0, values, tf.zeros_like(values))  # a rank without rows adds 0, not nan
                return update(values, sample_weight=tf.cast(share, values.dtype))
            return update_state

        for t in trackers:
            compat.set_on_instance(t, "update_state", weighted(t.update_state))
        try:
            return call(self, y_true, y_pred, sample_weight)
        finally:
            for t in trackers:
                compat.del_on_instance(t, "update_state")

    return wrapped


def global_step_maker(make, step_name: str):
    """``TensorFlowTrainer.make_train_function`` / ``make_test_function`` (``make``) that first gives a model
    of a TorusStrategy whose class overrides ``step_name`` a step with global logs (``_global_step``)."""

    @functools.wraps(make)
    def wrapped(self, *args, **kwargs):
        strategy = fit_hook.strategy_of(self)
        if strategy is not None:
            _global_step(self, strategy, step_name)
        return make(self, *args, **kwargs)

    return wrapped


def global_metrics_result(current):
    """``Trainer.get_metrics_result`` (``current``) from the metric states summed over ranks (``global_results``)
    for a model of a TorusStrategy."""

    @functools.wraps(current)
    def get_metrics_result(self):
        strategy = fit_hook.strategy_of(self)
        if strategy is None:
            return current(self)
        return global_results(current, self, strategy)

    return get_metrics_result
