"""Keras callbacks for data-parallel fit: batch-size and learning-rate control. (The initial-state broadcast and
global metrics need no callback under ``TorusStrategy``: see ``initial_state.py`` and ``metrics.py``.)"""
from __future__ import annotations

import keras
import numpy as np


class BatchControl(keras.callbacks.Callback):
    """Sets the optimizer's learning rate before every batch from ``lr_rule.lr(epoch + batch / steps,
    batch_schedule.global_batch(epoch))`` and adds ``global_batch`` and ``learning_rate`` to the epoch logs.

    ``steps_per_epoch_fn(epoch)`` gives the steps in ``epoch`` (e.g. ``lambda e: schedule.steps_per_epoch(e,
    num_examples)``); ``None`` uses fit's ``steps``. Everything is a function of the epoch number, so a run
    resumed with ``fit(initial_epoch=e)`` continues with the same batch size and learning rate. The data
    pipeline must batch with ``batch_schedule.per_rank_batch(epoch, size)`` (e.g. one ``fit`` per
    ``batch_schedule.segments(...)`` entry). The optimizer's learning rate must be a float (a variable), not a
    schedule: ``TypeError`` otherwise. ``skip``: batches of the current epoch done before this ``fit`` (a run
    resumed within an epoch fits the rest of it), counted into the position.
    """

    def __init__(self, batch_schedule, lr_rule, steps_per_epoch_fn=None):
        super().__init__()
        self.batch_schedule, self.lr_rule, self.steps_per_epoch_fn = batch_schedule, lr_rule, steps_per_epoch_fn
        self._epoch, self._steps = 0, 1
        self.skip = 0

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
        self.model.optimizer.learning_rate = self.lr(self._epoch, self.skip + batch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["global_batch"] = self.batch_schedule.global_batch(epoch)
            logs["learning_rate"] = float(np.asarray(self.model.optimizer.learning_rate))
