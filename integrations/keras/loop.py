"""Data-parallel pieces for a custom training loop (and the ones ``TorusStrategy`` is built from).

``allreduce_tensors`` all-reduces a list of tensors inside or outside a ``tf.function``: they are fused into one
flat buffer per dtype and handed to ``TorusComm.allreduce`` through a single ``tf.numpy_function``, so every rank
issues the same messages in the same order (separate calls per tensor can deadlock). ``broadcast_variables``
copies rank 0's values into every rank's variables (eager, one ``MPI_Ibcast`` per dtype, bounded by the
stall timeout).

A custom loop::

    tc = torus.TorusComm()
    host = HostAllreduce(tc, algorithm="torus2d", compression="none")
    model, opt = make_model(), LARS(...)
    opt.build(model.trainable_variables)
    broadcast_variables(tc, model.variables + opt.variables)      # before the first update
    @tf.function                                                  # jit_compile must stay False
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))          # mean over this rank's batch
        grads = allreduce_tensors(host, tape.gradient(loss, model.trainable_variables), op="avg")
        opt.apply_gradients(zip(grads, model.trainable_variables))
"""
from __future__ import annotations

import time
import zlib

import numpy as np
import tensorflow as tf

from torus import IN_PLACE, faults, kernels
from torus.errors import MismatchError
from torus.ops import BFLOAT16

COMPRESSION = {"none": None, "fp16": np.dtype(np.float16), "bf16": BFLOAT16}


def check_compression(compression: str):
    """The numpy wire dtype for ``compression`` ("none", "fp16" or "bf16"); ``ValueError`` otherwise."""
    if compression not in COMPRESSION:
        raise ValueError(f"compression {compression!r} not one of {', '.join(COMPRESSION)}")
    return COMPRESSION[compression]


class HostAllreduce:
    """The host side of the fused all-reduce: called with one flat numpy buffer per dtype, returns new ones.

    float32 buffers travel as ``compression`` (float16/bfloat16, cast with ``torus.kernels.narrow`` and back
    with ``widen``; the reduction accumulates in float32 and rounds once per step of the schedule).
    ``seconds`` accumulates the wall time spent here (for benchmarks).
    """

    def __init__(self, torus_comm, algorithm: str = "auto", compression: str = "none"):
        self.torus_comm, self.algorithm = torus_comm, algorithm
        self.wire = check_compression(compression)
        self._scratch: dict = {}
        self.seconds, self.calls = 0.0, 0

    def __call__(self, op: str, *bufs):
        t0 = time.perf_counter()
        out = [self._one(np.asarray(b), op) for b in bufs]
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def _one(self, buf, op):
        # A fresh output every call: TensorFlow may keep aliasing a returned array after the step ends.
        if self.wire is None or buf.dtype != np.float32:
            return self.torus_comm.allreduce(buf, np.empty_like(buf), op=op, algorithm=self.algorithm)
        wire = self._scratch.get(buf.size)
        if wire is None:
            wire = self._scratch[buf.size] = np.empty(buf.size, self.wire)
        kernels.narrow(buf, wire)
        self.torus_comm.allreduce(IN_PLACE, wire, op=op, algorithm=self.algorithm)
        out = np.empty_like(buf)
        kernels.widen(wire, out)
        return out


def allreduce_tensors(host: HostAllreduce, tensors, op: str = "avg"):
    """All-reduce ``tensors`` (a list of ``tf.Tensor`` / ``tf.IndexedSlices``; any shapes and dtypes) over all
    ranks; returns dense tensors of the same shapes and dtypes, in the same order.

    ``op`` is "sum" or "avg" (mean over ranks). ``tf.IndexedSlices`` (gradients of ``Embedding``) are made dense
    first, so the result equals a single process' dense gradient over the global batch (it costs the full
    variable's size on the wire). Collective: every rank must call it with the same list of shapes and dtypes
    in the same order. Not XLA-compilable (``tf.numpy_function``).
    """
    dense = [tf.convert_to_tensor(t) for t in tensors]
    if not dense:
        return []
    dtypes = list(dict.fromkeys(t.dtype for t in dense))
    groups = [[i for i, t in enumerate(dense) if t.dtype == dt] for dt in dtypes]
    flats = [tf.concat([tf.reshape(dense[i], [-1]) for i in g], 0) for g in groups]
    reduced = tf.numpy_function(lambda *bufs: host(op, *bufs), flats, dtypes, stateful=True,
                                name="torus_allreduce")
    if not isinstance(reduced, (list, tuple)):  # eagerly, a one-element Tout comes back as a bare tensor
        reduced = [reduced]
    result = [None] * len(dense)
    for g, fused, flat in zip(groups, reduced, flats):
        fused.set_shape(flat.shape)
        for i, part in zip(g, tf.split(fused, tf.stack([tf.size(dense[i]) for i in g]), num=len(g))):
            result[i] = tf.reshape(part, tf.shape(dense[i]))
            result[i].set_shape(dense[i].shape)
    return result


def stall_timeout(torus_comm):
    """Seconds ``torus_comm``'s collectives wait without progress before ``TimeoutError`` (None: forever)."""
    # TorusComm keeps the resolved value (argument, TORUS_TIMEOUT, default) on its executor only.
    return torus_comm._executor.timeout


def broadcast_variables(torus_comm, variables, root: int = 0) -> None:
    """Assign rank ``root``'s values to ``variables`` (Keras or tf variables) on every rank. Eager only;
    collective: every rank passes the same variables (count, shapes, dtypes, order).

    First every rank's list signature is all-gathered and compared (``MismatchError`` on every rank, naming
    the ranks that differ, before any value moves); then one ``MPI_Ibcast`` per dtype. Each wait is bounded by
    ``torus_comm``'s stall timeout: a rank that never calls (raised, exited, stuck) turns into
    ``torus.errors.TimeoutError`` on the others instead of a hang."""
    variables = list(variables)
    comm, rank, size = torus_comm.comm, torus_comm.rank, torus_comm.size
    timeout = stall_timeout(torus_comm)
    layout = repr([(tuple(int(d) for d in v.shape), str(v.dtype)) for v in variables]).encode()
    mine = np.array([len(variables), zlib.crc32(layout)], np.int64)
    every = np.empty((size, mine.size), np.int64)
    faults.wait(comm.Iallgather(mine, every), timeout, lambda: (
        f"broadcast_variables on rank {rank}: no progress for {timeout:g} s checking every rank's variable "
        "list: some rank did not call it (it raised, exited or is stuck); abort the job"))
    differ = [r for r in range(size) if (every[r] != every[root]).any()]
    if differ:
        raise MismatchError(f"broadcast_variables on rank {rank}: rank(s) {differ} hold other variables than "
                            f"rank {root} (count {[int(c) for c in every[:, 0]]} per rank, or shapes/dtypes "
                            "differ): build the same model and optimizer on every rank")
    for dt in dict.fromkeys(v.dtype for v in variables):
        group = [v for v in variables if v.dtype == dt]
        flat = np.concatenate([np.asarray(v.numpy() if hasattr(v, "numpy") else v).reshape(-1)
                               for v in group])
        what = (f"broadcast_variables on rank {rank}: no progress for {timeout} s broadcasting {flat.nbytes} "
                f"bytes of {dt} from rank {root}: some rank died or is stuck; abort the job")
        faults.wait(comm.Ibcast(flat.view(np.uint8), root=root), timeout, lambda what=what: what)
        offset = 0
        for v in group:
            n = int(np.prod(v.shape))
            v.assign(flat[offset:offset + n].reshape(tuple(v.shape)))
            offset += n
