"""torus-train's snapshots (issue 42): where the job has an id (``TORUS_JOB_ID``, set by torus-run), a snapshot
of the model and optimizer every ``--snapshot-every`` steps (else ``TORUS_SNAPSHOT_STEPS`` /
``TORUS_SNAPSHOT_SECONDS``), written in the background by one rank per node; a relaunch resumes from the newest
one at the next global batch, at any rank count that divides the global batch.

The trainer drives them through the strategy's custom-loop calls (``TorusStrategy.resume`` / ``snapshot``), for
``--trainer fit`` and ``loop`` alike, so fit's own snapshots stay off. A snapshot's meta holds the epoch, the
batches done in it, the global batch and the history of the finished epochs; the data position follows from
them, because every global batch of the folder layout is a function of (seed, epoch, batch) alone
(``data.shared_split``). TFRecord shards are read per rank: there a relaunch at another rank count continues
the epoch in another order (a warning says so), and exactly at the same rank count.

A snapshot is due after a step, never after an epoch's last one: the epoch's end (batch-norm averaging, the
validation pass, the checkpoint) comes first, and the snapshot after it starts the next epoch at batch 0.
"""
from __future__ import annotations

import sys

from torus.integrations.keras.fit.snapshots import state_variables


class Position:
    """Where a run starts: ``epoch``, the batches of it already done (``skip``) and the finished epochs'
    history; ``step`` is the global step of the snapshot, or None for a start without one."""

    def __init__(self, epoch: int, skip: int, history: list, step: int | None = None):
        self.epoch, self.skip, self.history, self.step = epoch, skip, history, step


def resume(trainer, start: Position) -> Position:
    """The newest snapshot of this job, if any rank holds one newer than ``start`` (the checkpoint's position);
    else ``start``. Collective. Raises ``ValueError`` when the snapshot's global batch differs from the
    schedule's for its epoch (another recipe)."""
    strategy = trainer.strategy
    if strategy.snapshots is None:
        return start
    meta = strategy.resume(state_variables(trainer.model), model=trainer.model)
    if meta is None or (meta["epoch"], meta["batch"]) < (start.epoch, 0):
        return start
    epoch, expected = meta["epoch"], trainer.schedule.global_batch(min(meta["epoch"], trainer.args.epochs - 1))
    if meta["global_batch"] != expected:
        raise ValueError(f"torus-train on rank {trainer.rank}: the snapshot of step {meta['step']} was taken at "
                         f"global batch {meta['global_batch']} in epoch {epoch + 1}, this --batch-schedule gives "
                         f"{expected}: resume with the recipe the job started with")
    if trainer.rank == 0 and meta["ranks"] != trainer.size and not getattr(trainer.train_data, "shared", True) \
            and meta["batch"]:
        print(f"torus-train: warning: TFRecord shards are read per rank; at {trainer.size} ranks instead of "
              f"{meta['ranks']} the rest of epoch {epoch + 1} reads its images in another order", file=sys.stderr,
              flush=True)
    return Position(epoch, meta["batch"], list(meta["history"]), meta["step"])


class Taker:
    """Offers a snapshot after every step (``after_step``) and at every epoch's end (``after_epoch``); the
    strategy takes one when due. The variable list is built once, after the optimizer."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.variables = state_variables(trainer.model)

    def _offer(self, epoch: int, batch: int, history: list) -> None:
        trainer = self.trainer
        if trainer.strategy.snapshots is None:
            return
        step = int(trainer.model.optimizer.iterations.numpy())
        global_batch = trainer.schedule.global_batch(min(epoch, trainer.args.epochs - 1))
        trainer.strategy.snapshot(self.variables, step, epoch=epoch, batch=batch, global_batch=global_batch,
                                  ranks=trainer.size, history=list(history))

    def after_step(self, epoch: int, done: int, steps: int, history: list) -> None:
        """After batch ``done - 1`` of ``epoch`` (``done`` batches of ``steps`` done)."""
        if done < steps:
            self._offer(epoch, done, history)

    def after_epoch(self, epoch: int, history: list) -> None:
        """After ``epoch``'s end: the next epoch at batch 0."""
        self._offer(epoch + 1, 0, history)


def fit_callback(trainer):
    """The Keras callback offering a snapshot after each of fit's batches."""
    import keras

    class OfferSnapshots(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            t = trainer
            t.snapshot_taker.after_step(t.epoch, t.skip + batch + 1, t.epoch_steps, t.history)
    return OfferSnapshots()
