"""Horovod's tensor and object collectives over the ``TorusComm`` of ``hvd.init()``.

Each tensor call is one ``tf.numpy_function`` (``stateful``, so inside a ``tf.function`` they run in program
order on every rank), usable eagerly or in a graph; not XLA-compilable. Every call is collective: all ranks
make the same calls in the same order. All-reduce goes through ``torus.integrations.keras.collectives.reducer``
(``HostAllreduce`` / ``allreduce_tensors``, the torus schedules); all-gather and broadcast move bytes with the
communicator's own ``MPI_Allgatherv`` / ``MPI_Bcast`` after an all-gather of every rank's shape and dtype, so a
mismatch raises ``ValueError`` on every rank instead of hanging or truncating.

Gradients (``tf.GradientTape``, eagerly or in a ``tf.function``) follow Horovod's rules, i.e. they are the
gradients of the sum over ranks of every rank's loss: all-reduce's is the all-reduce of the incoming gradient
with the same op (``Sum`` / ``Average``; the pre/post scale multiplications are differentiated as they stand),
all-gather's is the all-reduce-sum of the incoming gradient cut to this rank's rows, broadcast's is the
all-reduce-sum on the root rank and zeros elsewhere. The backward pass is collective too: every rank must take
the gradient through the same collectives in the same order. ``Min``, ``Max`` and ``Product`` have no gradient
here: ``NotImplementedError`` when the gradient is taken (Horovod silently all-reduces the gradient with that
op, which is not their derivative). Integer and bool tensors have none, as in TensorFlow.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from torus.integrations.keras.collectives.host import HostAllreduce
from torus.integrations.keras.collectives.loop import broadcast_variables as _bcast_vars
from torus.integrations.keras.collectives.loop import check_same_variables, wait_for_every_rank
from torus.integrations.keras.collectives.reducer import allreduce_tensors
from torus.integrations.keras.horovod.basics import rank, size, torus_comm
from torus.integrations.keras.horovod.compression import Compression, wire_format
from torus.ops import OPS, check_op_dtype

# Horovod's reduction constants, spelled as torus op names. Adasum is not provided.
Average, Sum, Min, Max, Product = "avg", "sum", "min", "max", "prod"

_hosts: dict = {}

# Called inside a user's tf.function, these would be rewritten by AutoGraph on every trace (about 1 s for
# hvd.broadcast_variables of a few variables); they hold no tensor-dependent Python control flow to convert.
_not_autograph = tf.autograph.experimental.do_not_convert


def host_allreduce(compression=Compression.none, algorithm: str = "auto", what: str = "hvd") -> HostAllreduce:
    """The (cached) ``HostAllreduce`` for this wire format and torus algorithm on the current communicator."""
    tc = torus_comm()
    key = (wire_format(compression, what, tc.rank), algorithm)
    found = _hosts.get(key)
    if found is None or found.torus_comm is not tc:
        found = _hosts[key] = HostAllreduce(tc, algorithm, key[0])
    return found


def fused_allreduce(host: HostAllreduce, tensors, op: str):
    """``reducer.allreduce_tensors``: eagerly its ``tf.numpy_function`` runs at once, in a graph it is traced."""
    return allreduce_tensors(host, list(tensors), op)


def _differentiable(tensor: tf.Tensor, forward, backward) -> tf.Tensor:
    """``forward(tensor)`` with ``backward(dy)`` as its gradient, for floating tensors (others have none)."""
    if not tensor.dtype.is_floating:
        return forward(tensor)

    @tf.custom_gradient
    def op(x):
        return forward(x), backward

    return op(tensor)


def resolve_op(what: str, average=None, op=None) -> str:
    """Horovod's ``op`` / deprecated ``average`` pair as a torus op name (default ``Average``)."""
    if average is not None and op is not None:
        raise ValueError(f"{what} on rank {rank()}: pass op or the deprecated average, not both")
    if op is None:
        op = Sum if average is False else Average
    if op not in OPS:
        raise ValueError(f"{what} on rank {rank()}: op {op!r} not one of hvd.Average, Sum, Min, Max, Product "
                         "(Adasum is not supported)")
    return op


def _root(what: str, root_rank) -> int:
    if not 0 <= int(root_rank) < size():
        raise ValueError(f"{what} on rank {rank()}: root_rank {root_rank} outside [0, {size()})")
    return int(root_rank)


