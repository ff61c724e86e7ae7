"""Code that one rank runs while the others do not: rank 0 writing a file (``model.save``, ``ModelCheckpoint``,
``BackupAndRestore``), called on every rank or under ``if strategy.is_chief:``.

Inside :func:`rank_alone`:

- **variables are created as in one process.** Keras creates variables inside a save (Keras 3.15 builds a
  reference ``Optimizer(1.0)`` to know which attributes to skip), under the user's ``strategy.scope()``. The
  strategy's variable creator would make each one a collective (rank 0's initial value, ``creation.py``) that
  the other ranks never join: it waited for the stall timeout, then blamed the user. Here the creator leaves
  them alone (:func:`active`).
- **the process' global random states come back as they were**: numpy's (``np.random``), Python's
  (``random``), TensorFlow's (the eager op-seed counter behind ``tf.random.set_seed``, and
  ``tf.random.get_global_generator()``) and Keras' global seed generator. A draw made on one rank alone would
  split them across ranks, and every later draw (the user's next data, a layer's initializer, fit's agreed
  shuffle seed) would differ per rank; ranks that were equal before stay equal.

Nested blocks are fine; the outermost one restores. Not thread-safe (a save runs on the training thread).
"""
from __future__ import annotations

import contextlib
import random

import numpy as np

from torus.integrations.keras import compat

_depth = [0]
_SALT = 0x746F72757321  # the side stream's seed differs from anything the main stream draws


def active() -> bool:
    """True inside :func:`rank_alone`: the variable creator does not broadcast (``creation.py``)."""
    return _depth[0] > 0


def _enter() -> tuple:
    eager = compat.eager_op_seeds()
    if eager is not None:
        # Not saved and restored but set aside: TF caches an eager random kernel per op seed and its state
        # moves on, so an op seed drawn here and drawn again later would give rank 0 another value there.
        # Inside, op seeds come from a stream of their own.
        before = eager.getstate()
        compat.set_eager_op_seeds(random.Random(eager.getrandbits(64) ^ _SALT))
        eager.setstate(before)
    tf_generator, keras_generator = compat.tf_global_generator(), compat.keras_global_seed_generator()
    return (np.random.get_state(), random.getstate(), eager,
            tf_generator, None if tf_generator is None else tf_generator.state.numpy(),
            keras_generator, None if keras_generator is None else keras_generator.state.numpy())


def _leave(states: tuple) -> None:
    numpy_state, python_state, eager, tf_generator, tf_state, keras_generator, keras_state = states
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    if eager is not None:
        compat.set_eager_op_seeds(eager)
    compat.set_tf_global_generator(tf_generator)  # one made alone is dropped: the others have none
    if tf_generator is not None:
        tf_generator.state.assign(tf_state)
    compat.set_keras_global_seed_generator(keras_generator)
    if keras_generator is not None:
        keras_generator.state.assign(keras_state)


@contextlib.contextmanager
def rank_alone():
    """The block runs on this rank alone (see the module docstring)."""
    states = _enter() if _depth[0] == 0 else None
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1
        if states is not None:
            _leave(states)
