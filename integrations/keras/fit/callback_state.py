"""The state of Keras' stateful training callbacks in a ``fit`` snapshot (fit/snapshots.py), so that a resumed
run stops, lowers its learning rate and keeps its best file as the run that lost nothing would.

Held, per callback of the ``fit`` call's list (named by its class and its place among the callbacks of that
class, so that another callback added or left out does not shift it): ``EarlyStopping``'s patience count,
stopped epoch, best value and epoch, and its best weights (``restore_best_weights``: arrays of the snapshot);
``ReduceLROnPlateau``'s patience and cooldown counts and best value (the learning rate itself is the
optimizer's, in the snapshot's variables); ``ModelCheckpoint``'s best value (``save_best_only``; a node's
writer that is not the chief holds a silenced one, whose best stays unset). Restored after those callbacks'
own ``on_train_begin``, which resets them. Other callbacks' state is not held (a user's own: docs/clusters.md,
"Snapshots").
"""
from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np

ATTRIBUTES = ((keras.callbacks.EarlyStopping, ("wait", "stopped_epoch", "best", "best_epoch")),
              (keras.callbacks.ReduceLROnPlateau, ("wait", "cooldown_counter", "best")),
              (keras.callbacks.ModelCheckpoint, ("best",)))
PREFIX = "callback"  # array names "callback:<name>.<k>": never a variable's (those are "0", "1", ...)


def _named(callbacks: list) -> list[tuple[str, Any, tuple]]:
    """``(name, callback, attributes)`` of the stateful ones: ``EarlyStopping#0``, ``ModelCheckpoint#1``..."""
    seen: dict = {}
    out = []
    for callback in callbacks:
        found = next(((cls.__name__, names) for cls, names in ATTRIBUTES if isinstance(callback, cls)), None)
        if found is not None:
            base, kept = found
            out.append((f"{base}#{seen.get(base, 0)}", callback, kept))
            seen[base] = seen.get(base, 0) + 1
    return out


def _number(value):
    """A JSON number (or None) for a counter or a monitored value (numpy scalars, infinities)."""
    if value is None:
        return None
    value = float(value)
    return int(value) if value.is_integer() and not math.isinf(value) else value


def capture(callbacks: list) -> tuple[dict, dict]:
    """``(meta, arrays)``: the attributes of each stateful callback of ``callbacks`` by name, and
    EarlyStopping's best weights as arrays named ``callback:<name>.<k>``."""
    meta: dict = {}
    arrays: dict = {}
    for name, callback, kept in _named(callbacks):
        state = {attr: _number(getattr(callback, attr, None)) for attr in kept}
        weights = getattr(callback, "best_weights", None)
        if weights is not None:
            state["best_weights"] = len(weights)
            arrays.update({f"{PREFIX}:{name}.{k}": np.array(w) for k, w in enumerate(weights)})
        meta[name] = state
    return meta, arrays


def restore(callbacks: list, meta: dict | None, arrays: dict) -> None:
    """Set the held state back on ``callbacks`` (after their ``on_train_begin``), each by its name; one the
    snapshot does not name keeps its fresh state."""
    for name, callback, kept in _named(callbacks):
        state = (meta or {}).get(name)
        if state is None or set(kept) - set(state):
            continue
        for attr in kept:
            setattr(callback, attr, state[attr])
        if "best_weights" in state:
            callback.best_weights = [np.array(arrays[f"{PREFIX}:{name}.{k}"]) for k in range(state["best_weights"])]
