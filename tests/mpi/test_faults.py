"""Stall timeouts: one rank does not call (or fails before its first message), and every other rank raises
torus.errors.TimeoutError naming its operation and rank, and where it waited: the argument check (check on)
or the step and peer of the schedule (check off; or the set-up of a node's shared-memory window at its first
use, for the shared-memory phases across nodes).

The communicator of each case is left behind unused afterwards (its abandoned requests never complete; the
timeout message says it is unusable). Dead ranks, which end the job, are in tests/test_faults_subprocess.py.
Budget: 5 cases of one 2-second timeout each, about 12 s per K.
"""
from __future__ import annotations

import numpy as np
import pytest

import torus
from oracle import SIZE, WORLD

RANK, LAST = WORLD.Get_rank(), SIZE - 1

pytestmark = pytest.mark.skipif(SIZE < 2, reason="a stall needs a second rank")


def call(tc, collective: str, algorithm: str, dtype=np.float64, op="sum"):
    x = np.ones(4 * SIZE, dtype)
    if collective == "allreduce":
        return tc.allreduce(x, op=op, algorithm=algorithm)
    if collective == "reduce_scatter":
        return tc.reduce_scatter(x, op=op, algorithm=algorithm)
    return tc.allgather(x, algorithm=algorithm)


@pytest.mark.parametrize("collective, algorithm, check", [
    ("allreduce", "ring", False),
    ("allreduce", "torus2d", True),
    ("reduce_scatter", "hierarchical", False),
    ("allgather", "ring", False),
])
def test_absent_rank_times_out_the_others(monkeypatch, collective, algorithm, check):
    monkeypatch.setenv("TORUS_TIMEOUT", "2")  # read by TorusComm(), as a job would set it
    tc = torus.TorusComm(check=check, ranks_per_node=2)
    algo = "ring" if algorithm == "hierarchical" and SIZE % 2 else algorithm  # uneven nodes fall back
    if RANK != LAST:
        with pytest.raises(torus.TimeoutError) as info:
            call(tc, collective, algorithm)
        msg = str(info.value)
        assert msg.startswith(f"{collective}({algo}) on rank {RANK}: no progress for 2 s "), msg
        # check off: a step, or (hierarchical's shared-memory phases across nodes) the set-up of the node's
        # window at its first use, which an absent rank also never joins
        where = ("in the argument check",) if check else ("at step ", "setting up the shared-memory window")
        assert any(w in msg for w in where) and "abort the job" in msg, msg
        if not check and "at step " in msg:
            assert "waiting on rank " in msg, msg
    WORLD.Barrier()


@pytest.mark.parametrize("check", [True, False])
def test_local_error_on_one_rank_ends_the_call_on_the_others(check):
    """A rank whose arguments fail its own validation raises at once. With the check on it also tells the
    others (its share of the signature all-gather, marked), so they raise MismatchError naming it instead of
    waiting (the timeout, 120 s, would raise TimeoutError instead); with the check off they reach the first
    data step and time out there (2 s)."""
    tc = torus.TorusComm(timeout=120 if check else 2, check=check)
    if RANK == LAST:
        with pytest.raises(TypeError, match=f"allreduce on rank {RANK}: op 'avg' is not defined"):
            call(tc, "allreduce", "ring", dtype=np.int64, op="avg")
    elif check:
        with pytest.raises(torus.MismatchError, match=f"allreduce\\(ring\\) on rank {RANK}: rank {LAST} "
                                                      "rejected its own arguments"):
            call(tc, "allreduce", "ring", dtype=np.int64)
    else:
        with pytest.raises(torus.TimeoutError, match=f"allreduce\\(ring\\) on rank {RANK}: .* at step [0-9]+/"):
            call(tc, "allreduce", "ring", dtype=np.int64)
    WORLD.Barrier()
    if check:
        tc.Free()  # completes the erroring rank's report; with the check off the others' messages still pend
