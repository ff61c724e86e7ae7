"""A rank that fails before ``fit`` ends a TorusStrategy job instead of leaving the others in the initial broadcast.

Each test launches ``mpiexec -n 2`` and ``-n 3`` of this file (the worker at the bottom): every rank builds a
TorusStrategy and a small model; the last rank then leaves before ``fit``, the others call ``fit``.

- it raises: the strategy installed ``torus.faults.abort_on_exception`` (the default), so its uncaught exception
  aborts the job at once;
- it leaves by ``sys.exit(0)`` (no exception to catch): the others wait in fit's first collective (the ranks'
  agreement on the inputs), which is bounded by the stall timeout (TORUS_TIMEOUT=3 here), raise TimeoutError
  naming it, and abort.
- ``TorusStrategy(abort_on_exception=False)`` installs no hook (one rank).
- it creates a variable under the scope that the others do not (they wait in an MPI barrier): the creation's
  agreement on rank 0's initial value (creation.py) times out after 3 s, naming the variable, and aborts.

The 90 s bound is generous (TensorFlow takes about 10 s to start here): a correctness property, not speed.
"""
from __future__ import annotations

import os
import sys

import pytest

from tests import jobs

pytest.importorskip("tensorflow")
BOUND_S = 90


def _job(ranks: int, mode: str) -> tuple[int, float, str]:
    cmd = [jobs.mpiexec(), "-n", str(ranks), sys.executable, __file__, mode]
    env = dict(os.environ, TORUS_TIMEOUT="3", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               TF_CPP_MIN_LOG_LEVEL="3")
    return jobs.run(cmd, env, BOUND_S + 30, f"{ranks} ranks, last one leaving by {mode}:")


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("mode", ["raise", "sys.exit(0)"])
def test_a_rank_leaving_before_fit_ends_the_job(ranks, mode):
    rc, seconds, out = _job(ranks, mode)
    tail = out[-3000:]
    last = ranks - 1
    assert rc != 0, f"exit status 0:\n{tail}"
    assert seconds < BOUND_S, f"the job took {seconds:.0f} s (bound {BOUND_S} s):\n{tail}"
    assert f"rank {last} leaves by {mode}" in out and "fit done" not in out, tail
    if mode == "raise":
        assert f"[rank {last}] uncaught RuntimeError" in out, tail
    else:
        survivors = [r for r in range(last) if f"TorusStrategy fit on rank {r}: no progress for 3 s comparing "
                     "every rank's inputs" in out]
        assert survivors and "uncaught TimeoutError" in out, tail


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_variable_one_rank_creates_alone_ends_the_job(ranks):
    """Variables created under the scope take rank 0's initial value (creation.py): collective. The last rank
    creates one the others do not (they wait in an unbounded MPI barrier): it times out naming the variable
    instead of waiting forever, and its uncaught TimeoutError ends the job."""
    rc, seconds, out = _job(ranks, "extra variable")
    tail = out[-3000:]
    last = ranks - 1
    assert rc != 0, f"exit status 0:\n{tail}"
    assert seconds < BOUND_S, f"the job took {seconds:.0f} s (bound {BOUND_S} s):\n{tail}"
    assert f"TorusStrategy on rank {last}: no progress for 3 s agreeing on the initial value of variable " \
           "'extra' (4,) float32" in out and f"[rank {last}] uncaught TimeoutError" in out, tail
    assert "barrier done" not in out, tail


def test_abort_on_exception_can_be_turned_off():
    rc, _, out = _job(1, "optout")
    assert rc == 0 and "hook installed: False" in out, out[-3000:]


def worker(mode: str) -> None:
    import keras
    import numpy as np

    from torus.integrations.keras import TorusStrategy

    if mode == "optout":
        TorusStrategy(abort_on_exception=False)
        print(f"hook installed: {hasattr(sys.excepthook, 'torus_previous')}", flush=True)
        return
    strategy = TorusStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    if mode == "extra variable":
        if strategy.rank == strategy.size - 1:
            import tensorflow as tf

            with strategy.scope():
                tf.Variable(tf.zeros(4), name="extra")
        strategy.torus_comm.comm.Barrier()
        print("barrier done", flush=True)
        return
    if strategy.rank == strategy.size - 1:
        print(f"rank {strategy.rank} leaves by {mode}", flush=True)
        if mode == "raise":
            raise RuntimeError("the last rank fails before fit on purpose")
        sys.exit(0)
    model.fit(np.ones((6, 3), np.float32), np.ones((6, 2), np.float32), batch_size=6, verbose=0)  # 2, 3 ranks
    print("fit done", flush=True)


if __name__ == "__main__":
    worker(sys.argv[1])
