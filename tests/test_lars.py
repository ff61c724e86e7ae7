"""LARS against a numpy transcription of You, Gitman, Ginsburg 2017 (arXiv:1708.03888), Algorithm 1."""
import copy

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras  # noqa: E402

from torus.integrations.keras import LARS  # noqa: E402


def reference(w, grads, lr, m, eta, beta, eps, nesterov, adapt, decay):
    """Numpy LARS over a sequence of gradients; float64 accumulations of float32 inputs."""
    w, v = w.astype(np.float64), np.zeros(w.shape)
    beta = beta if decay else 0.0
    lrs = lr if isinstance(lr, list) else [lr] * len(grads)
    for g, lr in zip(grads, lrs):
        g = g.astype(np.float64)
        wn, gn = np.linalg.norm(w), np.linalg.norm(g)
        ratio = eta * wn / (gn + beta * wn + eps) if adapt and wn > 0 and gn > 0 else 1.0
        step = lr * ratio * (g + beta * w)
        v = m * v + step
        w = w - (m * v + step if nesterov else v)
    return w


def run(opt, init, grads):
    """Apply ``grads`` (list over steps of {name: array}) to fresh variables; return their final values."""
    vs = {k: keras.Variable(a, name=k) for k, a in init.items()}
    for step in grads:
        opt.apply_gradients([(tf.constant(step[k]), vs[k]) for k in init])
    return {k: v.numpy() for k, v in vs.items()}


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("zero", ["none", "weights", "grads"])
def test_matches_reference(rng, nesterov, zero):
    shapes = {"kernel": (7, 5), "bias": (5,), "conv": (3, 3, 2, 4), "bn_scale": (4, 4)}
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    if zero == "weights":
        init["kernel"][:] = 0
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(4)]
    if zero == "grads":
        grads[0]["kernel"][:] = 0
        grads[2]["conv"][:] = 0
    hp = dict(lr=0.7, m=0.9, eta=0.02, beta=5e-3, eps=1e-6)
    opt = LARS(learning_rate=hp["lr"], momentum=hp["m"], trust_coefficient=hp["eta"], weight_decay=hp["beta"],
               epsilon=hp["eps"], nesterov=nesterov)
    got = run(opt, init, grads)
    for k in shapes:
        excluded = k in ("bias", "bn_scale")  # rank 1; name matches "bn"
        want = reference(init[k], [g[k] for g in grads], nesterov=nesterov, adapt=not excluded,
                         decay=not excluded, **hp)
        assert np.all(np.isfinite(got[k])), k
        np.testing.assert_allclose(got[k], want, rtol=2e-5, atol=2e-6, err_msg=k)


def test_separate_exclusion_lists(rng):
    shapes = {"kernel": (6, 3), "other": (6, 3), "bias": (3,)}
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(3)]
    hp = dict(lr=0.5, m=0.8, eta=0.01, beta=0.1, eps=0.0)
    opt = LARS(learning_rate=hp["lr"], momentum=hp["m"], trust_coefficient=hp["eta"], weight_decay=hp["beta"],
               epsilon=0.0, exclude_from_weight_decay=["kernel"], exclude_from_layer_adaptation=["other"])
    got = run(opt, init, grads)
    flags = {"kernel": (True, False), "other": (False, True), "bias": (True, True)}  # explicit lists only
    for k, (adapt, decay) in flags.items():
        want = reference(init[k], [g[k] for g in grads], nesterov=False, adapt=adapt, decay=decay, **hp)
        np.testing.assert_allclose(got[k], want, rtol=2e-5, atol=2e-6, err_msg=k)


def test_sparse_gradient_equals_dense(rng):
    init = rng.standard_normal((6, 3)).astype(np.float32)
    values = rng.standard_normal((4, 3)).astype(np.float32)
    sparse = tf.IndexedSlices(tf.constant(values), tf.constant([0, 2, 0, 5]), tf.constant([6, 3]))
    dense = tf.convert_to_tensor(sparse)  # rows 0 summed twice
    got = []
    for g in (sparse, dense):
        v = keras.Variable(init, name="embeddings")
        LARS(learning_rate=1.0, trust_coefficient=0.1).apply_gradients([(g, v)])
        got.append(v.numpy())
    want = reference(init, [dense.numpy()], lr=1.0, m=0.9, eta=0.1, beta=0.0, eps=1e-6, nesterov=False,
                     adapt=True, decay=True)
    np.testing.assert_allclose(got[0], want, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(got[0], got[1])


def test_learning_rate_schedule(rng):
    init = {"kernel": rng.standard_normal((5, 4)).astype(np.float32)}
    grads = [{"kernel": rng.standard_normal((5, 4)).astype(np.float32)} for _ in range(4)]
    schedule = keras.optimizers.schedules.ExponentialDecay(0.8, decay_steps=1, decay_rate=0.5)
    got = run(LARS(learning_rate=schedule, trust_coefficient=0.05), init, grads)
    want = reference(init["kernel"], [g["kernel"] for g in grads], lr=[0.8 * 0.5 ** t for t in range(4)],
                     m=0.9, eta=0.05, beta=0.0, eps=1e-6, nesterov=False, adapt=True, decay=True)
    np.testing.assert_allclose(got["kernel"], want, rtol=2e-5, atol=2e-6)


def test_zero_everything_stays_finite():
    opt = LARS(learning_rate=1.0, epsilon=0.0)
    got = run(opt, {"kernel": np.zeros((3, 3), np.float32)}, [{"kernel": np.zeros((3, 3), np.float32)}] * 2)
    assert np.array_equal(got["kernel"], np.zeros((3, 3), np.float32))


def test_config_round_trip():
    schedule = keras.optimizers.schedules.PolynomialDecay(2.0, 100, end_learning_rate=0.0, power=2.0)
    opt = LARS(learning_rate=schedule, momentum=0.8, trust_coefficient=0.01, weight_decay=1e-4, epsilon=1e-7,
               nesterov=True, exclude_from_weight_decay=["x"], exclude_from_layer_adaptation=["y", "z"],
               clipnorm=1.0)
    config = opt.get_config()
    back = LARS.from_config(copy.deepcopy(config))  # Keras deserializes the schedule in place
    assert back.get_config() == config
    assert config["weight_decay"] == 1e-4 and back.weight_decay is None  # never Keras' decoupled decay
    assert config["learning_rate"]["class_name"] == "PolynomialDecay"
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is LARS and again.get_config() == config


def _model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.BatchNormalization(), keras.layers.Dense(3)])


def test_save_load_model_keeps_state(tmp_path, rng):
    x = rng.standard_normal((32, 6)).astype(np.float32)
    y = rng.integers(0, 3, 32)
    model = _model(1)
    model.compile(LARS(learning_rate=0.5, trust_coefficient=0.01, weight_decay=1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, LARS)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_jit_compile_matches_eager_path(rng):
    x = rng.standard_normal((32, 6)).astype(np.float32)
    y = rng.integers(0, 3, 32)
    weights = []
    for jit in (False, True):
        model = _model(2)
        model.compile(LARS(learning_rate=0.5, trust_coefficient=0.01, weight_decay=1e-3, nesterov=True),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        weights.append([np.asarray(w) for w in model.weights])
    for a, b in zip(*weights):
        assert np.all(np.isfinite(b))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
