"""Horovod's Keras callbacks (``hvd.callbacks.*``) on Keras 3, with two deliberate differences:

- ``BroadcastGlobalVariablesCallback`` broadcasts at the start of ``fit`` (after Keras has built the optimizer
  slots, before the first update) instead of after the first batch: Horovod's order applies step 1 to weights
  that still differ between ranks, so ranks start out of step (see /work/shared/FACTS.md, "Traps seen").
- ``MetricAverageCallback`` weights every rank by the number of samples behind its logs (the loss tracker's
  count), so uneven shards average like one process; Horovod takes the plain mean over ranks.
"""
from __future__ import annotations

import warnings

import keras
import numpy as np

from torus.integrations.keras.horovod.basics import rank, size, torus_comm
from torus.integrations.keras.horovod.collectives import broadcast_variables
from torus.integrations.keras.horovod.optimizer import is_distributed


def loss_samples(model) -> float:
    """Samples behind the model's current loss value (its loss tracker's count); 1.0 without a tracker."""
    for metric in model.metrics:
        if metric.name == "loss" and hasattr(metric, "count"):
            return float(np.asarray(metric.count))
    return 1.0


def average_logs(torus_comm, logs: dict, samples: float, keys) -> dict:
    """Replace ``logs[k]`` (numeric scalars among ``keys``) by ``sum_r n_r * v_r / sum_r n_r`` over ranks, with
    ``n_r = samples`` on rank r. Collective (one small all-reduce); returns ``logs``."""
    keys = sorted(k for k in keys
                  if isinstance(logs[k], (int, float, np.integer, np.floating)) and not isinstance(logs[k], bool))
    local = np.array([samples] + [samples * float(logs[k]) for k in keys], np.float64)
    total = torus_comm.allreduce(local, op="sum", algorithm="native")
    for k, v in zip(keys, total[1:]):
        logs[k] = float(v / total[0])
    return logs


