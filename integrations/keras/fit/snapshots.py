"""Snapshots of the training state inside ``fit``, and resume from the newest one at the next global batch
(issue 42; the files, the store and the agreement are ``torus.snapshot``'s).

On when the job has an id: ``TORUS_JOB_ID`` (``torus-run`` sets it, one per run of the supervisor; set it by
hand under a plain ``mpiexec`` to resume a job of that id). Off otherwise: a plain run starts fresh.

- **Taking.** After a training step, when ``Cadence`` says one is due (``TORUS_SNAPSHOT_STEPS`` /
  ``TORUS_SNAPSHOT_SECONDS``, or ``TorusStrategy(snapshot_steps=, snapshot_seconds=)``), one rank per node
  copies the model's and the optimizer's variables to host memory and hands them to its ``SnapshotStore``,
  whose thread writes them (node-local storage: every surviving host holds a recent copy). With them: which
  ``fit`` of the process (its index), the epoch, the batches done in it, the global batch and the agreed
  shuffle seed, and every fit's History so far. No collective: the step does not wait. A snapshot due at an
  epoch's last step is taken after the epoch's end (its validation and History in).
- **Resuming.** At the first ``fit`` of the process, after the initial broadcast (``on_train_begin``), the
  ranks agree on the newest complete snapshot any of them holds for this job and model (``agree_newest``,
  one collective). Earlier ``fit`` calls of the script run no epoch; the snapshot's own ``fit`` assigns the
  variables, starts at its epoch, and passes over the batches already done in it (read from the data, not
  trained on), so training continues at the next global batch, in the same order: the shuffle seed comes
  from the snapshot, and the rank count may differ (the global batch may not). Each fit returns its whole
  History: the epochs before the restart (as logged then) in front of its own.

What is not in a snapshot, and so not exact after a resume: the metric states of the resumed epoch (its
logged training metrics cover the batches after the restart), a ``tf.data`` dataset whose order depends on how
many times this process iterated it (``shuffle(reshuffle_each_iteration=True)``), per-rank random layers,
BatchNormalization's per-rank statistics (rank 0's are restored) and the own state of callbacks other than
EarlyStopping, ReduceLROnPlateau and ModelCheckpoint (those are held: fit/callback_state.py). Custom loops call
``strategy.resume`` and ``strategy.snapshot`` themselves (``Session.resume`` / ``Session.take``); a process that
called ``resume`` owns its snapshots, and its ``fit`` calls then take none (torus-train fits epoch by epoch so).
"""
from __future__ import annotations

import copy
import json
import re
import time
import zlib

import keras
import numpy as np

from torus import knobs, snapshot
from torus.integrations.keras import compat
from torus.integrations.keras.collectives.loop import stall_timeout
from torus.integrations.keras.fit import callback_state, inputs
from torus.supervise import report

PROGRESS_EVERY_S = 0.2  # torus-run's steps redone trail the failure by at most this


def model_key(variables, architecture: str = "") -> str:
    """The model key of a snapshot: a digest of the variables' count, shapes and dtypes, in order, and of the
    model's ``architecture`` (:func:`architecture`; empty for custom loops, which hand variables alone)."""
    layout = (repr([(tuple(v.shape), str(v.dtype)) for v in variables]) + architecture).encode()
    return f"{len(variables)}-{zlib.crc32(layout):08x}"


def architecture(model) -> str:
    """The model's layers, each its class and configuration without names (Keras numbers those per process),
    so that a model changed without changing its variables (another activation) keys other snapshots; a layer
    whose configuration cannot be had counts by its class alone."""
    def unnamed(value):
        if isinstance(value, dict):  # a layer's name only ("trainable" beside it), not a dtype policy's
            return {k: unnamed(v) for k, v in value.items() if k != "name" or "trainable" not in value}
        if isinstance(value, (list, tuple)):
            return [unnamed(v) for v in value]
        return value

    parts = []
    for layer in getattr(model, "layers", []):
        try:
            config = unnamed(layer.get_config())
        except (NotImplementedError, TypeError, ValueError):
            config = None
        parts.append([type(layer).__name__, config])
    # an object without a config shows as its repr: its address differs from process to process
    return re.sub(r" at 0x[0-9a-fA-F]+", "", json.dumps(parts, sort_keys=True, default=str))


def state_variables(model) -> list:
    """What a snapshot holds: the model's variables (weights, non-trainable state, seed states), then the
    optimizer's (iterations, learning rate, slots)."""
    optimizer = getattr(model, "optimizer", None)
    return list(model.variables) + list(optimizer.variables if optimizer is not None else [])


