"""The executor's out-of-place mode (``run(..., src=)``: read the input from src, never copy it up front) gives
the bits of the in-place mode on a copy of src, for random plans whose messages straddle touched and untouched
regions, reduce twice into one region in one step, scale untouched regions, and leave regions unwritten.

Plans here talk to rank 0 of ``MPI.COMM_SELF`` (a rank may send to itself), so one process runs them; the real
schedules are covered under mpiexec by tests/mpi/test_allreduce.py and test_reduce_scatter.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from torus.runtime.executor import Executor
from torus.schedules.plan import Recv, Scale, Send, Step


def _random_plan(rng, count: int, nsteps: int) -> list:
    steps = []
    for _ in range(nsteps):
        if rng.random() < 0.15:
            lo = int(rng.integers(0, count))
            steps.append(Step(scale=Scale(lo, int(rng.integers(0, count - lo + 1)))))
            continue
        # Two disjoint regions of equal length: one sent, one received into (the plan rule).
        n = int(rng.integers(1, count // 2 + 1))
        a, b = sorted(rng.choice(count - 2 * n + 1, 2, replace=True))
        first, second = (int(a), int(b) + n)
        send_at, recv_at = (first, second) if rng.random() < 0.5 else (second, first)
        reduce = bool(rng.random() < 0.7)
        sends = [Send("world", 0, send_at, n)]
        recvs = [Recv("world", 0, recv_at, n, reduce=reduce, final=bool(rng.random() < 0.3))]
        if reduce and rng.random() < 0.3:  # a second reduce into the same region in the same step
            sends.append(Send("world", 0, send_at, n))
            recvs.append(Recv("world", 0, recv_at, n, reduce=True))
        steps.append(Step(sends=tuple(sends), recvs=tuple(recvs)))
    return steps


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_out_of_place_equals_in_place(seed, dtype):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(2, 64))
    itemsize = np.dtype(dtype).itemsize
    # Tiny segments, so messages are cut and the cuts straddle regions touched in earlier steps.
    ex = Executor({"world": MPI.COMM_SELF}, 0, int(rng.integers(1, 6)) * itemsize, 10.0)
    plan = ex.compile(_random_plan(rng, count, int(rng.integers(1, 8))), itemsize, count)
    op, scale = ("sum", 0.5) if np.dtype(dtype).kind == "f" else ("max", 1.0)
    src = rng.integers(-50, 50, count).astype(dtype)
    src.flags.writeable = False

    expected = src.copy()
    ex.run("test", plan, expected, op, scale)
    got = np.full(count, -7, dtype)
    ex.run("test", plan, got, op, scale, src)
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))

    lo, hi = sorted(int(v) for v in rng.integers(0, count + 1, 2))
    part = np.full(count, -7, dtype)
    ex.run("test", plan, part, op, scale, src, (lo, hi))
    np.testing.assert_array_equal(part[lo:hi], expected[lo:hi])


@pytest.mark.parametrize("seed", range(40))
def test_a_send_is_waited_for_before_its_region_is_next_written(seed):
    """Brute force over element masks: no step between a send and its deadline writes what it reads, and the
    deadline step does (or it is the end of the plan)."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(2, 64))
    ex = Executor({"world": MPI.COMM_SELF}, 0, int(rng.integers(1, 6)) * 4, 10.0)
    plan = ex.compile(_random_plan(rng, count, int(rng.integers(1, 10))), 4, count)
    written = []
    for st in plan.steps:
        mask = np.zeros(count, bool)
        for m in st.recvs:
            mask[m.lo:m.hi] = True
        if st.scale is not None:
            mask[st.scale[0]:st.scale[1]] = True
        written.append(mask)
    for si, st in enumerate(plan.steps):
        for m in st.sends:
            hits = [t for t in range(si + 1, len(plan.steps)) if written[t][m.lo:m.hi].any()]
            assert m.until == (hits[0] if hits else len(plan.steps)), (si, m.lo, m.hi, m.until, hits)
    # run() waits for exactly these: each send once, at its deadline step (or at the end)
    waits = [(sid, t) for t, st in enumerate(plan.steps) for sid in st.retire]
    waits += [(sid, len(plan.steps)) for sid in plan.tail]
    sends = [m for st in plan.steps for m in st.sends]
    assert sorted(waits) == [(m.sid, m.until) for m in sends] == [(k, m.until) for k, m in enumerate(sends)]
    assert [m for _, m in plan.sends] == sends
