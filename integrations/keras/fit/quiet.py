"""Only the chief prints: what Horovod users write by hand (``verbose=1 if rank == 0 else 0``), done for them.

On every rank but rank 0, ``fit`` / ``evaluate`` / ``predict`` run with ``verbose=0`` (no progress bar), and
every callback of a Keras built-in class (defined in ``keras.callbacks``: ``ModelCheckpoint``,
``EarlyStopping``, ``ReduceLROnPlateau``, ``LearningRateScheduler``, ...) that has a ``verbose`` attribute gets
``verbose = 0`` (set on the instance, on that rank only). Since the logs are global (``metrics.py``), rank 0's
output is what every rank would have printed. User callbacks, subclasses included, are left alone (they may
print on purpose); so are Keras' unconditional messages (``TerminateOnNaN``) and Python warnings.
"""
from __future__ import annotations

import keras


def is_builtin(callback) -> bool:
    """Whether ``callback``'s class is Keras' own, seen through the subclasses torus swaps in (files.py)."""
    for cls in type(callback).__mro__:
        if not cls.__module__.startswith("torus."):
            return cls.__module__.startswith("keras.")
    return False


def quiet_other_ranks(call) -> None:
    """fit_hook stage "callbacks": ``verbose=0`` for the call and for Keras' built-in callbacks on every rank
    but the chief."""
    arguments = call.arguments
    if call.strategy.is_chief:
        return
    arguments["verbose"] = 0
    callbacks = arguments["callbacks"]
    members = callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else callbacks or []
    for callback in members:
        if is_builtin(callback) and hasattr(callback, "verbose"):
            callback.verbose = 0