def _numeric(what: str, value) -> tf.Tensor:
    tensor = tf.convert_to_tensor(value)
    if not (tensor.dtype.is_floating or tensor.dtype.is_integer or tensor.dtype.is_bool):
        raise TypeError(f"{what} on rank {rank()}: dtype {tensor.dtype.name} is not numeric")
    return tensor


def _agree_layout(what: str, buf: np.ndarray, same_first_dim: bool) -> list:
    """All-gather every rank's (shape, dtype); ``ValueError`` on every rank if they cannot be combined."""
    layouts = torus_comm().comm.allgather((buf.shape, buf.dtype.str))
    keep = slice(0 if same_first_dim else 1, None)
    bad = [r for r, (shape, dt) in enumerate(layouts)
           if dt != buf.dtype.str or len(shape) != buf.ndim or shape[keep] != buf.shape[keep]]
    if bad:
        raise ValueError(f"{what} on rank {rank()}: shapes/dtypes differ between ranks: "
                         + ", ".join(f"rank {r} {s} {d}" for r, (s, d) in enumerate(layouts)))
    return [shape for shape, _ in layouts]


@_not_autograph
def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Reduce ``value`` (any tensor-like; same shape and dtype on every rank) over all ranks; returns a
    ``tf.Tensor`` of its shape and dtype. ``op``: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``;
    ``Average`` on integers raises ``TypeError``. ``prescale_factor`` / ``postscale_factor`` multiply before /
    after the reduction. ``name`` is accepted and unused. Differentiable for ``Sum`` and ``Average``
    (module docstring); the gradient of ``Min`` / ``Max`` / ``Product`` raises ``NotImplementedError``."""
    op = resolve_op("hvd.allreduce", average, op)
    tensor = _numeric("hvd.allreduce", value)
    check_op_dtype("hvd.allreduce", rank(), op, tensor.dtype.as_numpy_dtype)
    if prescale_factor != 1.0:
        tensor = tensor * tf.cast(prescale_factor, tensor.dtype)
    host = host_allreduce(compression, what="hvd.allreduce")

    def reduce(buf):
        return fused_allreduce(host, [buf], op)[0]

    def grad(dy):
        if op not in (Sum, Average):
            raise NotImplementedError(f"hvd.allreduce on rank {rank()}: no gradient for op {op!r} (only "
                                      "hvd.Sum and hvd.Average are differentiable)")
        return reduce(dy)

    out = _differentiable(tensor, reduce, grad)
    if postscale_factor != 1.0:
        out = out * tf.cast(postscale_factor, out.dtype)
    return out


@_not_autograph
def allgather(value, name=None):
    """Concatenate every rank's ``value`` along the first dimension, in rank order. Shapes may differ in the
    first dimension only (at least one dimension); dtypes must agree. Returns a ``tf.Tensor``. Differentiable
    (floating dtypes): the gradient is the sum over ranks of the incoming gradients' rows of this rank."""
    tensor = _numeric("hvd.allgather", value)
    if tensor.shape.rank == 0:
        raise ValueError(f"hvd.allgather on rank {rank()}: value must have at least one dimension")

    def gather(buf):
        buf = np.ascontiguousarray(buf)
        shapes = _agree_layout("hvd.allgather", buf, same_first_dim=False)
        out = np.empty((sum(s[0] for s in shapes),) + buf.shape[1:], buf.dtype)
        nbytes = [int(np.prod(s)) * buf.dtype.itemsize for s in shapes]
        torus_comm().comm.Allgatherv(buf.reshape(-1).view(np.uint8), [out.reshape(-1).view(np.uint8), nbytes])
        return out, np.array([s[0] for s in shapes], np.int64)

    rows = []  # every rank's first dimension, from the forward pass: the backward needs no extra collective

    def forward(x):
        out, counts = tf.numpy_function(gather, [x], [x.dtype, tf.int64], stateful=True, name="hvd_allgather")
        out.set_shape([None] + x.shape.as_list()[1:])
        rows.append(counts)
        return out

    def grad(dy):
        total = fused_allreduce(host_allreduce(what="hvd.allgather"), [dy], Sum)[0]
        start = tf.reduce_sum(rows[0][:rank()])
        return total[start:start + rows[0][rank()]]

    return _differentiable(tensor, forward, grad)


