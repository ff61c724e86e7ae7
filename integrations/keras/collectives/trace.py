"""``TORUS_TIMELINE=FILE`` under ``TorusStrategy``: every ``fit`` records a Chrome trace of each rank's steps.

The strategy makes one ``torus.timeline.Timeline`` (collective, at construction) and hands it to its
hosts; the fit stage in ``fit/step_timeline.py`` appends a ``StepTimeline`` to every ``fit``. The lanes:

- ``step``: each train batch (``on_train_batch_begin`` to ``_end``; with ``steps_per_execution`` one span per
  execution), args ``step`` (the batch index in the epoch), ``epoch`` and ``fit`` (0 for the first fit);
- ``start``: each gradient bucket's copy into its buffer and its hand-off to the communication thread
  (buckets.py; overlap on);
- ``wait``: each bucket's wait in the graph: communication the step did not hide;
- ``comm``: each all-reduce on the communication thread (a bucket's, args ``bucket``, ``nbytes``,
  ``algorithm``, ``wire``; with overlap off one per dtype, ``allreduce``; the metrics', ``metric allreduce``);
- ``replica``: where the strategy runs its replica-context collectives on a communicator of their own
  (overlap on, ``MPI_THREAD_MULTIPLE``: strategy.py), those (``replica allreduce``: SyncBN's moments) and the
  metric all-reduce, on TensorFlow's thread beside the buckets.

At the end of every ``fit`` the trace so far is written (``StepTimeline``: rank 0 writes FILE, replacing the
last one). ``breakdown.py`` reads such a trace without TensorFlow.
"""
from __future__ import annotations

from torus import timeline

LANES = ("step", "start", "wait", "comm", "replica")


def make(torus_comm):
    """The strategy's ``Timeline`` where ``TORUS_TIMELINE`` is set, else None. Collective when set."""
    return timeline.from_env(torus_comm.comm, lanes=LANES)
