"""Horovod's two TF2 examples, as ported in integrations/keras/examples/ (the import line, and MNIST's data
source), run from their files under the current mpiexec with few steps: ``tensorflow2_mnist.py`` (its step
count cut from 10,000 to ``MNIST_STEPS``, the one edit made to its text here) and
``tensorflow2_synthetic_benchmark.py`` (made small by its own flags). Each must run at any rank count, end with
every rank holding the same weights and optimizer state, and its own train step, run once more on random data,
must do what one process computes without torus: the mean of every rank's gradient (each taken at the same
weights on that rank's batch), applied by the example's own optimizer."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hvd_common import assert_close, assert_identical_across_ranks, hvd, init_world, tf

EXAMPLES = Path(__file__).resolve().parents[2] / "integrations" / "keras" / "examples"
MNIST_STEPS = 120  # Horovod's 10000: each rank takes MNIST_STEPS // size() steps of 128 rows
BENCHMARK_FLAGS = ["--no-cuda", "--model", "MobileNet", "--batch-size", "2", "--num-warmup-batches", "1",
                   "--num-batches-per-iter", "1", "--num-iters", "2"]


@pytest.fixture(scope="module")
def hvd_world():
    return init_world()


def example(name, replace=()):
    """The compiled code of ``name``, with each (old, new) of ``replace`` made (old must occur exactly once)."""
    path = EXAMPLES / name
    text = path.read_text()
    for old, new in replace:
        assert text.count(old) == 1, f"{name} no longer holds {old!r} exactly once"
        text = text.replace(old, new)
    return compile(text, str(path), "exec"), str(path)


def main_locals(namespace):
    """Run the example's ``main()``; return its local variables as they were when it returned. Its first line,
    ``hvd.init()``, goes through a stand-in that keeps ``main``'s frame (every other name is the real hvd's)."""
    frames = []

    class Hvd:
        def __getattr__(self, name):
            return getattr(hvd, name)

        def init(self, *args, **kwargs):
            frames.append(sys._getframe(1))
            return hvd.init(*args, **kwargs)

    namespace["hvd"] = Hvd()
    namespace["main"]()
    return dict(frames[0].f_locals)


def state(variables):
    return [np.array(v.numpy()) for v in variables]


def restore(variables, values):
    for v, w in zip(variables, values):
        v.assign(w)


def one_process_step(world, model, optimizer, loss_of, variables, every_batch):
    """What the step should give, computed in this process with plain TensorFlow: each rank's gradient at the
    current weights (every variable, Keras' dropout seeds included, reset before each: every rank draws its
    dropout masks from the same seeds once the example broadcast them), their mean applied by ``optimizer``.
    Returns ``{id(variable): value after}``; leaves ``variables`` as they were."""
    before = state(variables)
    grads = []
    for batch in every_batch:
        restore(variables, before)
        with tf.GradientTape() as tape:
            loss = loss_of(model, *batch)
        grads.append(tape.gradient(loss, model.trainable_variables))
    optimizer.apply_gradients(zip([tf.add_n(list(g)) / len(g) for g in zip(*grads)], model.trainable_variables))
    after = {id(v): w for v, w in zip(variables, state(variables))}
    restore(variables, before)
    return after


def test_tensorflow2_mnist(hvd_world, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # rank 0 writes ./checkpoints-1.*
    code, path = example("tensorflow2_mnist.py",
                         [("dataset.take(10000 // hvd.size())", f"dataset.take({MNIST_STEPS} // hvd.size())")])
    namespace = {"__name__": "tensorflow2_mnist", "__file__": path}
    exec(code, namespace)
    found = main_locals(namespace)
    out = capsys.readouterr().out
    model, opt, step, loss = found["mnist_model"], found["opt"], found["training_step"], found["loss"]
    variables = model.variables + opt.variables  # seed states included: the example broadcasts them too
    assert_identical_across_ranks(hvd_world, state(variables), "model and optimizer after the example")
    if hvd.rank() == 0:
        losses = [float(line.split("Loss: ")[1]) for line in out.splitlines() if line.startswith("Step #")]
        assert len(losses) == -(-(MNIST_STEPS // hvd.size()) // 10), out
        assert losses[-1] < 0.9 * losses[0], losses
        assert (tmp_path / "checkpoints-1.index").exists()

    rng = np.random.default_rng([41, hvd.rank()])
    images = rng.random((128, 8, 8, 1), dtype=np.float32)
    labels = rng.integers(0, 10, 128)
    every = hvd_world.allgather((images, labels))
    want = one_process_step(hvd_world, model, opt, lambda m, x, y: loss(y, m(x, training=True)), variables, every)
    step(tf.constant(images), tf.constant(labels), False)
    got = state(variables)
    assert_identical_across_ranks(hvd_world, got, "one more step")
    assert_close(got, [want[id(v)] for v in variables], "one more step vs one process", tol=1e-5)


def test_tensorflow2_synthetic_benchmark(hvd_world, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))  # --no-cuda sets it
    monkeypatch.setattr(sys, "argv", ["tensorflow2_synthetic_benchmark.py", *BENCHMARK_FLAGS])
    code, path = example("tensorflow2_synthetic_benchmark.py")
    namespace = {"__name__": "__main__", "__file__": path}
    exec(code, namespace)
    out = capsys.readouterr().out
    model, opt, step = namespace["model"], namespace["opt"], namespace["benchmark_step"]
    if hvd.rank() == 0:
        assert f"Total img/sec on {hvd.size()} CPU(s)" in out, out
    # Batch-norm moving statistics stay each rank's own, as in Horovod: only trainable and optimizer state agree.
    shared = model.trainable_variables + opt.variables
    assert_identical_across_ranks(hvd_world, state(shared), "weights and optimizer after the benchmark")

    every = hvd_world.allgather((namespace["data"].numpy(), namespace["target"].numpy()))
    want = one_process_step(
        hvd_world, model, opt,
        lambda m, x, y: tf.losses.sparse_categorical_crossentropy(y, m(x, training=True)),
        model.variables + opt.variables, every)
    step(first_batch=False)
    got = state(shared)
    assert_identical_across_ranks(hvd_world, got, "one more benchmark step")
    assert_close(got, [want[id(v)] for v in shared], "one more benchmark step vs one process", tol=1e-5)
