"""When to take a snapshot: every ``steps`` global steps or every ``seconds`` of wall time, whichever comes
first (``TORUS_SNAPSHOT_STEPS``, default 500; ``TORUS_SNAPSHOT_SECONDS``, default 60; 0 turns that trigger off).

Why these defaults can be left on. A failure redoes at most one interval of work (plus the write in flight),
so the seconds bound what a lost host takes from the job: a minute of every rank's time. What a snapshot
takes from training is the host copy of the state at a step boundary, on one rank per node; the write runs
on a background thread at low priority (:mod:`torus.snapshot.background`), and a slow disk makes snapshots
older, never queued. With one copy a minute, the copy would have to last over a second before steps took
1.02 times as long (the bound issue 42 sets). bench/snapshots/results/snapshot_write.txt has the copy's and
the write's times for a ResNet-50's weights and slots; copying into buffers allocated once (no page faults of
fresh memory) keeps the copy short. The step bound takes over for short steps: a small model, whose copy is
small too, then redoes at most 500 steps.

The clock is each rank's own: where the seconds trigger decides, writers on different nodes may snapshot a
step apart. Harmless (``agree_newest`` takes the newest any rank holds); a caller that wants every node to
snapshot the same step decides on one rank and shares the answer, or uses steps only.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from torus import knobs


class Cadence:
    """``due(step)`` says whether a snapshot is due at global step ``step``; ``taken(step)`` restarts both
    counts. ``steps`` (int) / ``seconds`` (float, seconds): None reads ``TORUS_SNAPSHOT_STEPS`` /
    ``TORUS_SNAPSHOT_SECONDS``; 0 turns that trigger off (both 0: never due). ValueError when negative.
    ``clock``: seconds, monotonic (tests pass their own).

    The counts start at the first ``due`` call (a resumed run counts from the step it resumed at)."""

    def __init__(self, steps: int | None = None, seconds: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.steps = int(knobs.read("TORUS_SNAPSHOT_STEPS") if steps is None else steps)
        self.seconds = float(knobs.read("TORUS_SNAPSHOT_SECONDS") if seconds is None else seconds)
        if self.steps < 0 or self.seconds < 0:
            raise ValueError(f"snapshot cadence: steps {self.steps} and seconds {self.seconds:g} must be >= 0 "
                             "(0 turns that trigger off)")
        self._clock = clock
        self._step: int | None = None  # the step and time the counts run from
        self._time = 0.0

    def due(self, step: int) -> bool:
        """True when ``steps`` steps or ``seconds`` seconds have passed since the last :meth:`taken` (or the
        first call)."""
        if self._step is None:
            self._step, self._time = step, self._clock()
            return False
        return bool((self.steps and step - self._step >= self.steps)
                    or (self.seconds and self._clock() - self._time >= self.seconds))

    def taken(self, step: int) -> None:
        """A snapshot of ``step`` was taken: count both intervals from now."""
        self._step, self._time = step, self._clock()
