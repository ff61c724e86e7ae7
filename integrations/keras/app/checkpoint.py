"""Atomic per-epoch checkpoints of a Keras model, its optimizer and the training state, written by rank 0.

One checkpoint is one file ``<dir>/checkpoint-<epoch>.npz`` (``epoch`` = epochs completed, 6 digits): the
model's weights (trainable and not, so batch-norm moving statistics too), the optimizer's variables (step
counter and slots such as momentum) and a JSON ``state`` (epoch, batch-size schedule, learning-rate rule,
seed, history; whatever the caller passes). It is written to a hidden temporary file in the same folder,
flushed and fsynced, then published with ``os.replace``, so a reader sees either the old set of
checkpoints or the old set plus one complete new file: killing the writer at any moment leaves the last
complete checkpoint readable. The newest ``keep`` checkpoints are kept.

``TORUS_CHECKPOINT_SLEEP=<seconds>@<epoch>`` makes the writer of that epoch's checkpoint pause halfway
through writing the temporary file (a hook for tests that kill a run mid-write). Temporary files left by a
killed writer are removed by the next successful save.
"""
from __future__ import annotations

import io
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from torus import knobs

_NAME = re.compile(r"^checkpoint-(\d{6})\.npz$")


def _paths(variables) -> list[str]:
    return [getattr(v, "path", None) or v.name for v in variables]


def save(directory: str | Path, epoch: int, model, state: dict, *, keep: int = 2) -> Path:
    """Write the checkpoint for ``epoch`` completed epochs; return its path.

    ``state`` must be JSON-serialisable. Call on one rank only (rank 0). Raises ``OSError`` when the folder
    cannot be written (the previous checkpoints stay intact).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = {f"w{i}": np.asarray(v.numpy()) for i, v in enumerate(model.weights)}
    opt_vars = model.optimizer.variables if model.optimizer is not None else []
    arrays.update({f"o{i}": np.asarray(v.numpy()) for i, v in enumerate(opt_vars)})
    meta = {"state": state, "weights": _paths(model.weights), "optimizer": _paths(opt_vars)}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    blob = buffer.getbuffer()
    final = directory / f"checkpoint-{epoch:06d}.npz"
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        half = len(blob) // 2
        f.write(blob[:half])
        pause, _, at = knobs.read("TORUS_CHECKPOINT_SLEEP").partition("@")
        if pause and int(at or epoch) == epoch:
            f.flush()
            time.sleep(float(pause))
        f.write(blob[half:])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    stale = list(directory.glob(".checkpoint-*.tmp"))
    for old in list_checkpoints(directory)[:-keep] + stale:
        old.unlink(missing_ok=True)
    return final


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first (temporary files are never listed)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def read_state(path: str | Path) -> dict:
    """The JSON ``state`` stored in checkpoint ``path``."""
    with np.load(path) as archive:
        return json.loads(archive["meta"].tobytes())["state"]


def restore(path: str | Path, model) -> dict:
    """Load weights and optimizer variables from ``path`` into ``model`` (compiled, same architecture and
    optimizer); return the stored ``state``. The optimizer is built first if it has no variables yet.

    Raises ``ValueError`` naming the first variable whose path or shape does not match.
    """
    with np.load(path) as archive:
        meta = json.loads(archive["meta"].tobytes())
        _assign(model.weights, meta["weights"], [archive[f"w{i}"] for i in range(len(meta["weights"]))], path)
        optimizer = model.optimizer
        if meta["optimizer"]:
            if not optimizer.variables or len(optimizer.variables) < len(meta["optimizer"]):
                optimizer.build(model.trainable_variables)
            _assign(optimizer.variables, meta["optimizer"],
                    [archive[f"o{i}"] for i in range(len(meta["optimizer"]))], path)
    return meta["state"]


def _assign(variables, names, values, path) -> None:
    if len(variables) != len(names):
        raise ValueError(f"restore {path}: checkpoint has {len(names)} variables, the model {len(variables)}")
    for variable, name, value in zip(variables, names, values):
        if tuple(variable.shape) != value.shape:
            raise ValueError(f"restore {path}: {name} has shape {value.shape} in the checkpoint, "
                             f"{tuple(variable.shape)} in the model")
        variable.assign(value)
