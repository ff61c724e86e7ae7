"""The one reducer of tensors: every gradient, metric and custom-loop all-reduce of the Keras layer comes here.

``reduce_gradients(host, grads, op)`` splits a gradient list: ``tf.IndexedSlices`` go to
``sparse.allgather_slices`` (unless ``sparse_as_dense``), everything else to ``allreduce_tensors``.
``allreduce_tensors(host, tensors, op)`` always plans buckets (one dtype each) and hands them to the bucket
routine (buckets.py), so every rank issues the same messages in the same order (separate calls per tensor can
deadlock):

- overlap on (``host.overlap``, inside a ``tf.function``, shapes fully defined): ``buckets.plan``'s buckets,
  each a *start* op whose inputs are only that bucket's tensors (TensorFlow runs it as soon as they exist; it
  packs them and queues the bucket's all-reduce on the communication thread; stateless where
  ``host.replica_apart``, so that no earlier stateful op such as a SyncBN all-reduce gates it in program order)
  and a *wait* op taking its token and the last start's token (it runs only after every start: a blocked wait
  must not hold one of TensorFlow's inter-op threads while backprop still needs it);
- otherwise: one bucket per dtype, all run inline in one ``tf.numpy_function``.

Each start (and each inline call) has a control dependency on the previous op of its host in the graph
(``after_previous``): every rank queues the buckets in the order of the plan, fixed by the model, never by
readiness. Each bucket comes back as one output per tensor (no ``tf.split``). Tensors with no elements are their
own result and are left out of the buckets. Results are bitwise equal across ranks. Not XLA-compilable.
"""
from __future__ import annotations

import tensorflow as tf

from torus.integrations.keras.collectives.buckets import by_dtype, plan
from torus.integrations.keras.collectives.host import HostAllreduce
from torus.integrations.keras.collectives.sparse import allgather_slices


def reduce_gradients(host: HostAllreduce, grads: list, op: str = "sum", sparse_as_dense: bool | None = None) -> list:
    """``grads`` (tensors and ``tf.IndexedSlices``; no None) over ranks, in the same order: the dense ones through
    ``allreduce_tensors``, the IndexedSlices through ``sparse.allgather_slices`` (or densified with the dense ones
    where ``sparse_as_dense``, by default ``host.sparse_as_dense``). The dense all-reduce is issued first (its
    buckets may be in flight)."""
    if sparse_as_dense is None:
        sparse_as_dense = host.sparse_as_dense
    sparse = [] if sparse_as_dense else [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
    dense = sorted(set(range(len(grads))) - set(sparse))
    out = list(grads)
    for i, g in zip(dense, allreduce_tensors(host, [grads[i] for i in dense], op)):
        out[i] = g
    for i, g in zip(sparse, allgather_slices(host, [grads[i] for i in sparse], op)):
        out[i] = g
    return out


def allreduce_tensors(host: HostAllreduce, tensors, op: str = "avg") -> list:
    """All-reduce ``tensors`` (a list of ``tf.Tensor`` / ``tf.IndexedSlices``; any shapes and dtypes) over all
    ranks; returns dense tensors of the same shapes and dtypes, in the same order.

    ``op`` is "sum" or "avg" (mean over ranks). ``tf.IndexedSlices`` are made dense first, so the result equals a
    single process' dense gradient over the global batch (``reduce_gradients`` keeps them sparse). Collective:
    every rank must call it with the same list of shapes and dtypes in the same order (overlapped buckets check
    it once per layout, ``MismatchError``; inline calls in each all-reduce's argument check). Inside or outside a
    ``tf.function``; see the module docstring for which buckets run where.
    """
    dense = [tf.convert_to_tensor(t) for t in tensors]
    if not dense:
        return []
    graph = not tf.executing_eagerly()
    known = all(t.shape.is_fully_defined() for t in dense)
    kept = [i for i, t in enumerate(dense) if not known or t.shape.num_elements()]
    result: list = [tf.zeros_like(t) for t in dense] if len(kept) < len(dense) else [None] * len(dense)
    if not kept:
        return result
    dtypes = [dense[i].dtype for i in kept]
    if host.overlap and graph and known:
        nbytes = [dense[i].shape.num_elements() * dense[i].dtype.size for i in kept]
        buckets = [[kept[j] for j in b] for b in plan(nbytes, dtypes, host.bucket_bytes, growth=host.bucket_growth)]
        outputs = _overlapped(host, dense, buckets, op)
    else:
        buckets = [[kept[j] for j in b] for b in by_dtype(dtypes)]
        outputs = _inline(host, dense, buckets, op, graph)
    for i, out in zip([i for b in buckets for i in b], outputs):
        out.set_shape(dense[i].shape)
        result[i] = out
    return result


def _inline(host: HostAllreduce, dense: list, buckets: list, op: str, graph: bool) -> list:
    inputs = [dense[i] for b in buckets for i in b]
    groups = tuple(len(b) for b in buckets)
    windowed = tuple(host.in_window([dense[i] for i in b]) for b in buckets)
    with tf.control_dependencies(host.after_previous() if graph else []):
        reduced = tf.numpy_function(
            lambda *arrays: host.progress.call(host.buckets.run, op, arrays, groups, windowed), inputs,
            [t.dtype for t in inputs], stateful=True, name="torus_allreduce")
    if not isinstance(reduced, (list, tuple)):  # eagerly, a one-element Tout comes back as a bare tensor
        reduced = [reduced]
    if graph:
        host.record(reduced[0])
    return list(reduced)


def _overlapped(host: HostAllreduce, dense: list, buckets: list, op: str) -> list:
    groups = [(dense[b[0]].dtype.as_numpy_dtype, sum(dense[i].shape.num_elements() for i in b)) for b in buckets]
    layout = host.buckets.layout_id(op, groups)
    tokens, previous = [], host.after_previous()
    for k, b in enumerate(buckets):
        windowed = host.in_window([dense[i] for i in b])
        with tf.control_dependencies(previous):
            token = tf.numpy_function(
                lambda *pieces, k=k, w=windowed: host.buckets.start(layout, k, w, pieces),
                [dense[i] for i in b], tf.int64, stateful=not host.replica_apart, name=f"torus_bucket{k}_start")
        token.set_shape(())
        tokens.append(token)
        previous = [token]
        host.record(token)
    outputs: list = []
    for k, b in enumerate(buckets):
        reduced = tf.numpy_function(lambda token, last: host.buckets.wait(token), [tokens[k], tokens[-1]],
                                    [dense[i].dtype for i in b], stateful=True, name=f"torus_bucket{k}_wait")
        outputs += reduced if isinstance(reduced, (list, tuple)) else [reduced]
    return outputs