@_not_autograph
def broadcast(value, root_rank, name=None):
    """Rank ``root_rank``'s ``value`` on every rank (same shape and dtype everywhere); a ``tf.Tensor``.
    Differentiable (floating dtypes): on the root rank the gradient is the sum over ranks of the incoming
    gradients, elsewhere zeros (every rank still takes part in that all-reduce)."""
    tensor = _numeric("hvd.broadcast", value)
    root = _root("hvd.broadcast", root_rank)

    def bcast(buf):
        out = np.array(buf, copy=True, order="C")
        _agree_layout("hvd.broadcast", out, same_first_dim=True)
        torus_comm().comm.Bcast(out.reshape(-1).view(np.uint8), root=root)
        return out

    def forward(x):
        out = tf.numpy_function(bcast, [x], x.dtype, stateful=True, name="hvd_broadcast")
        out.set_shape(x.shape)
        return out

    def grad(dy):
        total = fused_allreduce(host_allreduce(what="hvd.broadcast"), [dy], Sum)[0]
        if rank() == root:
            return total
        # The dependency keeps the all-reduce in graphs that TensorFlow prunes (the backward function of a
        # tf.function differentiated from outside has no automatic control dependencies)
        with tf.control_dependencies([total]):
            return tf.zeros_like(dy)

    return _differentiable(tensor, forward, grad)


def broadcast_object(obj, root_rank=0, name=None):
    """Rank ``root_rank``'s picklable ``obj`` on every rank (``mpi4py`` ``bcast``)."""
    return torus_comm().comm.bcast(obj, root=_root("hvd.broadcast_object", root_rank))


def allgather_object(obj, name=None):
    """A list of every rank's picklable ``obj``, in rank order (``mpi4py`` ``allgather``)."""
    return torus_comm().comm.allgather(obj)


@_not_autograph
def broadcast_variables(variables, root_rank):
    """Assign rank ``root_rank``'s values to ``variables`` (Keras or tf variables, or a callable returning them
    such as a Keras 2 ``opt.variables``; same count, shapes, dtypes and order on every rank). Collective.

    Eagerly: ``torus.integrations.keras.collectives.loop.broadcast_variables`` (one ``MPI_Ibcast`` per dtype);
    returns None. Inside a ``tf.function`` (Horovod's TF2 pattern: ``if first_batch:
    hvd.broadcast_variables(model.variables, root_rank=0)`` after the first ``apply_gradients``): one
    ``tf.numpy_function`` that checks the lists, then ``v.assign(hvd.broadcast(v, root_rank))`` for each
    variable, in order, after what the step did to them before; returns the grouped assignments.

    Raises ``ValueError`` for a ``root_rank`` outside ``[0, size())``; ``torus.errors.MismatchError`` on every
    rank where the lists differ (``loop.check_same_variables``: it names the first variable that differs, and
    says when a Keras optimizer holds no slots on some rank, e.g. one loaded from ``.h5``). In a graph the
    same message reaches the caller inside TensorFlow's error for the failed ``tf.numpy_function``."""
    if callable(variables) and not isinstance(variables, (list, tuple)):
        variables = variables()
    variables = list(variables)
    what = "hvd.broadcast_variables"
    root = _root(what, root_rank)
    tc = torus_comm()
    if tf.executing_eagerly():
        _bcast_vars(tc, variables, root, what)
        return None

    def check(_):
        check_same_variables(tc, variables, root, what)
        return np.int64(len(variables))

    checked = tf.numpy_function(check, [tf.constant(0, tf.int64)], tf.int64, stateful=True,
                                name="hvd_broadcast_variables_check")
    assigns = []
    with tf.control_dependencies([checked]):
        for v in variables:
            assigns.append(v.assign(broadcast(v, root)))
    return tf.group(*assigns)


def barrier() -> None:
    """Horovod's ``hvd.barrier()``: return once every rank has called it (collective), bounded by the stall
    timeout (``torus.errors.TimeoutError`` naming this rank where some rank never comes). E.g. between
    ``if hvd.rank() == 0: model.save(path)`` and a ``load_model(path)`` on every rank."""
    wait_for_every_rank(torus_comm(), "hvd.barrier")
