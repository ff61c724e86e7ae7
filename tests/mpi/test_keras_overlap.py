"""Overlap on (gradient buckets all-reduced on the communication thread during backprop) trains as overlap off:
each step's weights bitwise equal across ranks and within float tolerance of the same fit with overlap off,
for the features whose gradient path it touches; the bucket layout is agreed (``MismatchError`` naming the
ranks, not a hang); the timeline is one valid JSON trace with every rank's buckets.

Small buckets (``bucket_bytes=256``) so that every model here is several buckets; each case also checks that
the bucketed path ran (``buckets_run`` grew by at least two buckets per step). Runs at 2, 3 and 4 ranks.
"""
import json
import os

import numpy as np
import pytest
from mpi4py import MPI

if MPI.COMM_WORLD.Get_size() not in (2, 3, 4):
    pytest.skip("overlap tests run at 2, 3 and 4 ranks", allow_module_level=True)

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from kerasref import Record, assert_identical_across_ranks, assert_steps_match, data, initial_weights  # noqa: E402

from torus.errors import MismatchError  # noqa: E402
from torus.integrations.keras import TorusStrategy, allreduce_tensors  # noqa: E402

STEPS = 4
CAP = 256


@pytest.fixture(scope="module")
def strategies():
    return {c: TorusStrategy(compression=c, overlap=True, bucket_bytes=CAP) for c in ("none", "fp16")}


def model_fn(kind: str):
    layers = [keras.Input((6,)), keras.layers.Dense(9, activation="tanh")]
    if kind == "syncbn":
        layers.append(keras.layers.BatchNormalization(synchronized=True))
    layers += [keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)]
    return (StepModel if kind == "train_step" else keras.Sequential)(layers)


