"""A failure on the communication thread (overlap on) ends a TorusStrategy job, naming the rank, within a bound.

Each test launches ``mpiexec -n 2`` / ``-n 3`` of this file (the worker at the bottom): every rank fits a small
model with ``overlap=True`` and small buckets, so each step is several bucket all-reduces on the thread.

- ``raise``: in the second fit, the last rank's third bucket all-reduce raises (an injected ``OSError``, as a
  broken transport would): its step re-raises it from the bucket's wait, the uncaught exception aborts the job;
- ``leave``: the last rank leaves in the middle of the second epoch by ``sys.exit(0)`` (no exception: its
  atexit handlers stop its communication thread, nothing hangs there); the others' bucket all-reduce fails on
  their communication thread with ``TimeoutError`` (the shared-memory transport sees the rank leave; over
  MPI, no progress for TORUS_TIMEOUT=3 s), which reaches their step and aborts the job.

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
    env = dict(os.environ, TORUS_TIMEOUT="3", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
    return jobs.run(cmd, env, BOUND_S + 30, f"{ranks} ranks, {mode}:")


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("mode", ["raise", "leave"])
def test_a_failure_on_the_communication_thread_ends_the_job(ranks, mode):
    rc, seconds, out = _job(ranks, mode)
    tail = out[-4000:]
    last = ranks - 1
    assert rc != 0, f"exit status 0:\n{tail}"
    assert seconds < BOUND_S, f"the job took {seconds:.0f} s (bound {BOUND_S} s):\n{tail}"
    assert "fit done" not in out and "buckets per step: " in out, tail
    if mode == "raise":
        assert f"[rank {last}] uncaught" in out and f"injected transport failure on rank {last}" in out, tail
    else:
        assert f"rank {last} leaves" in out, tail
        assert ("no progress for 3 s" in out or f"rank {last} left the job" in out) and "uncaught" in out, tail


def worker(mode: str) -> None:
    import keras
    import numpy as np

    from torus.integrations.keras import TorusStrategy

    strategy = TorusStrategy(overlap=True, bucket_bytes=128)
    last = strategy.rank == strategy.size - 1
    tc = strategy.torus_comm
    calls = {"n": 0}
    original = tc.allreduce

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(f"injected transport failure on rank {strategy.rank}")
        return original(*args, **kwargs)

    class Leave(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if self.epoch == 1 and batch == 1 and last and mode == "leave":
                print(f"rank {strategy.rank} leaves", flush=True)
                sys.exit(0)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dense(8),
                                  keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    x, y = np.ones((8 * strategy.size, 5), np.float32), np.ones((8 * strategy.size, 2), np.float32)
    model.fit(x, y, batch_size=2 * strategy.size, epochs=1, verbose=0)
    print(f"buckets per step: {strategy.host.buckets.buckets_run / 4:g}", flush=True)
    if mode == "raise" and last:
        tc.allreduce = failing
    model.fit(x, y, batch_size=2 * strategy.size, epochs=3, verbose=0, callbacks=[Leave()])
    print("fit done", flush=True)


if __name__ == "__main__":
    worker(sys.argv[1])
