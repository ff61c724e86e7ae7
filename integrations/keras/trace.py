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
from torus.integrations.keras import fit_hook

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
    if strategy.timeline is None or method != "fit":
        return arguments
    return fit_hook.add_callback(arguments, StepTimeline, strategy.timeline)


def breakdown(trace: dict) -> dict:
    """Per rank, the median over its train steps (all but the first, which traces) of where a step went, in
    seconds, from a merged trace (``torus.timeline`` format, this module's lanes):

    - ``backprop``: the step's start to its last bucket start (forward, backward and the bucket copies: the
      compute before the last gradient exists);
    - ``exposed``: the bucket waits after that (communication the step did not hide);
    - ``metric``: the metric all-reduces in the step;
    - ``other``: the rest (the optimizer update, input, Keras and callbacks), so the four add up to ``step``;
    - ``comm``: the buckets' time on the communication thread, and ``hidden`` = 1 - exposed / comm (at least 0: a
      wait also costs its own call, which can exceed a tiny bucket's all-reduce).

    Steps without buckets (overlap off) count the fused all-reduce as ``exposed`` and ``backprop`` as the
    time before it. Returns ``{rank: {name: seconds}}``."""
    import numpy as np

    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    out = {}
    for rank in sorted({e["pid"] for e in spans}):
        mine = sorted((e for e in spans if e["pid"] == rank), key=lambda e: e["ts"])
        rows = []
        for step in [e for e in mine if e["name"] == "train step"][1:]:
            t0, t1 = step["ts"], step["ts"] + step["dur"]
            inside = [e for e in mine if t0 <= e["ts"] < t1 and e is not step]
            starts = [e for e in inside if e["name"].endswith(" start") and "bucket" in e["name"]]
            waits = [e for e in inside if e["name"].endswith(" wait") and "bucket" in e["name"]]
            fused = [e for e in inside if e["name"] == "allreduce"]
            metric = sum(e["dur"] for e in inside if e["name"] == "metric allreduce")
            comm = sum(e["dur"] for e in inside if e["name"].endswith(" allreduce") and "bucket" in e["name"])
            if starts:
                backprop = max(e["ts"] + e["dur"] for e in starts) - t0
                exposed = sum(max(0.0, e["ts"] + e["dur"] - max(e["ts"], t0 + backprop)) for e in waits)
            else:
                backprop = (fused[0]["ts"] - t0) if fused else step["dur"]
                exposed = comm = sum(e["dur"] for e in fused)
            rows.append((step["dur"], backprop, exposed, metric, comm))
        if not rows:
            continue
        step_s, backprop, exposed, metric, comm = (float(np.median(c)) / 1e6 for c in zip(*rows))
        out[rank] = {"steps": len(rows), "step": step_s, "backprop": backprop, "exposed": exposed,
                     "metric": metric, "other": step_s - backprop - exposed - metric, "comm": comm,
                     "hidden": max(0.0, 1 - exposed / comm) if comm > 0 else None}
    return out


def main(argv=None) -> int:
    """``python -m torus.integrations.keras.trace FILE``: the step breakdown of a TORUS_TIMELINE trace."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m torus.integrations.keras.trace",
                                description="Where the train steps of a TORUS_TIMELINE trace went, per rank.")
    p.add_argument("trace", metavar="FILE")
    args = p.parse_args(argv)
    with open(args.trace) as f:
        rows = breakdown(json.load(f))
    if not rows:
        print(f"{args.trace}: no 'train step' spans (fit records them; a custom loop adds its own with "
              "strategy.timeline.span('train step', 'step', t0, t1))", file=sys.stderr)
        return 1
    print("medians over each rank's train steps after its first (which traces)")
    print("rank  steps   step_s  backprop  exposed   metric    other     comm  hidden")
    for rank, r in rows.items():
        hidden = "" if r["hidden"] is None else f"{r['hidden']:6.0%}"
        print(f"{rank:4d} {r['steps']:6d} {r['step']:8.3f} {r['backprop']:9.3f} {r['exposed']:8.3f} "
              f"{r['metric']:8.3f} {r['other']:8.3f} {r['comm']:8.3f}  {hidden}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