def check_trainable(model, what: str) -> None:
    """Refuse set-ups that cannot work: XLA, and a loss-scale optimizer outside the distributed one."""
    if model.jit_compile:
        raise ValueError(f"{what} on rank {rank()}: compile the model with jit_compile=False (Keras' default "
                         "'auto' turns XLA on when a GPU is visible); XLA cannot compile the tf.numpy_function "
                         "that calls MPI")
    optimizer = model.optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and is_distributed(optimizer.inner_optimizer):
        # Its finiteness check would run on each rank's local gradients, so ranks could take different
        # branches around the all-reduce and deadlock.
        raise ValueError(f"{what} on rank {rank()}: LossScaleOptimizer wraps the DistributedOptimizer; wrap the "
                         "loss-scale optimizer instead: hvd.DistributedOptimizer(keras.optimizers."
                         "LossScaleOptimizer(opt))")


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of every ``fit``: refuse ``jit_compile=True`` and a ``LossScaleOptimizer`` outside the
    ``DistributedOptimizer`` (``ValueError``), build the optimizer if needed, then give every rank rank
    ``root_rank``'s model variables (except ``local_variables`` and Keras' random-seed states, so dropout
    stays independent per rank as in Horovod) and all optimizer variables (slots, iterations, learning rate),
    before the first update. Collective; ``device`` is accepted and ignored.

    A model whose variables do not exist yet when ``fit`` starts (a ``Sequential`` without ``keras.Input``:
    without a distribution strategy Keras builds it while tracing the first step) is broadcast after the first
    batch instead, as Horovod does: that first update averages gradients taken at different weights, and
    rank 0 warns. Build the model first (``keras.Input`` or ``model.build``) to avoid it."""

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank = int(root_rank)
        self._local = {id(v) for v in (local_variables or [])}
        self._pending = False

    def _broadcast(self):
        model = self.model
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        shared = [v for v in model.variables
                  if id(v) not in self._local and not v.path.endswith("seed_generator_state")]
        broadcast_variables(shared + list(model.optimizer.variables), self.root_rank)
        self._pending = False

    def on_train_begin(self, logs=None):
        check_trainable(self.model, "hvd.callbacks.BroadcastGlobalVariablesCallback")
        if self.model.built:
            self._broadcast()
            return
        self._pending = True
        if rank() == 0:
            warnings.warn("hvd.callbacks.BroadcastGlobalVariablesCallback: the model is not built when fit "
                          "starts, so its weights are broadcast after the first batch (as in Horovod) and the "
                          "first update mixes gradients taken at different weights; build the model before fit "
                          "(keras.Input or model.build) to broadcast before it", stacklevel=2)

    def on_train_batch_end(self, batch, logs=None):
        if self._pending:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """At every epoch's end, replace each numeric log value by its mean over ranks weighted by the samples
    each rank saw (``sum_r n_r v_r / sum_r n_r``; training and ``val_`` values weighted by their own counts),
    exact for Keras' sample-weighted means such as loss and accuracy. Put it before callbacks that read the
    logs (``ReduceLROnPlateau``, ``TensorBoard``, ``ModelCheckpoint(save_best_only=True)``). One small
    all-reduce per epoch per group, on every rank. ``device`` is accepted and ignored."""

    def __init__(self, device=""):
        super().__init__()
        self._train_samples = self._test_samples = 1.0

    def on_train_batch_end(self, batch, logs=None):
        self._train_samples = loss_samples(self.model)

    def on_test_batch_end(self, batch, logs=None):
        self._test_samples = loss_samples(self.model)

    def on_epoch_end(self, epoch, logs=None):
        if logs:
            tc = torus_comm()
            average_logs(tc, logs, self._train_samples, [k for k in logs if not k.startswith("val_")])
            average_logs(tc, logs, self._test_samples, [k for k in logs if k.startswith("val_")])


def _scale_momentum(optimizer, factor: float) -> None:
    """Momentum correction (Goyal et al. 2017, arXiv:1706.02677, section 2.1) for the step about to run.

    Horovod multiplies the momentum coefficient by ``new_lr / old_lr`` for one step. Keras 3 bakes the
    coefficient into the compiled step as a constant, so the velocity buffers are scaled instead:
    ``mu * (c * v) == (c * mu) * v``, the same update for SGD without Nesterov and for RMSprop. With
    ``nesterov=True`` the look-ahead term keeps the uncorrected coefficient."""
    velocities = getattr(optimizer, "momentums", None) or getattr(optimizer, "_momentums", None) or []
    for v in velocities:
        v.assign(v * factor)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Between epochs ``start_epoch`` (inclusive) and ``end_epoch`` (exclusive; None: no end), set the learning
    rate to ``initial_lr * multiplier(epoch)``, where ``multiplier`` is a function of the epoch or a constant
    ``m`` (meaning ``m ** (epoch - start_epoch)``). ``staircase=True``: once per epoch, at its first batch, with
    an integer epoch. ``staircase=False``: before every batch with ``epoch + batch / steps_per_epoch``
    (``steps_per_epoch`` defaults to fit's ``steps``; ``ValueError`` if neither is known).
    ``momentum_correction``: see ``_scale_momentum``; applied when the optimizer has a nonzero ``momentum``.
    Adds ``lr`` to the epoch logs. The optimizer's learning rate must be a float, not a schedule."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("hvd.callbacks.LearningRateScheduleCallback: initial_lr is required")
        self.initial_lr, self.start_epoch, self.end_epoch = float(initial_lr), start_epoch, end_epoch
        self.staircase, self.momentum_correction, self.steps_per_epoch = staircase, momentum_correction, \
            steps_per_epoch
        self.multiplier = multiplier if callable(multiplier) else (lambda e: multiplier ** (e - start_epoch))
        self._epoch = 0

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__} on rank {rank()}: steps per epoch unknown; pass "
                                 "steps_per_epoch= here or fit(steps_per_epoch=...)")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def lr(self, epoch: float) -> float:
        """The learning rate this callback sets at (fractional) ``epoch``."""
        return self.initial_lr * self.multiplier(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch < self.start_epoch or (self.end_epoch is not None and self._epoch >= self.end_epoch):
            return
        if self.staircase and batch != 0:
            return
        epoch = self._epoch if self.staircase else self._epoch + batch / self.steps_per_epoch
        optimizer = self.model.optimizer
        old, new = float(np.asarray(optimizer.learning_rate)), self.lr(epoch)
        optimizer.learning_rate = new
        if self.momentum_correction and getattr(optimizer, "momentum", 0) and old != 0:
            _scale_momentum(optimizer, new / old)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warm-up (Goyal et al. 2017) from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs``, adjusted before every batch:
    ``lr(e) = initial_lr / size * (e' * (size - 1) / warmup_epochs + 1)`` with
    ``e' = epoch + (batch + 1) / steps_per_epoch``, so the last batch of the warm-up runs at ``initial_lr``.
    After the warm-up the learning rate is left alone. ``verbose=1``: rank 0 prints when the warm-up ends."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        self.warmup_epochs, self.verbose = warmup_epochs, verbose

        def multiplier(epoch):
            n = size()
            return (1.0 / n) * ((epoch + 1.0 / self.steps_per_epoch) * (n - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(np.asarray(self.model.optimizer.learning_rate)):g}.")


def __getattr__(name: str):
    """``AttributeError``: Horovod's ``callbacks.BestModelCheckpoint`` is not provided (say so); any other name
    gets Python's usual message; both point to HOROVOD.md."""
    guide = "integrations/keras/HOROVOD.md"
    if name == "BestModelCheckpoint":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: Horovod's "
                             "hvd.callbacks.BestModelCheckpoint is not provided by torus; use "
                             "keras.callbacks.ModelCheckpoint(save_best_only=True) on rank 0 after "
                             f"MetricAverageCallback (see {guide})")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (see {guide})")
