"""Rank-aware file callbacks, as Keras 2's multi-worker ones were: the user passes the same callback list on
every rank and ``fit`` rewrites it (the instances keep their identity; their class is swapped for a subclass).

- ``ModelCheckpoint``: the chief (rank 0) writes; other ranks run the same bookkeeping (``best``, ...) and
  write nothing. Each file is written to a hidden temporary file beside it and published with ``os.replace``,
  so a reader never sees a half-written ``.keras`` / ``.weights.h5`` file.
- ``BackupAndRestore``: the chief backs up (atomically, as above) and on ``fit``'s start reads the backup; the
  restored weights, optimizer state and epoch are broadcast to every rank, so the folder need only exist on
  the chief and a job killed and rerun with the same command continues on all ranks. The chief alone deletes
  the backup when training ends.
- ``TensorBoard``, ``CSVLogger``: the chief logs; other ranks do nothing. A TensorBoard whose ``log_dir``
  contains ``{rank}`` logs on every rank, into ``log_dir.format(rank=rank)``.

Other callbacks are left alone. What is not handled: a user subclass that writes files in its own methods
(it runs on every rank).
"""
from __future__ import annotations

import json

import keras

from torus.integrations.keras import compat
from torus.integrations.keras.collectives.loop import wait_for_every_rank
from torus.integrations.keras.compat import file_utils
from torus.integrations.keras.fit import saving

_MARK = "_torus_rank_aware"


def _skip(*args, **kwargs):
    return None


class _ChiefCheckpoint:
    def _save_model(self, epoch, batch, logs):
        model = self.model
        chief = self._torus_strategy.is_chief
        model.save = saving.atomic(type(model).save.__get__(model)) if chief else _skip
        model.save_weights = saving.atomic(type(model).save_weights.__get__(model)) if chief else _skip
        try:
            # on rank 0 alone: no notice to the others (they write nothing, wait for nothing)
            with saving.local(self._torus_strategy):
                super()._save_model(epoch, batch, logs)
        finally:
            del model.save, model.save_weights


class _SharedBackup:
    def on_train_begin(self, logs=None):
        strategy, model = self._torus_strategy, self.model
        state = None
        if strategy.is_chief:
            try:
                super().on_train_begin(logs)
                state = (file_utils.exists(compat.backup_files(self)[0]), compat.initial_epoch(model), None)
            except Exception as exc:  # the other ranks must not wait for a broadcast that never comes
                state = (False, None, f"{type(exc).__name__}: {exc}")
        found, epoch, error = strategy.torus_comm.comm.bcast(state, root=0)
        if error:
            raise RuntimeError(f"BackupAndRestore on rank {strategy.rank}: rank 0 could not restore the backup "
                               f"in {self.backup_dir}: {error}")
        if not found:
            return
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            with strategy.scope():
                optimizer.build(model.trainable_variables)
        strategy.broadcast_variables(list(model.variables) + list(optimizer.variables if optimizer else []))
        compat.set_initial_epoch(model, epoch)

    def _save_model(self):
        if not self._torus_strategy.is_chief:
            return
        if not file_utils.exists(self.backup_dir):
            file_utils.makedirs(self.backup_dir)
        weights, prev_weights, metadata_path, prev_metadata = compat.backup_files(self)
        if self.double_checkpoint:
            for src, dst in ((weights, prev_weights), (metadata_path, prev_metadata)):
                if file_utils.exists(src):
                    saving.atomic(lambda tmp, src=src: file_utils.copy(src, tmp))(dst)
        with saving.local(self._torus_strategy):
            saving.atomic(lambda tmp: self.model.save_weights(tmp, overwrite=True))(weights)

        def metadata(tmp):
            with open(tmp, "w") as f:
                f.write(json.dumps(compat.backup_position(self)))
        saving.atomic(metadata)(metadata_path)

    def on_train_end(self, logs=None):
        if self._torus_strategy.is_chief:
            super().on_train_end(logs)


class _Silent:
    """Every hook does nothing (a non-chief rank's logger)."""

    set_model = keras.callbacks.Callback.set_model


for _name in dir(keras.callbacks.Callback):
    if _name.startswith("on_"):
        setattr(_Silent, _name, getattr(keras.callbacks.Callback, _name))

_subclasses: dict = {}


def _swap(callback, mixin, strategy) -> None:
    cls = type(callback)
    key = (mixin, cls)
    if key not in _subclasses:
        _subclasses[key] = type(f"RankAware{cls.__name__}", (mixin, cls), {})
    compat.swap_class(callback, _subclasses[key])
    callback._torus_strategy = strategy
    setattr(callback, _MARK, True)


def make_rank_aware(callback, strategy) -> None:
    """Rewrite one callback in place for ``strategy`` (see the module docstring); others are left alone."""
    if getattr(callback, _MARK, False):
        return
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        _swap(callback, _ChiefCheckpoint, strategy)
    elif isinstance(callback, keras.callbacks.BackupAndRestore):
        _swap(callback, _SharedBackup, strategy)
    elif isinstance(callback, keras.callbacks.TensorBoard) and "{rank}" in str(callback.log_dir):
        callback.log_dir = str(callback.log_dir).format(rank=strategy.rank)
        setattr(callback, _MARK, True)
    elif isinstance(callback, (keras.callbacks.TensorBoard, keras.callbacks.CSVLogger)):
        if strategy.is_chief:
            setattr(callback, _MARK, True)
        else:
            _swap(callback, _Silent, strategy)


def rank_aware_callbacks(call) -> None:
    """fit_hook stage "callbacks": the file callbacks in the user's list become rank-aware."""
    callbacks = call.arguments["callbacks"]
    members = callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else callbacks or []
    for callback in members:
        make_rank_aware(callback, call.strategy)


def files_in_place(call, result):
    """fit_hook stage "result" of ``fit``: every rank returns only once rank 0 has written what its file
    callbacks write at the end of training (the last ``ModelCheckpoint``, ``BackupAndRestore``'s removal), so
    a ``keras.models.load_model`` of a checkpoint right after ``fit`` finds it on every rank. Unconditional
    (one barrier per ``fit``, nothing at one rank), since ranks may pass their file callbacks differently
    (Horovod's ``if rank == 0: callbacks.append(ModelCheckpoint(...))``)."""
    if call.method == "fit":
        wait_for_every_rank(call.strategy.torus_comm, "TorusStrategy fit (its end, waiting for rank 0's files)")
    return result
