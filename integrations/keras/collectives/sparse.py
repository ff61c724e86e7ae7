"""Sparse gradients (``tf.IndexedSlices``, e.g. ``Embedding``'s) all-gathered across ranks as IndexedSlices.

An IndexedSlices stands for the sum of its rows scattered at its indices (repeated indices add up). Gathering
every rank's rows and indices in rank order gives the IndexedSlices one process computes on the global batch
(each rank's part of the batch is its contiguous 1/size of it): the same rows in the same order, so an optimizer
that updates sparse gradients row by row (Keras' Adam, RMSprop, Adagrad) computes what one process computes (up
to float summation order, see below), where a densified sum would not (Horovod's default,
``sparse_as_dense=False``). The wire carries the rows (``rows * row size`` per rank) instead of the whole
variable, which pays while the batch touches few rows.

``allgather_slices(host, slices, op)``: one ``tf.numpy_function`` for the list; on the host's communication
thread (one collective at a time per ``TorusComm``, after any bucket queued before it) it all-gathers each
rank's row counts, then each slice's indices (as int64) and rows with ``TorusComm.allgather`` (uneven counts).
``op`` "sum" keeps the rows, "avg" divides them by the number of ranks. Uncompressed (``compression`` applies to
dense gradients only). Collective: every rank passes the same number of slices with the same row shape and
dtype, in the same order; the row counts may differ.

Bitwise-equal replicas. Keras applies a sparse update with a variable scatter (``Optimizer.assign_add`` /
``assign_sub`` / ``assign`` of an IndexedSlices), and TensorFlow's CPU kernel splits a large scatter across its
intra-op threads: the rows of a repeated index add up in thread order, so ranks differ in the last bits and
drift apart (RMSprop, Adagrad, plain SGD; Adam and SGD with momentum densify first). ``deterministic_scatters``
(installed by ``fit.optimizer.as_gradients`` under a TorusStrategy, and by the Horovod ``DistributedOptimizer``)
makes those methods first reduce the slices to one row per index (``unique_slices``: summed in row order, on
the CPU): replicas bitwise equal after every step; against one process, per step and element at most about
k/2 units in the last place for an id seen k times in the global batch. Why this way and what it costs (the
rejected ways too): docs/design.md, "Sparse updates, bitwise".
"""
from __future__ import annotations

import types

import numpy as np
import tensorflow as tf

from torus.integrations.keras import compat


def allgather_slices(host, slices: list, op: str = "sum") -> list:
    """``slices`` (``tf.IndexedSlices``) gathered over ranks, in rank order; see the module docstring. Returns
    ``tf.IndexedSlices`` with the same dense shapes, row shapes and dtypes (indices int64)."""
    if not slices:
        return []
    if op not in ("sum", "avg"):
        raise ValueError(f"allgather_slices on rank {host.torus_comm.rank}: op {op!r}; expected 'sum' or 'avg'")
    inputs, tout = [], []
    for s in slices:
        inputs += [s.values, tf.cast(s.indices, tf.int64)]
        tout += [s.values.dtype, tf.int64]
    graph = not tf.executing_eagerly()
    with tf.control_dependencies(host.after_previous() if graph else []):
        gathered = tf.numpy_function(lambda *arrays: host.progress.call(_gather, host.torus_comm, op, arrays),
                                     inputs, tout, stateful=True, name="torus_allgather_slices")
    if graph:
        host.record(gathered[0])
    out = []
    for k, s in enumerate(slices):
        values, indices = gathered[2 * k], gathered[2 * k + 1]
        values.set_shape(tf.TensorShape([None]).concatenate(s.values.shape[1:]))
        indices.set_shape([None])
        out.append(tf.IndexedSlices(values, indices, s.dense_shape))
    return out


def _gather(torus_comm, op: str, arrays) -> list:
    """On the communication thread: the row counts, then every slice's rows and indices, in rank order."""
    size = torus_comm.size
    pairs = [(np.ascontiguousarray(arrays[k]), np.ascontiguousarray(arrays[k + 1])) for k in range(0, len(arrays), 2)]
    rows = np.array([len(indices) for _, indices in pairs], np.int64)
    every = torus_comm.allgather(rows, np.empty(size * len(pairs), np.int64)).reshape(size, len(pairs))
    out = []
    for k, (values, indices) in enumerate(pairs):
        counts = [int(n) for n in every[:, k]]
        row = int(np.prod(values.shape[1:], dtype=np.int64))
        total = sum(counts)
        got_values = np.empty(total * row, values.dtype)
        torus_comm.allgather(values.reshape(-1), got_values, recvcounts=[n * row for n in counts])
        got_indices = np.empty(total, np.int64)
        torus_comm.allgather(indices, got_indices, recvcounts=counts)
        got_values = got_values.reshape((total, *values.shape[1:]))
        if op == "avg":
            got_values /= np.asarray(size, values.dtype)
        out += [got_values, got_indices]
    return out


def unique_slices(slices: tf.IndexedSlices, keep: str = "sum") -> tf.IndexedSlices:
    """``slices`` with each index once, in the order of first appearance: the rows of a repeated index summed in
    row order (``keep`` "sum", what a scatter-add of them means) or the last of them (``keep`` "last", what a
    serial scatter-update leaves). The same bits for the same input, on every rank: computed on the CPU, whose
    unsorted segment sum reduces each output row in input order on one thread (on a GPU it adds with atomics)."""
    if keep not in ("sum", "last"):
        raise ValueError(f"unique_slices: keep {keep!r}; expected 'sum' or 'last'")
    with tf.device("/cpu:0"):
        unique, position = tf.unique(slices.indices)
        count = tf.size(unique)
        if keep == "sum":
            values = tf.math.unsorted_segment_sum(slices.values, position, count)
        else:
            last = tf.math.unsorted_segment_max(tf.range(tf.size(position)), position, count)
            values = tf.gather(slices.values, last)
    return tf.IndexedSlices(values, unique, slices.dense_shape)


def _unique_first(name: str, keep: str):
    def method(self, variable, value):
        if isinstance(value, tf.IndexedSlices):  # summed in the variable's dtype, as the scatter would add
            value = unique_slices(tf.cast(value, variable.dtype), keep)
        return getattr(type(self), name)(self, variable, value)  # the class' own, overrides included

    method.__name__ = method.__qualname__ = name
    return method


_UNIQUE_FIRST = {name: _unique_first(name, keep)
                 for name, keep in (("assign", "last"), ("assign_add", "sum"), ("assign_sub", "sum"))}


def deterministic_scatters(optimizer) -> None:
    """Make ``optimizer``'s sparse updates the same bits on every rank and every run (see the module
    docstring): its ``assign`` / ``assign_add`` / ``assign_sub`` reduce an IndexedSlices value to unique indices
    (``unique_slices``) before the class' own method scatters it; dense values pass unchanged. Idempotent; the
    methods are bound to the instance (``copy.deepcopy`` rebinds them to the copy). Updates that bypass these
    methods (a custom optimizer calling ``variable.scatter_add`` itself) are not covered."""
    for name, method in _UNIQUE_FIRST.items():
        if getattr(optimizer.__dict__.get(name), "__func__", None) is not method:
            compat.set_on_instance(optimizer, name, types.MethodType(method, optimizer))