class Session:
    """One process' snapshots under one ``TorusStrategy`` (``strategy.snapshots``; None where off). Collective
    to create (the node's writer is chosen by a split of the communicator)."""

    def __init__(self, torus_comm, job_id: str, steps: int | None, seconds: float | None):
        self.torus_comm, self.job_id = torus_comm, job_id
        self.cadence = snapshot.Cadence(steps, seconds)
        self.writer = snapshot.node_writer(torus_comm)  # its own node layout: no message
        self.restart = knobs.read("TORUS_RESTART")
        # torus-run's progress marker, on rank 0: a whole line in one write, on stderr (Keras' progress bar
        # holds stdout's line open), at most every PROGRESS_EVERY_S
        self.progress = torus_comm.rank == 0 and knobs.read("TORUS_RUN_PROGRESS")
        self._reported = 0.0
        self.fits = 0  # fit calls of this process so far
        self.agreed = False
        self.manual = False  # the process called resume: it takes its own snapshots, fit none
        self.target: tuple | None = None  # (step, arrays, meta) to resume from, once agreed
        # each fit's History so far ({fit index: {"epoch": [...], "history": {key: [...]}}}): in every snapshot,
        # so that a resumed script's History objects hold the epochs trained before the restart
        self.histories: dict = {}
        self.restored: dict = {}  # fit index -> its History before the restart, merged in when the fit returns
        self._stores: dict = {}
        self.architecture = ""  # of fit's model (SnapshotCallback), part of the key

    @classmethod
    def create(cls, torus_comm, steps: int | None = None, seconds: float | None = None):
        job_id = knobs.read("TORUS_JOB_ID")
        return cls(torus_comm, job_id, steps, seconds) if job_id else None

    def store_folder(self) -> str:
        """This job's snapshot folder on this node (``TORUS_SNAPSHOT_DIR/<job id>``)."""
        return str(snapshot.SnapshotStore(None, self.job_id, "-").folder)

    def store(self, key: str):
        if key not in self._stores:
            self._stores[key] = snapshot.SnapshotStore(None, self.job_id, key)
        return self._stores[key]

    def report_progress(self, step: int) -> None:
        if self.progress and time.monotonic() - self._reported >= PROGRESS_EVERY_S:
            self._reported = time.monotonic()
            report.say(f"at step {step}")

    def agree(self, variables) -> None:
        """Once per process, at its first fit or ``resume`` (collective): the snapshot to resume from, or none."""
        if self.agreed:
            return
        self.agreed = True
        store = self.store(model_key(variables, self.architecture))
        self.target = snapshot.agree_newest(self.torus_comm.comm, store, stall_timeout(self.torus_comm))

    def due(self, step: int) -> bool:
        """After global step ``step``: the progress marker; True where a snapshot is due on this node's writer."""
        self.report_progress(step)
        return self.writer and self.cadence.due(step)

    def take(self, variables, step: int, meta: dict) -> None:
        """After global step ``step``: the progress marker, and a snapshot of ``variables`` with ``meta`` where
        one is due on this node's writer (no collective)."""
        if self.due(step):
            self.write(variables, step, meta)

    def write(self, variables, step: int, meta: dict, extra: dict | None = None) -> None:
        """A snapshot of ``variables`` (and the arrays ``extra``, named otherwise) after ``step``, copied now and
        written in the background."""
        arrays = {str(k): np.array(v.numpy()) for k, v in enumerate(variables)}
        arrays.update(extra or {})
        self.store(model_key(variables, self.architecture)).save_async(step, arrays, meta)
        self.cadence.taken(step)

    def resume(self, variables) -> dict | None:
        """Custom loops (``TorusStrategy.resume``): assign the newest snapshot to ``variables`` and return its
        meta with ``step``; None where there is none (collective)."""
        self.manual = True
        self.agree(variables)
        if self.target is None:
            return None
        step, arrays, meta = self.target
        self.target = None
        assign(variables, arrays, step, self.torus_comm.rank)
        if self.torus_comm.rank == 0:
            report.say(f"resumed at step {step} (restart {self.restart}, {self.torus_comm.size} ranks)")
        return {**meta, "step": step}


def assign(variables, arrays: dict, step: int, rank: int) -> None:
    """The snapshot's arrays into ``variables``, in order (the model key matched: same count, shapes, dtypes)."""
    held = sum(name.isdigit() for name in arrays)  # the variables (callback_state's arrays are named otherwise)
    if held != len(variables):
        raise ValueError(f"TorusStrategy on rank {rank}: the snapshot of step {step} holds {held} "
                         f"variables, this model and optimizer {len(variables)}")
    for k, v in enumerate(variables):
        v.assign(arrays[str(k)])


