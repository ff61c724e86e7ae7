"""Stress for the bucketed all-reduce (overlap on): many steps, each with a random bucket layout (tensor count,
shapes including empty ones, dtypes, bucket cap, algorithm, op), random per-rank values and ranks slowed at
random inside the graph (a sleep before some of their tensors exist), every result checked against numpy on
the all-gathered inputs. Integer-valued data, so float sums are exact whatever the order. After it: nothing
pending, one communication thread, the staging buffers bounded.

Runs at every rank count; across emulated hosts through the cluster suite (tests/cluster/suites.py).
"""
import threading
import time

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
from torus import TorusComm  # noqa: E402
from torus.integrations.keras import HostAllreduce, allreduce_tensors  # noqa: E402
from torus.integrations.keras.collectives.buckets import MAX_STAGING  # noqa: E402
from torus.runtime.progress import progress_for  # noqa: E402
from torus.select import ALGORITHMS  # noqa: E402

TRIALS = 10
THREADS: dict = {}
DTYPES = [np.float32, np.float64, np.int32, np.float32]


@pytest.fixture(scope="module")
def tc(world):
    return TorusComm(world)


def layout(rng):
    n = int(rng.integers(1, 9))
    shapes = [tuple(int(d) for d in rng.integers(0, 40, rng.integers(0, 3))) for _ in range(n)]
    dtypes = [DTYPES[i] for i in rng.integers(0, len(DTYPES), n)]
    return shapes, dtypes


@pytest.mark.parametrize("trial", range(TRIALS))
def test_random_layouts_and_slow_ranks_match_numpy(world, tc, trial):
    shared = np.random.default_rng(1000 + trial)  # the same on every rank: layout, cap, algorithm
    shapes, dtypes = layout(shared)
    algorithm = str(shared.choice(["auto", *(a for a in ALGORITHMS if a != "shm" or tc.topology.nodes == 1)]))
    op = str(shared.choice(["sum", "max", "min"]))
    host = HostAllreduce(tc, algorithm=algorithm, overlap=True, bucket_bytes=int(shared.integers(1, 600)))
    mine = np.random.default_rng([trial, world.rank])
    slow = [float(mine.random() * 0.05) if mine.random() < 0.3 else 0.0 for _ in shapes]

    def delayed(x, seconds):
        if not seconds:
            return x
        done = tf.numpy_function(lambda: time.sleep(seconds) or np.int8(0), [], tf.int8, stateful=True)
        with tf.control_dependencies([done]):
            return tf.identity(x)

    @tf.function
    def step(inputs):
        return allreduce_tensors(host, [delayed(x * 1, s) for x, s in zip(inputs, slow)], op)

    for round_ in range(3):  # the same traced layout again: staging buffers reused
        inputs = [mine.integers(-50, 50, s).astype(d) for s, d in zip(shapes, dtypes)]
        every = world.allgather(inputs)
        got = step([tf.constant(a) for a in inputs])
        for k, g in enumerate(got):
            want = getattr(np, op)(np.stack([e[k] for e in every]), axis=0)
            assert g.shape == shapes[k] and g.dtype == dtypes[k]
            np.testing.assert_array_equal(g.numpy(), want, err_msg=f"trial {trial} round {round_} tensor {k} "
                                          f"({algorithm}, {op}, cap {host.bucket_bytes})")
    assert not host.buckets._pending
    assert len(host.buckets._staging) <= MAX_STAGING
    threads = sum(t.name.startswith("torus-comm") for t in threading.enumerate())
    assert THREADS.setdefault("count", threads) == threads, "a communication thread more per trial"
    assert host.progress is progress_for(tc) and host.progress.started
