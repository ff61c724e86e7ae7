"""The flight recorder in a live job (torus/recorder.py, issue 43; off by default, on here): every TorusComm call
is recorded in order with its operation, count, dtype and algorithm, the same sequence on every rank, capped at
the capacity; under ``fit`` with overlap the gradient buckets are recorded with their Keras step and bucket as
the caller. Runs at 2 to 4 ranks (one rank has nothing to compare).
"""
import numpy as np
import pytest
from mpi4py import MPI

import torus

if MPI.COMM_WORLD.Get_size() not in (2, 3, 4):
    pytest.skip("recorder tests run at 2, 3 and 4 ranks", allow_module_level=True)


@pytest.fixture(autouse=True)
def recorder_on(monkeypatch):
    monkeypatch.setenv("TORUS_RECORDER", "64")  # off by default (its cost: bench/flight_recorder/README.md)


def test_the_recorder_is_off_by_default(monkeypatch):
    monkeypatch.delenv("TORUS_RECORDER")
    tc = torus.TorusComm()
    tc.allreduce(np.ones(10))
    assert tc.recorder.capacity == 0 and tc.recorder.records() == [] and tc.recorder.state()["calls"] == 0
    tc.Free()


def test_calls_are_recorded_in_order_and_agree_across_ranks(world, rng):
    tc = torus.TorusComm()
    capacity = tc.recorder.capacity
    calls = []
    sizes = world.bcast(rng.integers(1, 5000, capacity + 7).tolist())
    for i, n in enumerate(sizes):
        dtype = (np.float32, np.float64, np.int32)[i % 3]
        if i % 2:
            tc.allreduce(np.ones(n, dtype))
            calls.append(("allreduce", n, np.dtype(dtype).name))
        else:
            tc.allgather(np.ones(n, dtype))
            calls.append(("allgather", n * tc.size, np.dtype(dtype).name))
    held = tc.recorder.records()
    assert len(held) == capacity and tc.recorder.state()["calls"] == len(calls)
    assert [h["seq"] for h in held] == list(range(len(calls) - capacity + 1, len(calls) + 1))
    assert [(h["op"], h["count"], h["dtype"]) for h in held] == calls[-capacity:]
    assert all(h["state"] == "done" and h["caller"] == "user" and h["end"] >= h["start"] for h in held)
    mine = [(h["seq"], h["op"], h["count"], h["dtype"], h["algorithm"]) for h in held]
    assert all(other == mine for other in world.allgather(mine))
    assert len(set(world.allgather(tc.recorder.comm_id))) == 1
    tc.Free()


def test_keras_buckets_are_recorded_with_their_step(world):
    keras = pytest.importorskip("keras")
    from torus.integrations.keras import TorusStrategy

    strategy = TorusStrategy(overlap=True, bucket_bytes=256)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(9, activation="tanh"),
                                  keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=False)
    x = np.random.default_rng(0).standard_normal((36, 6)).astype("float32")
    model.fit(x, x[:, :3], batch_size=12, epochs=1, shuffle=False, verbose=0)  # 3 steps
    held = strategy.host.torus_comm.recorder.records()
    buckets = [h["caller"] for h in held if h["caller"].startswith("keras step ")]
    steps = {int(c.split()[2]) for c in buckets}
    assert steps and max(steps) == strategy.host.buckets.steps >= 3, buckets
    assert any(c.startswith(f"keras step {max(steps)} gradient bucket 1 ") for c in buckets), buckets
    assert world.allgather(buckets) == [buckets] * world.size


def test_a_bucket_layout_that_differs_is_recorded_and_the_doctor_names_the_rank(world):
    tf = pytest.importorskip("tensorflow")
    from torus import doctor
    from torus.integrations.keras import TorusStrategy, allreduce_tensors

    strategy = TorusStrategy(overlap=True, bucket_bytes=256)
    host, last = strategy.host, world.size - 1
    reduce = tf.function(lambda ts: allreduce_tensors(host, ts, "sum"))
    got = reduce([tf.ones(100), tf.ones(70)])  # one agreed layout, its buckets reduced
    np.testing.assert_array_equal(got[0].numpy(), np.full(100, world.size, np.float32))
    n = 30 + (world.rank == last)  # a new layout, one element longer on the last rank
    with pytest.raises(tf.errors.OpError, match=rf"MismatchError: .* rank {last} bucket the gradients differently"):
        reduce([tf.ones(n), tf.ones(40)])
    state = host.torus_comm.recorder.state()
    agreements = [h for h in state["records"] if h["op"] == "bucket layout agreement"]
    assert [(h["count"], h["dtype"], h["state"]) for h in agreements] == \
        [(170, "float32", "done"), (70 + (world.rank == last), "float32", "failed")], agreements
    assert agreements[-1]["caller"] == f"keras step {host.buckets.steps + 1} gradient bucket layout 1"
    assert "MismatchError" in agreements[-1]["error"]
    dumps = [{"time": 0.0, "communicators": [s]} for s in world.allgather(state)]
    lines = doctor.diagnose(dumps, state["comm_id"])
    seq = agreements[-1]["seq"]
    others = "rank 0" if last == 1 else f"ranks {', '.join(map(str, range(last)))}"
    assert f"  the ranks part at call #{seq}: they called different collectives:" in lines, lines
    assert any(line.startswith(f"  - {others}: bucket layout agreement of 70 float32") for line in lines), lines
    assert any(line.startswith(f"  - rank {last}: bucket layout agreement of 71 float32") for line in lines), lines