class StepModel(keras.Sequential):
    """A custom ``train_step`` as the keras.io guide writes it."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        for m in self.metrics:
            m.update_state(loss) if m.name == "loss" else m.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


CASES = {
    "plain": {},
    "fp16": {"compression": "fp16"},
    "mixed_float16": {"policy": "mixed_float16"},
    "accumulation": {"optimizer": {"gradient_accumulation_steps": 2}},
    "steps_per_execution": {"compile": {"steps_per_execution": 3}},
    "syncbn": {"model": "syncbn"},
    "train_step": {"model": "train_step"},
    "clipnorm": {"optimizer": {"global_clipnorm": 0.1}},
}


def fit(strategy, case: dict, w0, x, y, overlap: bool):
    strategy.host.overlap = overlap
    with strategy.scope():
        model = model_fn(case.get("model", "plain"))
        model.compile(keras.optimizers.SGD(0.2, momentum=0.5, **case.get("optimizer", {})),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                      **case.get("compile", {}))
    model.set_weights(w0)
    rec = Record()
    before = strategy.host.buckets.buckets_run
    history = model.fit(x, y, batch_size=4 * strategy.size, epochs=2, shuffle=False, verbose=0, callbacks=[rec])
    return rec.steps, history.history, strategy.host.buckets.buckets_run - before


@pytest.mark.parametrize("name", list(CASES))
def test_overlap_on_trains_as_overlap_off(world, strategies, name):
    case = CASES[name]
    strategy = strategies[case.get("compression", "none")]
    if "policy" in case:
        keras.mixed_precision.set_global_policy(case["policy"])
    try:
        x, y = data(seed=5, n=4 * strategy.size * STEPS)
        w0 = initial_weights(model_fn(case.get("model", "plain")), seed=6)
        off, off_logs, off_buckets = fit(strategy, case, w0, x, y, overlap=False)
        on, on_logs, on_buckets = fit(strategy, case, w0, x, y, overlap=True)
    finally:
        keras.mixed_precision.set_global_policy("float32")
        strategy.host.overlap = True
    assert off_buckets == 0
    applies = 2 * STEPS // case.get("optimizer", {}).get("gradient_accumulation_steps", 1)
    assert on_buckets >= 2 * applies, f"{name}: {on_buckets} buckets for {applies} all-reduces"
    atol = 2e-3 if "policy" in case or "compression" in case else 1e-5
    assert_steps_match(world, on, off, atol=atol, what=f"{name}: overlap on against off, step")
    for key in off_logs:
        np.testing.assert_allclose(np.array(keras.tree.flatten(on_logs[key]), float),
                                   np.array(keras.tree.flatten(off_logs[key]), float), rtol=atol, atol=atol,
                                   err_msg=f"{name}: {key}")
    if name != "train_step":  # the guide's train_step returns rank-local logs (issue 22), with or without overlap
        assert_identical_across_ranks(world, [np.array(v) for v in on_logs.values()], f"{name}: logs")


def test_custom_loop_strategy_run_and_allreduce_tensors(world, strategies):
    strategy = strategies["none"]
    rng = np.random.default_rng(world.rank)
    shapes = [(3, 5), (7,), (0,), (2, 2, 2), (130,), ()]
    dtypes = [tf.float32, tf.float64, tf.float32, tf.int32, tf.float32, tf.float64]
    mine = [rng.integers(-9, 9, s).astype(d.as_numpy_dtype) for s, d in zip(shapes, dtypes)]
    every = world.allgather(mine)
    reduce = tf.function(lambda ts: allreduce_tensors(strategy.host, ts, "sum"))
    before = strategy.host.buckets.buckets_run
    got = reduce([tf.constant(a) for a in mine])
    assert strategy.host.buckets.buckets_run - before >= 3
    for k, g in enumerate(got):
        want = np.sum([e[k] for e in every], axis=0)
        assert g.dtype == dtypes[k] and g.shape == shapes[k]
        np.testing.assert_array_equal(g.numpy(), want)

    with strategy.scope():
        model = model_fn("plain")
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    model.set_weights(initial_weights(model, seed=8))
    x, y = data(seed=9, n=4 * strategy.size)
    rows = slice(4 * world.rank, 4 * world.rank + 4)

    @tf.function
    def step(xb, yb):
        def replica(xb, yb):
            with tf.GradientTape() as tape:  # MirroredStrategy's rule: the optimizer sums over ranks
                per_row = keras.losses.sparse_categorical_crossentropy(yb, model(xb), from_logits=True)
                loss = tf.nn.compute_average_loss(per_row, global_batch_size=4 * strategy.size)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        strategy.run(replica, args=(xb, yb))

    ref = model_fn("plain")
    ref.set_weights(model.get_weights())
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, ref(x), from_logits=True))
    grads = tape.gradient(loss, ref.trainable_variables)
    want = [w - 0.1 * g.numpy() for w, g in zip(ref.get_weights(), grads)]
    before = strategy.host.buckets.buckets_run
    step(tf.constant(x[rows]), tf.constant(y[rows]))
    assert strategy.host.buckets.buckets_run - before >= 2
    assert_identical_across_ranks(world, model.get_weights(), "custom loop")
    for g, w in zip(model.get_weights(), want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_layout_mismatch_names_the_ranks(world, strategies):
    host = strategies["none"].host
    n = 100 + (world.rank == world.size - 1)  # the last rank's tensor has one more element
    reduce = tf.function(lambda ts: allreduce_tensors(host, ts, "sum"))
    last = world.size - 1
    with pytest.raises(tf.errors.OpError, match=rf"MismatchError: allreduce of gradient buckets on rank "
                       rf"{world.rank}: rank {last} bucket the gradients differently .*rank {last}: 2 buckets "
                       r"\(float32\[70\], float32\[101\]\)"):
        reduce([tf.ones(n), tf.ones(70)])
    got = reduce([tf.ones(100), tf.ones(70)])  # the thread keeps working after the error
    np.testing.assert_array_equal(got[0].numpy(), np.full(100, world.size, np.float32))


@pytest.mark.parametrize("differs", ["overlap", "compression", "algorithm"])
def test_settings_that_differ_across_ranks_are_refused_at_construction(world, differs):
    # overlap on one rank only made an extra collective (the replica communicator's Dup) there: a hang
    last = world.size - 1
    odd = world.rank == last
    kwargs = {"overlap": not odd if differs == "overlap" else True,
              "compression": "fp16" if differs == "compression" and odd else "none",
              "algorithm": "ring" if differs == "algorithm" and odd else "auto"}
    with pytest.raises(MismatchError, match=rf"TorusStrategy on rank {world.rank}: rank {last} constructed it with "
                       rf"other settings than rank 0 \(rank 0: overlap=True.*; rank {last}: .*{differs}="):
        TorusStrategy(**kwargs)
    assert TorusStrategy(overlap=True).host.overlap  # the ranks still agree afterwards


def test_timeline_is_one_trace_with_every_rank(world, tmp_path_factory):
    path = world.bcast(str(tmp_path_factory.mktemp("tl") / "trace.json") if world.rank == 0 else None)
    os.environ["TORUS_TIMELINE"] = path
    try:
        strategy = TorusStrategy(overlap=True, bucket_bytes=CAP)
    finally:
        del os.environ["TORUS_TIMELINE"]
    x, y = data(seed=3, n=4 * strategy.size * STEPS)
    with strategy.scope():
        model = model_fn("plain")
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=4 * strategy.size, epochs=1, verbose=0)
    if world.rank == 0:
        with open(path) as f:
            trace = json.load(f)
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        for rank in range(world.size):
            mine = [e for e in spans if e["pid"] == rank]
            names = {e["name"].split()[-1] for e in mine if "bucket" in e["name"]}
            assert names == {"start", "allreduce", "wait"}, f"rank {rank}: {names}"
            assert sum(e["name"] == "train step" for e in mine) == STEPS
            assert any(e["name"] == "metric allreduce" for e in mine)
            comm = [e for e in mine if e["name"].endswith("allreduce") and "bucket" in e["name"]]
            assert all(e["args"]["nbytes"] > 0 and e["args"]["algorithm"] != "auto" for e in comm)
    world.Barrier()


def ancestors(op) -> set:
    """Every op ``op`` waits for in its graph: through data and control inputs."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def test_syncbn_backward_allreduce_does_not_gate_the_first_bucket(world):
    # Stateful ops run in program order inside a tf.function: were the bucket starts stateful, or on the host
    # SyncBN all-reduces with, the first start would wait for SyncBN's backward all-reduces, which backprop
    # reaches only after the last layer's gradients exist, and nothing would overlap.
    strategy = TorusStrategy(overlap=True, bucket_bytes=64)  # the first bucket: only the last Dense's gradients
    if not strategy.host.replica_apart:
        pytest.skip("MPI did not grant MPI_THREAD_MULTIPLE: SyncBN's all-reduces share the buckets' TorusComm")
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(9),
                                  keras.layers.BatchNormalization(synchronized=True), keras.layers.Dense(7),
                                  keras.layers.BatchNormalization(synchronized=True), keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    outputs = []

    @tf.function
    def step(xb, yb):
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                logits = model(xb, training=True)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True))
            outputs.append(logits)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        strategy.run(replica, args=(xb, yb))

    graph = step.get_concrete_function(tf.TensorSpec([4, 6]), tf.TensorSpec([4], tf.int32)).graph
    ops = graph.get_operations()
    reduces = {op for op in ops if op.name.split("/")[-1].startswith("torus_allreduce")}
    forward = reduces & ancestors(outputs[-1].op)
    assert len(forward) == 6 and len(reduces) > len(forward), (len(forward), len(reduces))  # 3 per layer
    start = next(op for op in ops if op.name.endswith("torus_bucket0_start"))
    assert len(start.inputs) == 2  # the last Dense's kernel and bias gradients
    gating = sorted(op.name for op in (ancestors(start) & reduces) - forward)
    assert not gating, f"the first bucket's start waits for SyncBN's backward all-reduces {gating}"
