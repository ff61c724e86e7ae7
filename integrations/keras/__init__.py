"""torus.integrations.keras: data-parallel Keras 3 training (TensorFlow backend) over torus collectives.

``LARS`` (optimizer), ``BatchSizeSchedule`` and ``LearningRateRule`` (batch-size control and the learning-rate
rule that follows it), ``BatchControl`` (the callback that applies both), ``TorusStrategy`` (a
``tf.distribute.Strategy``: ``with strategy.scope(): ...; model.fit(...)`` under ``mpiexec``; the initial
broadcast and global metrics happen inside ``fit`` / ``evaluate`` / ``predict``), and for custom training loops
``allreduce_tensors`` / ``broadcast_variables`` (also ``strategy.allreduce_gradients`` /
``strategy.broadcast_variables``).

Names are imported on first use, so the schedules work without importing TensorFlow.

Laid out by role: ``strategy`` (the strategy), ``creation`` (its variable creator) and ``compat`` (every Keras /
TensorFlow internal used and every patch site) at the top; ``fit/`` the stages that make ``fit`` / ``evaluate``
/ ``predict`` data-parallel (the step timeline among them); ``collectives/`` all-reduce, broadcast and
all-gather of TensorFlow tensors (custom loops, gradient buckets, sparse gradients, the timeline's lanes);
``training/`` LARS and batch-size control; ``app/`` the ``torus-train`` application (CLI, trainer, input
pipelines, checkpoints, trace breakdown); ``horovod/`` the Horovod-compatible module.
"""
import importlib

_MODULE = {
    "LARS": "training.lars",
    "BatchSizeSchedule": "training.schedule", "LearningRateRule": "training.schedule",
    "BatchControl": "training.callbacks",
    "HostAllreduce": "collectives.host", "allreduce_tensors": "collectives.reducer",
    "broadcast_variables": "collectives.loop",
    "TorusStrategy": "strategy",
}
__all__ = list(_MODULE)


def __getattr__(name):
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE[name]}"), name)


def __dir__():
    return sorted(list(globals()) + __all__)
