"""Every rank passes ``fit`` / ``evaluate`` / ``predict`` the same global arrays: checked before anything runs.

``TorusStrategy`` gives each rank its part of every global batch, so it needs the same arrays and the same
``batch_size`` on every rank. Arrays sharded by hand (Horovod's habit, ``x[rank::size]``) would otherwise train
silently on ``1 / size`` of the data (each rank's part of each batch of its own part), and a row count or
``batch_size`` that differs between ranks would surface as a step-count mismatch deep inside a step.
:func:`agree_arrays` all-gathers a small record per rank (one ``MPI_Iallgather`` of ``len(FIELDS)`` int64,
bounded by the ``TorusComm``'s stall timeout) and raises ``torus.errors.MismatchError`` (a ``ValueError``) on
every rank, naming the ranks and their values, before any step.

The record: the row count, ``batch_size``, ``validation_split``, the validation row count, ``epochs``,
``initial_epoch``, ``steps_per_epoch`` and a :func:`fingerprint` of ``x``, ``y``, ``sample_weight`` and the
validation arrays. The fingerprint (crc32) covers every array's shape and dtype and the bytes of a strided sample of
its rows: about ``SAMPLE_NBYTES`` (1 MiB) per array, at least two rows, the first and the last always included, so a
100 GB array costs 1 MiB of reads. It catches arrays of other lengths, shapes or dtypes, other row orders or
contents at the sampled rows (a hand shard, another shuffle, another file), another number of arrays. It misses
differences confined to rows it does not sample (with ``R`` rows and a sample of ``k``, roughly every ``R / k``-th
row is read), and, for object arrays or inputs numpy cannot slice by rows, their contents (shape and dtype only).
"""
from __future__ import annotations

import zlib

import keras
import numpy as np
import tensorflow as tf

from torus import faults
from torus.errors import MismatchError
from torus.integrations.keras.collectives.loop import stall_timeout
from torus.integrations.keras.compat import array_data_adapter, data_adapter_utils

SAMPLE_NBYTES = 1 << 20
FIELDS = ("row count", "batch_size", "validation_split", "validation row count", "epochs", "initial_epoch",
          "steps_per_epoch", "x", "y", "sample_weight", "validation data")
_DATA = {"row count", "validation row count", "x", "y", "sample_weight", "validation data"}
_FINGERPRINTS = {"x", "y", "sample_weight", "validation data"}
_NONE = -1


def _rows_of(a, index: np.ndarray):
    """Rows ``index`` of ``a`` as a numpy array (None where it cannot be sliced by rows into plain bytes)."""
    if isinstance(a, tf.RaggedTensor):
        part = tf.gather(a, index)
        return np.concatenate([part.flat_values.numpy().reshape(-1).view(np.uint8),
                               part.row_lengths().numpy().view(np.uint8)])
    if isinstance(a, tf.SparseTensor):
        return None
    if tf.is_tensor(a):
        return tf.gather(a, index).numpy()
    if hasattr(a, "iloc"):  # pandas
        return a.iloc[index].to_numpy()
    if hasattr(a, "toarray"):  # scipy.sparse
        return a[index].toarray()
    part = np.asarray(a[index])
    return None if part.dtype == object else part


