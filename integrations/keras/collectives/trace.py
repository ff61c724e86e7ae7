"""``TORUS_TIMELINE=FILE`` under ``TorusStrategy``: every ``fit`` records a Chrome trace of each rank's steps.

The strategy makes one ``torus.timeline.Timeline`` (collective, at construction) and hands it to its
hosts; the fit stage "callbacks" appends a ``StepTimeline`` to every ``fit``. The lanes, per rank:

- ``step``: each train batch (``on_train_batch_begin`` to ``_end``; with ``steps_per_execution`` one span per
  execution), args ``step`` (the batch index in the epoch), ``epoch`` and ``fit`` (0 for the first fit);
- ``start``: each gradient bucket's copy into its buffer and its hand-off to the communication thread
  (buckets.py; overlap on);
- ``wait``: each bucket's wait in the graph: communication the step did not hide;
- ``comm``: each all-reduce on the communication thread (a bucket's, args ``bucket``, ``nbytes``,
  ``algorithm``, ``wire``; the fused one with overlap off, ``allreduce``; the metrics', ``metric allreduce``);
- ``replica``: where the strategy runs its replica-context collectives on a communicator of their own
  (overlap on, ``MPI_THREAD_MULTIPLE``: strategy.py), those (``replica allreduce``: SyncBN's moments) and the
  metric all-reduce, on TensorFlow's thread beside the buckets.

At the end of every ``fit`` the trace so far is written (``Timeline.save``, collective: rank 0 writes FILE,
replacing the last one), so a script that fits several times leaves the whole run, and a job that fails in a
later fit still leaves the earlier ones. ``breakdown.py`` reads such a trace without TensorFlow.
"""
from __future__ import annotations

import time

import keras

from torus import timeline
from torus.integrations.keras.fit import fit_hook

LANES = ("step", "start", "wait", "comm", "replica")


def make(torus_comm):
    """The strategy's ``Timeline`` where ``TORUS_TIMELINE`` is set, else None. Collective when set."""
    return timeline.from_env(torus_comm.comm, lanes=LANES)


class StepTimeline(keras.callbacks.Callback):
    """Spans on the ``step`` lane, and ``Timeline.save`` at the end of training."""

    def __init__(self, tl):
        super().__init__()
        self.timeline = tl
        self.fit = tl.saves  # every fit saves once, at its end
        self._epoch = 0
        self._t0 = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.timeline.span("train step", "step", self._t0, time.perf_counter(), step=batch, epoch=self._epoch,
                           fit=self.fit)

    def on_train_end(self, logs=None):
        self.timeline.save()


def add_step_timeline(call) -> None:
    """Stage "callbacks": append a ``StepTimeline`` to ``fit`` where the strategy records a timeline."""
    if call.strategy.timeline is not None and call.method == "fit":
        fit_hook.add_callback(call, StepTimeline, call.strategy.timeline)
