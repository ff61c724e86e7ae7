"""Every rank passes ``fit`` / ``evaluate`` / ``predict`` the same global ``tf.data`` dataset, or one marked per rank.

``TorusStrategy`` splits each batch of an unmarked dataset over the ranks, as if every rank held the same global
dataset. A dataset built per rank without ``strategy.shard`` (Horovod's habit: ``from_tensor_slices`` of a hand
shard, ``shuffle(seed=rank)``, a per-rank file list) would be split again and train on ``1 / size`` of each rank's
batches, silently. :func:`agree_datasets` compares a :func:`fingerprint` of each rank's dataset graph (one
``MPI_Iallgather`` of a few int64, bounded by the stall timeout) and raises ``torus.errors.MismatchError`` on every
rank where they differ, naming the ranks and the fix (mark per-rank data with ``strategy.shard(...)`` or
``inputs.per_rank``, or build the same dataset everywhere), before any step. Nothing runs the dataset: a seeded
reshuffle keeps its order.

The fingerprint covers every op of the graph and of its functions with their attributes and constants (so the
data of ``from_tensor_slices``, file names, seeds, batch sizes), but not names (node, function and dataset names
carry per-process counters). It cannot see what the graph does not hold: the rows of ``from_generator`` or a
``py_function``, the contents of files (only their names). A graph TensorFlow cannot serialize (over 2 GB of
constants) is not compared.

A global dataset with ``shuffle()`` and no seed (and no ``tf.random.set_seed``) shuffles differently on every
rank, so each rank's share is a slice of another batch (rows repeat and go missing within an epoch): the chief
warns, naming the fix (``shuffle(..., seed=S)``, the same ``S`` on every rank).
"""
from __future__ import annotations

import warnings
import zlib

import numpy as np
import tensorflow as tf

from torus.errors import MismatchError
from torus.integrations.keras import compat
from torus.integrations.keras.collectives.loop import gather_records, stall_timeout

NOT_A_DATASET = -1
PER_RANK = -2
UNREADABLE = -3
_HANDLES = (tf.resource.as_datatype_enum, tf.variant.as_datatype_enum)


def _digest(node) -> int:
    crc = zlib.crc32(node.op.encode())
    for key in sorted(node.attr):
        if key.startswith("_") or key == "metadata":  # names with per-process counters
            continue
        value = node.attr[key]
        kind = value.WhichOneof("value")
        if kind == "func" or kind == "tensor" and value.tensor.dtype in _HANDLES:
            crc = zlib.crc32(key.encode(), crc)  # a function's or a resource's name: a per-process counter
            continue
        crc = zlib.crc32(key.encode() + value.SerializeToString(deterministic=True), crc)
    return crc


def _unseeded_shuffle(graph) -> bool:
    """Whether a shuffle op of ``graph`` has both seeds 0 (a fresh random seed per process)."""
    zeros = set()
    for node in graph.node:
        if node.op == "Const" and node.attr["value"].tensor.dtype in (tf.int64.as_datatype_enum,):
            if not tf.make_ndarray(node.attr["value"].tensor).any():
                zeros.add(node.name)
    for node in graph.node:
        if node.op.startswith("Shuffle") and len(node.input) >= 4:
            seeds = [name.split(":")[0] for name in node.input[2:4]]
            if all(seed in zeros for seed in seeds):
                return True
    return False


def fingerprint(dataset: tf.data.Dataset) -> tuple[int, bool]:
    """``(crc32 of the canonical graph, unseeded shuffle)``; ``(UNREADABLE, False)`` where the graph cannot be
    serialized. See the module docstring for what the crc covers."""
    try:
        graph = compat.dataset_graph(dataset)
    except Exception:  # TensorFlow's own errors (a graph over 2 GB, an op without a serialization)
        return UNREADABLE, False
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    digests = np.sort(np.array([_digest(n) for n in nodes], np.uint32))
    return zlib.crc32(digests.tobytes()), _unseeded_shuffle(graph)


def _record(strategy, value) -> tuple[int, bool]:
    from torus.integrations.keras.fit.inputs import is_per_rank

    if not isinstance(value, tf.data.Dataset):
        return NOT_A_DATASET, False
    if is_per_rank(value, strategy.size):
        return PER_RANK, False
    return fingerprint(value)


def _show(value: int) -> str:
    return {NOT_A_DATASET: "not a tf.data dataset", PER_RANK: "marked per rank",
            UNREADABLE: "not serializable"}.get(value, f"graph {value:#010x}")


def agree_datasets(strategy, method: str, arguments: dict) -> None:
    """Raise ``MismatchError`` on every rank where the ranks' ``x`` (and ``fit``'s ``validation_data``)
    datasets differ (see the module docstring); warn on the chief for an unseeded shuffle. Collective: every
    rank calls it for every call (one small all-gather); nothing at one rank."""
    if strategy.size == 1 or arguments.get("_use_cached_eval_dataset"):
        return
    names = ("x", "validation_data") if method == "fit" else ("x",)
    mine = [_record(strategy, arguments.get(name)) for name in names]
    row = np.array([v for v, _ in mine] + [int(u) for _, u in mine], np.int64)
    tc, rank = strategy.torus_comm, strategy.rank
    timeout = stall_timeout(tc)
    every = gather_records(tc.comm, row, timeout, lambda: (
        f"TorusStrategy {method} on rank {rank}: no progress for {timeout:g} s comparing every rank's datasets: "
        f"some rank did not call {method} (it raised, exited or is stuck); abort the job"))
    for k, name in enumerate(names):
        column = every[:, k].tolist()
        readable = [v for v in column if v != UNREADABLE]
        if len(set(readable)) > 1:
            groups: dict[int, list[int]] = {}
            for r, v in enumerate(column):
                groups.setdefault(v, []).append(r)
            listed = "; ".join(f"{_show(v)} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                               for v, rs in groups.items())
            raise MismatchError(
                f"TorusStrategy {method} on rank {rank}: the ranks passed different {name} datasets ({listed}). "
                "An unmarked tf.data dataset is taken as the same global dataset on every rank and each batch is "
                "split over the ranks; if each rank's dataset holds its own share, build it with "
                "strategy.shard(dataset) (or mark it: torus.integrations.keras.fit.inputs.per_rank(dataset)) and "
                "batch it per rank; if it is meant to be global, build it the same way on every rank (same "
                "files, same seed)")
        if strategy.is_chief and every[0, len(names) + k] and column[0] >= 0:
            warnings.warn(f"TorusStrategy {method}: the {name} dataset shuffles without a seed, so every rank "
                          "shuffles it differently and each rank's share of a global batch comes from another "
                          "batch (rows repeat and go missing within an epoch); pass shuffle(..., seed=S) with the "
                          "same S on every rank, or strategy.shard(dataset) before shuffling", stacklevel=4)
