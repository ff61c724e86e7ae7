"""Keras callbacks for data-parallel fit: initial-state broadcast, metric averaging, batch-size/LR control."""
from __future__ import annotations

import keras
import numpy as np


class BroadcastInitialState(keras.callbacks.Callback):
    """At the start of every ``fit``: refuse ``jit_compile=True``, then copy rank 0's model variables and
    optimizer state (slots and iteration count, all of which exist by then) to every rank, before the first
    update. Broadcasting after the first batch, as Horovod's callback does, would apply step 1 to weights
    that differ between ranks. Raises ``ValueError`` when the model was compiled with ``jit_compile=True``."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy

    def on_train_begin(self, logs=None):
        model = self.model
        if model.jit_compile:
            raise ValueError(f"TorusStrategy on rank {self.strategy.rank}: compile the model with "
                             "jit_compile=False; XLA cannot compile the tf.numpy_function that calls MPI")
        optimizer = model.optimizer
        if not optimizer.built:
            with self.strategy.scope():
                optimizer.build(model.trainable_variables)
        self.strategy.broadcast_variables(list(model.variables) + list(optimizer.variables))


def loss_samples(model) -> float:
    """Samples behind the model's current loss value (its loss tracker's count); 1.0 without a tracker."""
    for metric in model.metrics:
        if metric.name == "loss" and hasattr(metric, "count"):
            return float(np.asarray(metric.count))
    return 1.0


def average_logs(torus_comm, logs: dict, samples: float, keys=None) -> dict:
    """Replace ``logs[k]`` (numeric scalars; all keys or ``keys``) by ``sum_r n_r * v_r / sum_r n_r`` over ranks,
    with ``n_r = samples`` on rank r. Collective (one small all-reduce); returns ``logs``."""
    keys = sorted(k for k in (logs if keys is None else keys)
                  if isinstance(logs[k], (int, float, np.integer, np.floating)) and not isinstance(logs[k], bool))
    local = np.array([samples] + [samples * float(logs[k]) for k in keys], np.float64)
    total = torus_comm.allreduce(local, op="sum", algorithm="native")
    for k, v in zip(keys, total[1:]):
        logs[k] = float(v / total[0])
    return logs


class MetricAverage(keras.callbacks.Callback):
    """Makes fit's epoch logs global: every numeric value becomes the mean over ranks weighted by the number
    of samples each rank saw (``sum_r n_r * v_r / sum_r n_r``), exact for sample-weighted means such as the
    loss and accuracy. ``n_r`` is the loss tracker's sample count (training and validation counted apart);
    without a loss tracker ranks weigh equally. One small all-reduce per epoch, on every rank.

    Keras hands ``on_test_end`` a copy of evaluate's logs, so a callback cannot change what ``evaluate``
    returns: use ``strategy.average_logs(model, model.evaluate(..., return_dict=True))`` for that.
    """

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self._train_samples = self._test_samples = 1.0

    def on_train_batch_end(self, batch, logs=None):
        self._train_samples = loss_samples(self.model)

    def on_test_batch_end(self, batch, logs=None):
        self._test_samples = loss_samples(self.model)

    def on_epoch_end(self, epoch, logs=None):
        if logs:
            comm = self.strategy.torus_comm
            average_logs(comm, logs, self._train_samples, [k for k in logs if not k.startswith("val_")])
            average_logs(comm, logs, self._test_samples, [k for k in logs if k.startswith("val_")])


class BatchControl(keras.callbacks.Callback):
    """Sets the optimizer's learning rate before every batch from ``lr_rule.lr(epoch + batch / steps,
    batch_schedule.global_batch(epoch))`` and adds ``global_batch`` and ``learning_rate`` to the epoch logs.

    ``steps_per_epoch_fn(epoch)`` gives the steps in ``epoch`` (e.g. ``lambda e: schedule.steps_per_epoch(e,
    num_examples)``); ``None`` uses fit's ``steps``. Everything is a function of the epoch number, so a run
    resumed with ``fit(initial_epoch=e)`` continues with the same batch size and learning rate. The data
    pipeline must batch with ``batch_schedule.per_rank_batch(epoch, size)`` (e.g. one ``fit`` per
    ``batch_schedule.segments(...)`` entry). The optimizer's learning rate must be a float (a variable), not a
    schedule: ``TypeError`` otherwise.
    """

    def __init__(self, batch_schedule, lr_rule, steps_per_epoch_fn=None):
        super().__init__()
        self.batch_schedule, self.lr_rule, self.steps_per_epoch_fn = batch_schedule, lr_rule, steps_per_epoch_fn
        self._epoch, self._steps = 0, 1

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        steps = self.steps_per_epoch_fn(epoch) if self.steps_per_epoch_fn else self.params.get("steps")
        if not steps:
            raise ValueError(f"BatchControl: steps per epoch unknown at epoch {epoch}; pass "
                             "steps_per_epoch_fn or fit(steps_per_epoch=...)")
        self._steps = int(steps)

    def lr(self, epoch: int, batch: int) -> float:
        return self.lr_rule.lr(epoch + batch / self._steps, self.batch_schedule.global_batch(epoch))

    def on_train_batch_begin(self, batch, logs=None):
        self.model.optimizer.learning_rate = self.lr(self._epoch, batch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["global_batch"] = self.batch_schedule.global_batch(epoch)
            logs["learning_rate"] = float(np.asarray(self.model.optimizer.learning_rate))
