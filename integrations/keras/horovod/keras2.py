"""Keras 2 spellings that Horovod's TF2 examples use and Keras 3 changed, accepted again.

Horovod's ``tensorflow2_mnist.py`` and ``tensorflow2_synthetic_benchmark.py`` call ``opt.variables()``: in
Keras 2 (``tf.keras`` before TensorFlow 2.16) ``Optimizer.variables`` was a method, in Keras 3 it is a property
that returns a list, so the call raises ``TypeError: 'list' object is not callable`` before any Horovod code
runs. ``install()`` (run when ``torus.integrations.keras.horovod`` is imported) makes the property return a
``CallableList``: a ``list`` (a copy, as before) that returns itself when called, so ``opt.variables`` and
``opt.variables()`` both give the optimizer's variables. Patched through ``compat.patch`` (once per process) on
``keras.optimizers.Optimizer`` and on each of its subclasses loaded at that time that defines its own
``variables`` property (``LossScaleOptimizer``); optimizers are otherwise unchanged.
"""
from __future__ import annotations

import keras

from torus.integrations.keras import compat


class CallableList(list):
    """A list that returns itself when called: Keras 3's ``opt.variables`` and Keras 2's ``opt.variables()``."""

    def __call__(self):
        return self


class _Property(property):
    """A ``property`` that takes attributes (``compat.patch`` marks its wrappers)."""


def _callable_result(prop: property) -> property:
    fget = prop.fget

    def variables(self):
        return CallableList(fget(self))

    return _Property(variables, prop.fset, prop.fdel, prop.__doc__)


def _classes_with_own_property(root: type) -> list[type]:
    found: list[type] = [root]
    todo: list[type] = list(root.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if isinstance(cls.__dict__.get("variables"), property) and cls not in found:
            found.append(cls)
    return found


def install() -> None:
    """Make ``variables`` of Keras 3 optimizers callable too (module docstring); idempotent."""
    for cls in _classes_with_own_property(keras.optimizers.Optimizer):
        if isinstance(getattr(cls, "variables", None), property):
            compat.patch(cls, "variables", _callable_result)