class SnapshotCallback(keras.callbacks.Callback):
    """Takes snapshots after steps and resumes from one at ``on_train_begin`` (the module docstring)."""

    def __init__(self, session: Session, order, global_batch: int | None, siblings: list):
        super().__init__()
        self.session, self.order, self.global_batch = session, order, global_batch
        self.siblings = siblings  # the fit call's other callbacks (callback_state)
        self.index = session.fits
        session.fits += 1
        self.epoch, self.skip, self._original_step = 0, 0, None
        self._due_at_epoch_end: int | None = None

    def on_train_begin(self, logs=None):
        session, model = self.session, self.model
        if not session.agreed:
            session.architecture = architecture(model)
        session.agree(state_variables(model))
        if session.target is None:
            return
        step, arrays, meta = session.target
        if not session.histories:  # the first fit of a resumed process: every fit's History up to the snapshot
            session.histories = meta.get("histories", {})
        if meta["fit"] >= self.index and str(self.index) in session.histories:
            session.restored[self.index] = copy.deepcopy(session.histories[str(self.index)])  # goes on growing
        if meta["fit"] > self.index:  # a fit the snapshot's run had finished: no epoch runs
            compat.set_initial_epoch(model, self.params["epochs"])
            return
        if meta["fit"] < self.index:
            return
        session.target = None  # consumed
        self._restore(step, arrays, meta)

    def _restore(self, step: int, arrays: dict, meta: dict) -> None:
        model, rank = self.model, self.session.torus_comm.rank
        if meta["global_batch"] != self.global_batch:
            raise ValueError(f"TorusStrategy fit on rank {rank}: resuming the snapshot of step {step} needs the "
                             f"global batch it was taken with, batch_size={meta['global_batch']}, not "
                             f"{self.global_batch}: pass the global batch, not a per-rank one times the ranks "
                             f"(to train at another global batch, start afresh: another TORUS_JOB_ID / torus-run "
                             f"--job-id, or remove {self.session.store_folder()})")
        assign(state_variables(model), arrays, step, rank)
        callback_state.restore(self.siblings, meta.get("callbacks"), arrays)  # after their on_train_begin
        if self.order is not None and meta["seed"] is not None:
            self.order.reseed(meta["seed"])
        epoch, done = meta["epoch"], meta["batch"]
        compat.set_initial_epoch(model, epoch)
        self.skip = done
        if done:
            self._original_step = model.train_function
            model.train_function = self._pass_over
        if rank == 0:  # the line torus-run reads (steps redone: the last progress marker less this step)
            report.say(f"resumed at step {step} (fit {self.index}, epoch {epoch + 1}, {done} batches of it "
                       f"done; restart {self.session.restart}, {self.session.torus_comm.size} ranks)")

    def _pass_over(self, iterator):
        """A step already trained before the restart: its batches are read (the data goes on in order), not
        trained on; the real step comes back once they are passed."""
        for _ in range(self.model.steps_per_execution):
            next(iterator)
        self.skip -= self.model.steps_per_execution
        if self.skip <= 0:
            self.model.train_function = self._original_step
        return {}

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        session = self.session
        if self.skip > 0 or not (session.writer or session.progress):
            return
        step = int(self.model.optimizer.iterations.numpy())
        if not session.due(step):  # the variable list and meta only for a snapshot, not every step
            return
        if batch + 1 == self.params.get("steps"):  # after the epoch's end: its validation and History are in
            self._due_at_epoch_end = step
            return
        self._write(step, self.epoch, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        mine = self.session.histories.setdefault(str(self.index), {"epoch": [], "history": {}})
        mine["epoch"].append(int(epoch))
        for key, value in (logs or {}).items():
            mine["history"].setdefault(key, []).append(float(value))
        if self._due_at_epoch_end is not None:
            self._write(self._due_at_epoch_end, epoch + 1, 0)
            self._due_at_epoch_end = None

    def _write(self, step: int, epoch: int, done: int) -> None:
        session = self.session
        callbacks, extra = callback_state.capture(self.siblings)
        meta = {"fit": self.index, "epoch": epoch, "batch": done, "global_batch": self.global_batch,
                "seed": None if self.order is None else self.order.seed, "ranks": session.torus_comm.size,
                "restart": session.restart, "histories": copy.deepcopy(session.histories),  # the store owns it
                "callbacks": callbacks}
        session.write(state_variables(self.model), step, meta, extra)

    def on_train_end(self, logs=None):
        compat.set_initial_epoch(self.model, None)
        if self._original_step is not None:
            self.model.train_function = self._original_step


def restore_history(call, result):
    """fit_hook stage "result" of ``fit``: the History of a fit that a resumed process passed over or resumed
    gets the epochs trained before the restart, in front of its own."""
    session = call.strategy.snapshots
    if call.method != "fit" or session is None or not isinstance(result, keras.callbacks.History):
        return result
    before = session.restored.pop(session.fits - 1, None)
    if before:
        result.epoch = list(before["epoch"]) + list(result.epoch)
        keys = list(before["history"]) + [k for k in result.history if k not in before["history"]]
        result.history = {k: list(before["history"].get(k, [])) + list(result.history.get(k, [])) for k in keys}
    return result


def add_snapshots(call) -> None:
    """fit_hook stage "callbacks" of ``fit``: the snapshot callback, after the initial-state broadcast."""
    from torus.integrations.keras.fit.fit_hook import add_callback

    session = call.strategy.snapshots
    if call.method != "fit" or session is None or session.manual:
        return
    x = call.arguments["x"]
    order = x if isinstance(x, inputs.AgreedOrder) else None
    global_batch = order.batch_size if order is not None else call.arguments.get("batch_size")
    given = call.arguments.get("callbacks")
    siblings = list(given.callbacks if isinstance(given, keras.callbacks.CallbackList)
                    else keras.tree.flatten(given) if given else [])
    add_callback(call, SnapshotCallback, session, order, global_batch, siblings)
