"""``TORUS_TIMELINE=FILE`` under ``TorusStrategy``: every ``fit`` records a Chrome trace of each rank's steps.

The strategy makes one ``torus.timeline.Timeline`` (collective, at construction) and hands it to its two
hosts; the fit stage "callbacks" appends a ``StepTimeline`` to every ``fit``. The lanes, per rank:

- ``step``: each train batch (``on_train_batch_begin`` to ``_end``; with ``steps_per_execution`` one span per
  execution), args ``step`` (the batch index in the epoch) and ``epoch``;
- ``start``: each gradient bucket's copy into its buffer and its hand-off to the communication thread
  (buckets.py; overlap on);
- ``wait``: each bucket's wait in the graph: communication the step did not hide;
- ``comm``: each all-reduce on the communication thread (a bucket's, args ``bucket``, ``nbytes``,
  ``algorithm``, ``wire``; the fused one with overlap off, ``allreduce``; the metrics', ``metric allreduce``).

At the end of every ``fit`` the trace so far is written (``Timeline.save``, collective: rank 0 writes FILE,
replacing the last one), so a script that fits several times leaves the whole run, and a job that fails in a
later fit still leaves the earlier ones.
"""
from __future__ import annotations

import time

import keras

from torus import timeline

LANES = ("step", "start", "wait", "comm")


def make(torus_comm):
    """The strategy's ``Timeline`` where ``TORUS_TIMELINE`` is set, else None. Collective when set."""
    return timeline.from_env(torus_comm.comm, lanes=LANES)


class StepTimeline(keras.callbacks.Callback):
    """Spans on the ``step`` lane, and ``Timeline.save`` at the end of training."""

    def __init__(self, tl):
        super().__init__()
        self.timeline = tl
        self._epoch = 0
        self._t0 = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.timeline.span("train step", "step", self._t0, time.perf_counter(), step=batch, epoch=self._epoch)

    def on_train_end(self, logs=None):
        self.timeline.save()


def add_step_timeline(strategy, method: str, arguments: dict) -> dict:
    """Stage "callbacks": append a ``StepTimeline`` to ``fit`` where the strategy records a timeline."""
    tl = strategy.timeline
    if tl is None or method != "fit":
        return arguments
    callbacks = arguments.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        mine = StepTimeline(tl)
        mine.set_model(arguments["self"])
        mine.set_params(callbacks.params)
        callbacks.callbacks.append(mine)
        return arguments
    listed = keras.tree.flatten(callbacks) if callbacks else []
    return {**arguments, "callbacks": [*listed, StepTimeline(tl)]}
