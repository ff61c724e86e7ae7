"""Stage "callbacks" of ``fit_hook``: under ``TORUS_TIMELINE=FILE`` every ``fit`` records its train steps.

The strategy makes one ``torus.timeline.Timeline`` (``collectives/trace.py``, which lists every lane) and hands
it to its hosts; this stage appends a ``StepTimeline`` to every ``fit``, which records the ``step`` lane: each
train batch (``on_train_batch_begin`` to ``_end``; with ``steps_per_execution`` one span per execution), args
``step`` (the batch index in the epoch), ``epoch`` and ``fit`` (0 for the first fit).

At the end of every ``fit`` the trace so far is written (``Timeline.save``, collective: rank 0 writes FILE,
replacing the last one), so a script that fits several times leaves the whole run, and a job that fails in a
later fit still leaves the earlier ones. ``app/breakdown.py`` reads such a trace without TensorFlow.
"""
from __future__ import annotations

import time

import keras

from torus.integrations.keras.fit import fit_hook


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