def fingerprint(arrays) -> int:
    """crc32 (an int in ``[0, 2**32)``) of the shapes, dtypes and sampled rows of every array in ``arrays`` (any
    nest of numpy arrays / tensors / None; see the module docstring for the sample)."""
    crc = 0
    for a in keras.tree.flatten(arrays):
        if a is None:
            continue
        shape = tuple(int(d) if d is not None else -1 for d in a.shape)
        crc = zlib.crc32(repr((shape, _numpy_dtype(a).str)).encode(), crc)
        rows = shape[0] if shape else 0
        if rows <= 0:
            continue
        row_nbytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(_numpy_dtype(a)).itemsize)
        k = int(min(rows, max(2, SAMPLE_NBYTES // row_nbytes)))
        index = np.unique(np.linspace(0, rows - 1, k).round().astype(np.int64))
        part = _rows_of(a, index)
        if part is not None:
            crc = zlib.crc32(np.ascontiguousarray(part).view(np.uint8).reshape(-1).data, crc)
    return crc


def _numpy_dtype(a):
    dtype = getattr(a, "dtype", np.uint8)
    dtype = getattr(dtype, "as_numpy_dtype", dtype)  # tf.DType
    try:
        return np.dtype(dtype)
    except TypeError:
        return np.dtype(np.uint8)


def _count(arrays) -> int:
    flat = [a for a in keras.tree.flatten(arrays) if a is not None]
    return int(flat[0].shape[0]) if flat and flat[0].shape and flat[0].shape[0] is not None else _NONE


def _arrays(arguments: dict) -> bool:
    return array_data_adapter.can_convert_arrays(
        (arguments["x"], arguments.get("y"), arguments.get("sample_weight")))


def record(method: str, arguments: dict) -> np.ndarray | None:
    """This rank's int64 record (one value per ``FIELDS`` entry, -1 where it does not apply), or None when
    ``x`` is not arrays / tensors (datasets, generators, PyDataset are checked elsewhere or not at all)."""
    if arguments.get("_use_cached_eval_dataset") or not _arrays(arguments):
        return None
    x, y, sw = arguments["x"], arguments.get("y"), arguments.get("sample_weight")
    values = dict.fromkeys(FIELDS, _NONE)
    values.update({"row count": _count(x)}, x=fingerprint(x), y=fingerprint(y), sample_weight=fingerprint(sw))
    values["batch_size"] = _NONE if arguments.get("batch_size") is None else int(arguments["batch_size"])
    if method == "fit":
        for name in ("epochs", "initial_epoch", "steps_per_epoch"):
            values[name] = _NONE if arguments[name] is None else int(arguments[name])
        values["validation_split"] = int(np.float64(arguments["validation_split"] or 0).view(np.int64))
        validation = arguments["validation_data"]
        if validation is not None and not isinstance(validation, (tuple, list)):
            validation = None  # a dataset / generator / PyDataset: not checked here
        if validation is not None and array_data_adapter.can_convert_arrays(
                data_adapter_utils.unpack_x_y_sample_weight(tuple(validation))):
            values["validation row count"] = _count(validation[0])
            values["validation data"] = fingerprint(tuple(validation))
    return np.array([values[name] for name in FIELDS], np.int64)


def _show(name: str, value: int) -> str:
    if value == _NONE:
        return "None"
    if name == "validation_split":
        return f"{np.int64(value).view(np.float64):g}"
    return f"{value:#010x}" if name in _FINGERPRINTS else str(value)


def _by_value(name: str, column: np.ndarray) -> str:
    groups: dict[int, list[int]] = {}
    for r, v in enumerate(column.tolist()):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{_show(name, v)} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                     for v, rs in groups.items())


def agree_arrays(strategy, method: str, arguments: dict) -> None:
    """Raise ``MismatchError`` on every rank unless every rank passed ``method`` the same arrays and
    arguments (see the module docstring). Collective where ``x`` is arrays (every rank's ``x`` must be arrays
    then too: a rank that passes a dataset instead makes the others time out here); nothing at one rank."""
    if strategy.size == 1 or arguments.get("_use_cached_eval_dataset"):  # fit's validation: checked by fit
        return
    mine = record(method, arguments)
    tc, rank = strategy.torus_comm, strategy.rank
    if mine is None:
        mine = np.full(len(FIELDS), -2, np.int64)  # "not arrays": differs from every real record
    every = np.empty((strategy.size, mine.size), np.int64)
    timeout = stall_timeout(tc)
    faults.wait(tc.comm.Iallgather(mine, every), timeout, lambda: (
        f"TorusStrategy {method} on rank {rank}: no progress for {timeout:g} s comparing every rank's inputs: "
        f"some rank did not call {method} (it raised, exited or is stuck); abort the job"))
    if (every[:, 0] == -2).all():
        return
    differ = [name for k, name in enumerate(FIELDS) if len(set(every[:, k].tolist())) > 1]
    if not differ:
        return
    if (every[:, 0] == -2).any():
        kinds = _by_value("x", np.where(every[:, 0] == -2, 0, 1))
        raise MismatchError(f"TorusStrategy {method} on rank {rank}: some ranks passed arrays, others a dataset "
                            f"or generator (0 = not arrays, 1 = arrays: {kinds}); pass the same kind of input "
                            "on every rank")
    parts = [f"{name} ({_by_value(name, every[:, FIELDS.index(name)])})" for name in differ]
    hints = []
    if _DATA.intersection(differ):
        hints.append("TorusStrategy takes the same global arrays on every rank and gives each rank its part of "
                     "every batch: pass the whole arrays on every rank, not a shard (x[rank::size]); arrays each "
                     "rank already holds its own share of go in as torus.integrations.keras.fit.inputs.per_rank("
                     "tf.data.Dataset.from_tensor_slices((x, y)).batch(per_rank_batch)), not through "
                     "strategy.shard (which would shard them again)")
    if set(differ) - _DATA:
        hints.append("Pass the same arguments on every rank (batch_size is the global batch)")
    raise MismatchError(f"TorusStrategy {method} on rank {rank}: ranks passed different {', '.join(parts)}. "
                        + "; ".join(hints))
