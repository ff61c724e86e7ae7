"""The dataset-graph fingerprint (integrations/keras/fit/dataset_agree.py): the same for datasets built alike (names
and per-process counters ignored), different for other data, seeds or batch sizes; unseeded shuffles flagged."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from torus.integrations.keras.fit.dataset_agree import fingerprint  # noqa: E402


def _rows(seed=0, n=40):
    return np.random.default_rng(seed).standard_normal((n, 3)).astype(np.float32)


def build(x, seed=5, batch=4):
    return tf.data.Dataset.from_tensor_slices(x).shuffle(len(x), seed=seed).map(lambda v: v * 2).batch(batch)


def test_same_construction_same_fingerprint_despite_counters():
    x = _rows()
    first = fingerprint(build(x))
    for _ in range(3):  # other datasets and functions traced in between move TF's name counters
        build(_rows(1)).reduce(np.float32(0), lambda a, b: a + tf.reduce_sum(b))
    assert fingerprint(build(x.copy())) == first
    assert first[1] is False


@pytest.mark.parametrize("change", ["one value", "shard", "seed", "batch", "map"])
def test_other_data_seed_or_ops_differ(change):
    x = _rows()
    base = fingerprint(build(x))[0]
    other = x.copy()
    if change == "one value":
        other[17, 2] += 1.0
        got = build(other)
    elif change == "shard":
        got = build(x[1::2])
    elif change == "seed":
        got = build(x, seed=6)
    elif change == "batch":
        got = build(x, batch=5)
    else:
        got = tf.data.Dataset.from_tensor_slices(x).shuffle(len(x), seed=5).map(lambda v: v * 3).batch(4)
    assert fingerprint(got)[0] != base


def test_unseeded_shuffle_is_flagged_and_seeded_is_not():
    x = _rows()
    assert fingerprint(tf.data.Dataset.from_tensor_slices(x).shuffle(8).batch(4))[1] is True
    assert fingerprint(tf.data.Dataset.from_tensor_slices(x).shuffle(8, seed=1).batch(4))[1] is False
    assert fingerprint(tf.data.Dataset.from_tensor_slices(x).batch(4))[1] is False
