"""Per-rank ``tf.data`` datasets that are not marked per rank (Horovod's habit: built from a hand shard, or
shuffled with a per-rank seed) are refused on every rank before any step, naming the fix; global datasets built
alike on every rank (seeded reshuffles included: nothing is peeked) train as one process on the global batch;
a global dataset shuffled without a seed gets a warning on the chief. Runs at 1, 2 and 3 ranks."""
import warnings

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (1, 2, 3):
    pytest.skip("Keras tests run at 1, 2 and 3 ranks only", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
from kerasref import B, assert_identical_across_ranks, data, small_model  # noqa: E402

from torus.errors import MismatchError  # noqa: E402
from torus.integrations.keras import TorusStrategy  # noqa: E402
from torus.integrations.keras.fit import fit_hook  # noqa: E402
from torus.integrations.keras.fit.inputs import per_rank  # noqa: E402


@pytest.fixture(scope="module")
def strategy():
    return TorusStrategy()


def _rows(n=8 * B, seed=21):
    x, y = data(seed, n, features=5)
    return x, y


def _refused(world, strategy, make_dataset, fragment):
    model, fresh = small_model(strategy), small_model()
    if strategy.size == 1:
        model.fit(make_dataset(), epochs=1, verbose=0)  # nothing to compare at one rank: it trains
        return
    with pytest.raises(MismatchError, match=fragment) as caught:
        model.fit(make_dataset(), epochs=1, verbose=0)
    said = str(caught.value)
    assert said.startswith(f"TorusStrategy fit on rank {strategy.rank}: the ranks passed different x datasets")
    assert "strategy.shard(dataset)" in said, said
    every = world.allgather(said.split(": ", 1)[1])
    assert all(s == every[0] for s in every), "the message differs between ranks"
    for got, want in zip(model.get_weights(), fresh.get_weights()):
        np.testing.assert_array_equal(got, want)  # no step ran


def test_hand_sharded_dataset_is_refused(world, strategy):
    x, y = _rows()
    rank, size = strategy.rank, strategy.size
    _refused(world, strategy, lambda: tf.data.Dataset.from_tensor_slices((x[rank::size], y[rank::size]))
             .batch(B // size), r"graph 0x")


def test_per_rank_seed_is_refused(world, strategy):
    x, y = _rows()
    _refused(world, strategy, lambda: tf.data.Dataset.from_tensor_slices((x, y))
             .shuffle(len(x), seed=100 + strategy.rank).batch(B), r"graph 0x.* on rank 0")


def test_marked_per_rank_dataset_trains_as_its_global_batches(world, strategy):
    """The same hand shard, marked: each rank's batch of B / N is its share; one process on the concatenation."""
    x, y = _rows()
    rank, size, b = strategy.rank, strategy.size, B // strategy.size
    model = small_model(strategy)
    model.fit(per_rank(tf.data.Dataset.from_tensor_slices((x[rank::size], y[rank::size])).batch(b)), epochs=1,
              verbose=0)
    order = np.array([r + size * (k * b + j) for k in range(len(x) // B) for r in range(size) for j in range(b)])
    ref = small_model()
    with fit_hook.local():
        ref.fit(x[order], y[order], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_identical_across_ranks(world, model.get_weights(), "marked per-rank dataset")
    for g, w in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_seeded_reshuffle_trains_as_one_process(world, strategy):
    """A global dataset reshuffled every epoch with a seed, built alike on every rank: not refused, and since
    the check runs nothing, each epoch's order is the one a single process sees."""
    x, y = _rows(seed=22)

    def make():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=7).batch(B)
    model = small_model(strategy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.fit(make(), epochs=3, shuffle=False, verbose=0)
    assert not [w for w in seen if "shuffles without a seed" in str(w.message)]
    ref = small_model()
    with fit_hook.local():
        ref.fit(make(), epochs=3, shuffle=False, verbose=0)
    assert_identical_across_ranks(world, model.get_weights(), "seeded reshuffle")
    for g, w in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_unseeded_shuffle_warns_on_the_chief(world, strategy):
    x, y = _rows(seed=23)
    model = small_model(strategy)
    tf.random.set_seed(None)  # small_model's global seed would give the shuffle a seed derived from it
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).batch(B), epochs=1, verbose=0)
    said = [str(w.message) for w in seen if "shuffles without a seed" in str(w.message)]
    want = 1 if strategy.size > 1 and strategy.is_chief else 0
    assert len(said) == want, said
    if said:
        assert "shuffle(..., seed=S)" in said[0]


def test_validation_dataset_built_per_rank_is_refused(world, strategy):
    if strategy.size == 1:
        pytest.skip("nothing to compare at one rank")
    x, y = _rows(seed=24)
    rank, size = strategy.rank, strategy.size
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    validation = tf.data.Dataset.from_tensor_slices((x[rank::size], y[rank::size])).batch(B)
    with pytest.raises(MismatchError, match="different validation_data datasets"):
        small_model(strategy).fit(train, validation_data=validation, epochs=1, verbose=0)


def test_evaluate_and_predict_check_too(world, strategy):
    if strategy.size == 1:
        pytest.skip("nothing to compare at one rank")
    x, y = _rows(seed=25)
    rank, size = strategy.rank, strategy.size
    model = small_model(strategy)
    with pytest.raises(MismatchError, match="TorusStrategy evaluate on rank .*different x datasets"):
        model.evaluate(tf.data.Dataset.from_tensor_slices((x[rank::size], y[rank::size])).batch(B), verbose=0)
    with pytest.raises(MismatchError, match="TorusStrategy predict on rank .*different x datasets"):
        model.predict(tf.data.Dataset.from_tensor_slices(x[rank::size]).batch(B), verbose=0)
