"""Saves under TorusStrategy (integrations/keras/fit/saving.py) at the ends of a job, where an in-process test cannot
look: ``mpiexec -n 2`` of this file (the worker at the bottom).

- ``chief-only``: rank 0 alone saves three times (Horovod's idiom) and the script ends: its notices stay unread
  at rank 1, and the job still exits 0 at once (rank 0's sends are small enough to complete without a reader;
  ``MPI_Finalize`` does not wait for them);
- ``other-alone``: rank 1 alone saves: it waits for rank 0's notice, bounded by the stall timeout
  (TORUS_TIMEOUT=3 here), raises ``TimeoutError`` naming the call and the path, and the job aborts.

The 90 s bound is generous (TensorFlow takes about 10 s to start here): a correctness property, not speed.
"""
from __future__ import annotations

import os
import sys

import pytest

from tests import jobs

pytest.importorskip("tensorflow")
BOUND_S = 90


def _job(mode: str, folder: str) -> tuple[int, float, str]:
    cmd = [jobs.mpiexec(), "-n", "2", sys.executable, __file__, mode, folder]
    env = dict(os.environ, TORUS_TIMEOUT="3", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               TF_CPP_MIN_LOG_LEVEL="3")
    return jobs.run(cmd, env, BOUND_S + 30, f"2 ranks, {mode} save:")


def test_a_job_ends_cleanly_after_saves_on_rank_0_alone(tmp_path):
    rc, seconds, out = _job("chief-only", str(tmp_path))
    tail = out[-3000:]
    assert rc == 0 and "rank 0 saved 3 times" in out and "rank 1 done" in out, tail
    assert seconds < BOUND_S, f"the job took {seconds:.0f} s (bound {BOUND_S} s):\n{tail}"
    assert sorted(os.listdir(tmp_path)) == ["m.keras", "w.weights.h5"], os.listdir(tmp_path)


def test_a_save_on_another_rank_alone_times_out_naming_rank_0(tmp_path):
    rc, seconds, out = _job("other-alone", str(tmp_path))
    tail = out[-3000:]
    assert rc != 0 and "rank 1 saved" not in out, tail
    assert seconds < BOUND_S, f"the job took {seconds:.0f} s (bound {BOUND_S} s):\n{tail}"
    assert "Model.save on rank 1: no notice from rank 0 for 3 s that it saved" in out, tail
    assert "uncaught TimeoutError" in out, tail
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def worker(mode: str, folder: str) -> None:
    import keras

    from torus.integrations.keras import TorusStrategy

    strategy = TorusStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    if mode == "chief-only":
        if strategy.is_chief:
            model.save(os.path.join(folder, "m.keras"))
            model.save(os.path.join(folder, "m.keras"))
            model.save_weights(os.path.join(folder, "w.weights.h5"))
            print("rank 0 saved 3 times", flush=True)
        else:
            print("rank 1 done", flush=True)
    elif strategy.rank == 1:
        model.save(os.path.join(folder, "m.keras"))
        print("rank 1 saved", flush=True)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
