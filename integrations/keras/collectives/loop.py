"""Data-parallel pieces for a custom training loop (and the ones ``TorusStrategy`` is built from).

``allreduce_tensors`` all-reduces a list of tensors inside or outside a ``tf.function``: they are fused into one
flat buffer per dtype and handed to ``TorusComm.allreduce`` through a single ``tf.numpy_function``, so every rank
issues the same messages in the same order (separate calls per tensor can deadlock). Where the shared-memory
transport runs the call the buffer is a persistent ``TorusComm.alloc`` array, fused into on the host and
reduced in place (window.py); elsewhere (other algorithms, several nodes, GPU tensors, shapes unknown when
traced) TensorFlow fuses and splits and the all-reduce runs out of place. ``broadcast_variables``
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

import pickle
import time
import warnings
import weakref
import zlib

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from torus import IN_PLACE, faults, kernels, knobs, recorder
from torus.errors import MismatchError
from torus.integrations.keras.collectives.buckets import BUCKET_BYTES, BUCKET_GROWTH, Buckets, allreduce_bucketed
from torus.integrations.keras.collectives.window import WindowBuffers
from torus.ops import BFLOAT16, DTYPES
from torus.runtime.progress import progress_for, threads_ok

COMPRESSION = {"none": None, "fp16": np.dtype(np.float16), "bf16": BFLOAT16}


def check_compression(compression: str):
    """The numpy wire dtype for ``compression`` ("none", "fp16" or "bf16"); ``ValueError`` otherwise."""
    if compression not in COMPRESSION:
        raise ValueError(f"compression {compression!r} not one of {', '.join(COMPRESSION)}")
    return COMPRESSION[compression]


SWITCH = {"0": False, "false": False, "off": False, "no": False, "1": True, "true": True, "on": True, "yes": True}


def resolve_overlap(torus_comm, overlap: bool | None) -> bool:
    """``HostAllreduce``'s ``overlap`` with its default (see there); warns once where MPI forbids it.
    ``TypeError`` for an ``overlap`` that is not a bool or None, ``ValueError`` for a ``TORUS_OVERLAP`` that is
    none of 0/1/false/true/off/on/no/yes (any case) or empty."""
    if overlap is not None and not isinstance(overlap, (bool, np.bool_)):
        raise TypeError(f"TorusStrategy on rank {torus_comm.rank}: overlap={overlap!r}: expected True, False or None")
    text = knobs.read("TORUS_OVERLAP").lower()
    if overlap is None and text and text not in SWITCH:
        raise ValueError(f"TorusStrategy on rank {torus_comm.rank}: TORUS_OVERLAP={text!r}: expected 0 or 1 "
                         "(or false/true, off/on, no/yes; unset or empty for the default)")
    asked = overlap if overlap is not None else SWITCH.get(text)
    wanted = asked if asked is not None else torus_comm.topology.nodes > 1
    if wanted and not threads_ok():
        if asked and not _warned:
            _warned.append(True)
            warnings.warn(f"TorusStrategy on rank {torus_comm.rank}: MPI gives thread level "
                          f"{MPI.Query_thread()}, below MPI_THREAD_SERIALIZED: the gradient all-reduce cannot run "
                          "on a communication thread, so it runs after backprop (no overlap)", stacklevel=3)
        return False
    if wanted and tf.config.threading.get_inter_op_parallelism_threads() == 1 and not _warned_inter_op:
        _warned_inter_op.append(True)
        warnings.warn(f"TorusStrategy on rank {torus_comm.rank}: overlap is on, but TensorFlow's inter-op pool has "
                      "one thread (tf.config.threading.set_inter_op_parallelism_threads(1)): a bucket's wait then "
                      "holds the only thread, so no bucket starts before backprop ends and nothing is hidden. Use 2 "
                      "threads or more (0, TensorFlow's default, is one per core), or overlap=False", stacklevel=3)
    return bool(wanted)


def resolve_bucket_bytes(torus_comm, bucket_bytes: int | None) -> int:
    """``bucket_bytes``, else ``TORUS_BUCKET_BYTES`` (unset or empty: ``BUCKET_BYTES``); an integer of at least
    1, else ``ValueError`` (``TypeError`` for a non-integer argument) naming the rank and where it came from."""
    rank = torus_comm.rank
    if bucket_bytes is None:
        text = knobs.read("TORUS_BUCKET_BYTES")
        digits = text.strip()
        if not digits:
            return BUCKET_BYTES
        if not (digits.isascii() and digits.isdigit()) or int(digits) < 1:  # not "１２３" nor "1_000"
            raise ValueError(f"TorusStrategy on rank {rank}: TORUS_BUCKET_BYTES={text!r}: expected a whole number "
                             "of bytes, at least 1 (e.g. 4194304)")
        return int(digits)
    if isinstance(bucket_bytes, (bool, np.bool_)) or not isinstance(bucket_bytes, (int, np.integer)):
        raise TypeError(f"TorusStrategy on rank {rank}: bucket_bytes={bucket_bytes!r}: expected an int (bytes)")
    if bucket_bytes < 1:
        raise ValueError(f"TorusStrategy on rank {rank}: bucket_bytes={bucket_bytes}: must be at least 1")
    return int(bucket_bytes)


_warned: list = []
_warned_inter_op: list = []


class HostAllreduce:
    """The host side of the fused all-reduce: called with one flat numpy buffer per dtype, returns new ones.

    float32 buffers travel as ``compression`` (float16/bfloat16, cast with ``torus.kernels.narrow`` and back
    with ``widen``; the reduction accumulates in float32 and rounds once per step of the schedule).
    ``window`` (default True): where the shared-memory transport runs the all-reduce, fuse into persistent
    ``TorusComm.alloc`` buffers instead (``in_window``, window.py; False keeps the out-of-place path
    everywhere, e.g. to compare). ``seconds`` accumulates the wall time spent here (for benchmarks).

    ``overlap``: inside a ``tf.function``, all-reduce in buckets of about ``bucket_bytes`` on the
    ``TorusComm``'s communication thread while the rest of the graph runs (buckets.py). ``None`` (default):
    ``TORUS_OVERLAP`` (``0``/``1``), else on where the ranks span several nodes. ``bucket_bytes``: ``None``:
    ``TORUS_BUCKET_BYTES``, else ``buckets.BUCKET_BYTES``. Where MPI does not allow a second thread
    (``MPI.Query_thread()`` below ``THREAD_SERIALIZED``) overlap stays off, with one warning if it was asked for;
    with one TensorFlow inter-op thread it stays on (the results are the same) with one warning: it hides nothing.
    Every call of this host, blocking or not, runs after the buckets queued before it
    (``torus.runtime.progress``: one collective at a time per ``TorusComm``). ``timeline``: a
    ``torus.timeline.Timeline`` (or None) that gets a span per all-reduce. ``sparse_as_dense``: where
    ``sparse.reduce_gradients`` densifies ``tf.IndexedSlices`` instead of all-gathering their rows.

    ``replica_apart`` (set by ``TorusStrategy``): the strategy's replica-context collectives (SyncBN's moments,
    the metric all-reduce) run on another ``TorusComm``, so the bucket starts need not wait for them in
    program order (buckets.py). Inside one graph, every op that hands work to this host runs after the one
    made before it (``after_previous`` / ``record``): the order every rank queues them in is the program's.
    """

    def __init__(self, torus_comm, algorithm: str = "auto", compression: str = "none", window: bool = True,
                 overlap: bool | None = None, bucket_bytes: int | None = None, timeline=None,
                 sparse_as_dense: bool = False):
        self.torus_comm, self.algorithm, self.window = torus_comm, algorithm, window
        self.wire = check_compression(compression)
        self._scratch: dict = {}
        self.windows = WindowBuffers(torus_comm)
        self.seconds, self.calls = 0.0, 0
        self.overlap = resolve_overlap(torus_comm, overlap)
        self.bucket_bytes = resolve_bucket_bytes(torus_comm, bucket_bytes)
        self.bucket_growth = BUCKET_GROWTH  # buckets.plan's ramp, read when a step is traced
        self.progress = progress_for(torus_comm)
        self.buckets = Buckets(self)
        self.timeline = timeline
        self.name, self.lane = "allreduce", "comm"  # its timeline spans
        self.sparse_as_dense = sparse_as_dense
        self.replica_apart = False
        self._last_op: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> its latest op here

    def after_previous(self) -> list:
        """Control inputs for the next op of this host in the graph being built: the op made before it there."""
        last = self._last_op.get(tf.compat.v1.get_default_graph())
        return [] if last is None else [last]

    def record(self, tensor) -> None:
        """``tensor``'s op is this host's latest in its graph (see ``after_previous``)."""
        self._last_op[tensor.graph] = tensor.op

    def comm_seconds(self) -> tuple[float, float]:
        """(communication, exposed) seconds so far: every all-reduce of this host, and the part the caller
        waited for (all of a blocking call; a bucket's wait in the graph, buckets.py)."""
        return self.seconds + self.buckets.comm_seconds, self.seconds + self.buckets.exposed_seconds

    def wire_of(self, dtype: np.dtype):
        return self.wire if self.wire is not None and dtype == np.float32 else None

    def in_window(self, tensors) -> bool:
        """Whether the group ``tensors`` (one dtype) is all-reduced through a shared ``TorusComm.alloc``
        buffer: ``window`` on, shapes known, host tensors, a dtype torus reduces, and the transport that
        ``algorithm`` resolves to for that many bytes in place is shm (every rank on one node). Decided when
        traced; the same on every rank for the same tensors."""
        tc = self.torus_comm
        if not self.window or tc.size == 1 or tc.topology.nodes != 1:
            return False
        if not all(t.shape.is_fully_defined() for t in tensors) or any(
                tf.DeviceSpec.from_string(t.device or "").device_type == "GPU" for t in tensors):
            return False
        dtype = np.dtype(tensors[0].dtype.as_numpy_dtype)
        count = sum(t.shape.num_elements() for t in tensors)
        if dtype not in DTYPES or count == 0:
            return False
        wire = self.wire_of(dtype) or dtype
        algo = self.algorithm if self.algorithm != "auto" else tc.auto_choice("allreduce", count * wire.itemsize,
                                                                               True)
        return algo == "shm"

    def __call__(self, op: str, *bufs, groups=None):
        """All-reduce ``bufs``: one flat buffer per group, or, for a group of ``groups`` (a tuple of piece
        counts, 0 for a flat buffer) that is positive, that many pieces fused in a window."""
        return self.progress.call(self._reduce, op, bufs, groups)

    def _reduce(self, op: str, bufs, groups):
        t0 = time.perf_counter()
        out, k = [], 0
        recorder.caller.value = f"keras {self.name}"
        try:
            for n in groups or (0,) * len(bufs):
                if n:
                    pieces = [np.asarray(b) for b in bufs[k:k + n]]
                    out += self.windows.allreduce(pieces, op, self.algorithm, self.wire_of(pieces[0].dtype))
                else:
                    out.append(self._one(np.asarray(bufs[k]), op))
                k += n or 1
        finally:
            recorder.caller.value = "user"
        t1 = time.perf_counter()
        self.seconds += t1 - t0
        self.calls += 1
        if self.timeline is not None:
            nbytes = int(sum(np.asarray(b).nbytes for b in bufs))
            algorithm = self.algorithm if self.algorithm != "auto" else \
                self.torus_comm.auto_choice("allreduce", nbytes, True)  # auto's pick for the total
            self.timeline.span(self.name, self.lane, t0, t1, nbytes=nbytes, algorithm=algorithm)
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

    With ``host.overlap`` on, inside a ``tf.function`` and for fully defined shapes, the tensors are
    all-reduced in buckets on the communication thread, each starting as soon as its tensors exist
    (buckets.py); otherwise in one fused call per dtype after all of them exist.
    """
    dense = [tf.convert_to_tensor(t) for t in tensors]
    if not dense:
        return []
    if host.overlap and not tf.executing_eagerly() and all(t.shape.is_fully_defined() for t in dense):
        return allreduce_bucketed(host, dense, op)
    dtypes = list(dict.fromkeys(t.dtype for t in dense))
    groups = [[i for i, t in enumerate(dense) if t.dtype == dt] for dt in dtypes]
    windowed = [host.in_window([dense[i] for i in g]) for g in groups]
    inputs, pieces = [], []
    for g, w in zip(groups, windowed):
        inputs += [dense[i] for i in g] if w else [tf.concat([tf.reshape(dense[i], [-1]) for i in g], 0)]
        pieces.append(len(g) if w else 0)
    layout = tuple(pieces)
    graph = not tf.executing_eagerly()
    with tf.control_dependencies(host.after_previous() if graph else []):
        reduced = tf.numpy_function(lambda *bufs: host(op, *bufs, groups=layout), inputs,
                                    [t.dtype for t in inputs], stateful=True, name="torus_allreduce")
    if not isinstance(reduced, (list, tuple)):  # eagerly, a one-element Tout comes back as a bare tensor
        reduced = [reduced]
    if graph:
        host.record(reduced[0])
    result: list = [None] * len(dense)
    k = 0
    for g, w in zip(groups, windowed):
        if w:  # one output per tensor, its shape
            for i in g:
                result[i] = reduced[k]
                result[i].set_shape(dense[i].shape)
                k += 1
            continue
        fused = reduced[k]
        fused.set_shape(inputs[k].shape)
        k += 1
        for i, part in zip(g, tf.split(fused, tf.stack([tf.size(dense[i]) for i in g]), num=len(g))):
            result[i] = tf.reshape(part, tf.shape(dense[i]))
            result[i].set_shape(dense[i].shape)
    return result


def stall_timeout(torus_comm):
    """Seconds ``torus_comm``'s collectives wait without progress before ``TimeoutError`` (None: forever)."""
    # TorusComm keeps the resolved value (argument, TORUS_TIMEOUT, default) on its executor only.
    return torus_comm._executor.timeout


def wait_for_every_rank(torus_comm, what: str) -> None:
    """``MPI_Ibarrier`` on ``torus_comm``'s communicator, waited at most the stall timeout without progress,
    else ``torus.errors.TimeoutError`` naming ``what`` and this rank. Collective; nothing at one rank."""
    if torus_comm.size == 1:
        return
    timeout, rank = stall_timeout(torus_comm), torus_comm.rank
    faults.wait(torus_comm.comm.Ibarrier(), timeout, lambda: (
        f"{what} on rank {rank}: no progress for {timeout:g} s waiting for every rank: some rank did not "
        "get here (it raised, exited, is stuck, or skipped this call); abort the job"))


def gather_records(comm, mine: np.ndarray, timeout, stalled) -> np.ndarray:
    """Every rank's int64 record ``mine`` (the same length on every rank), shape ``(comm.size, mine.size)``:
    one ``MPI_Iallgather`` over ``comm``, waited at most ``timeout`` s without progress, else
    ``torus.errors.TimeoutError`` with the message ``stalled()``. Collective."""
    every = np.empty((comm.Get_size(), mine.size), np.int64)
    faults.wait(comm.Iallgather(mine, every), timeout, stalled)
    return every


def broadcast_variables(torus_comm, variables, root: int = 0, what: str = "broadcast_variables") -> None:
    """Assign rank ``root``'s values to ``variables`` (Keras or tf variables) on every rank. Eager only;
    collective: every rank passes the same variables (count, shapes, dtypes, order).

    First ``check_same_variables`` (``MismatchError`` on every rank, before any value moves); then one
    ``MPI_Ibcast`` per dtype. Each wait is bounded by ``torus_comm``'s stall timeout: a rank that never calls
    (raised, exited, stuck) turns into ``torus.errors.TimeoutError`` on the others instead of a hang. ``what``
    names the operation in the errors."""
    variables = list(variables)
    rank, timeout = torus_comm.rank, stall_timeout(torus_comm)
    check_same_variables(torus_comm, variables, root, what)
    for dt in dict.fromkeys(v.dtype for v in variables):
        group = [v for v in variables if v.dtype == dt]
        flat = np.concatenate([np.asarray(v.numpy() if hasattr(v, "numpy") else v).reshape(-1)
                               for v in group])
        stalled = (f"{what} on rank {rank}: no progress for {timeout} s broadcasting {flat.nbytes} "
                   f"bytes of {dt} from rank {root}: some rank died or is stuck; abort the job")
        faults.wait(torus_comm.comm.Ibcast(flat.view(np.uint8), root=root), timeout, lambda stalled=stalled: stalled)
        offset = 0
        for v in group:
            n = int(np.prod(v.shape))
            v.assign(flat[offset:offset + n].reshape(tuple(v.shape)))
            offset += n


def check_same_variables(torus_comm, variables, root: int = 0, what: str = "broadcast_variables") -> None:
    """Compare every rank's list of ``variables`` (count, then shapes and dtypes in order) with rank ``root``'s:
    one small ``MPI_Iallgather`` (bounded by the stall timeout, ``torus.errors.TimeoutError`` naming ``what`` and
    this rank). Where they differ, ``MismatchError`` on every rank, naming the ranks and the first variable that
    differs; where the difference is a Keras optimizer that holds no slot variables on some ranks, the error says
    why (``_slotless_optimizers``): one loaded from an ``.h5`` file, or one not built yet. Reads only the
    variables' shapes, dtypes and names, so it can run inside a ``tf.numpy_function``. Collective."""
    variables = list(variables)
    comm, rank, size = torus_comm.comm, torus_comm.rank, torus_comm.size
    timeout = stall_timeout(torus_comm)
    layout = _layout(variables)
    mine = np.array([len(variables), zlib.crc32(repr([(s, d) for _, s, d in layout]).encode())], np.int64)
    every = gather_records(comm, mine, timeout, lambda: (
        f"{what} on rank {rank}: no progress for {timeout:g} s checking every rank's variable "
        "list: some rank did not call it (it raised, exited or is stuck); abort the job"))
    differ = [r for r in range(size) if (every[r] != every[root]).any()]
    if differ:  # the same on every rank: all of them take this branch and its collective
        raise MismatchError(_mismatch(torus_comm, variables, layout, root, differ, every, what))


def _layout(variables) -> list:
    """(name, shape, dtype) of each variable: its Keras ``path`` (a tf.Variable's ``name``)."""
    return [(str(getattr(v, "path", None) or getattr(v, "name", "?")), tuple(int(d) for d in v.shape), str(v.dtype))
            for v in variables]


def _slotless_optimizers(variables) -> list:
    """(name, built) of each Keras optimizer whose ``iterations`` variable is among ``variables`` and that holds
    nothing but its iteration count and learning rate. Keras 3.15's ``.h5`` loader (``keras.models.load_model``)
    builds the optimizer for the model's own directly held variables, none for a Sequential or functional
    model, and drops the saved optimizer state: such an optimizer says ``built`` and has no slots. Only looked
    for once the lists differ (it walks the heap for optimizers)."""
    import gc

    import keras

    ids = {id(v) for v in variables}
    found = []
    for obj in gc.get_objects():
        if not isinstance(obj, keras.optimizers.Optimizer):
            continue
        try:
            iterations, own = obj.iterations, list(obj.variables)
        except Exception:  # a half-built optimizer must not hide the mismatch
            continue
        if id(iterations) not in ids:
            continue
        prefix = str(getattr(iterations, "path", "")).rpartition("/")[0]
        if prefix and all(str(getattr(v, "path", "")) in (f"{prefix}/iteration", f"{prefix}/learning_rate")
                          for v in own):
            found.append((prefix, bool(obj.built)))
    return found


def _mismatch(torus_comm, variables, layout, root, differ, every, what) -> str:
    """The ``MismatchError`` message; collective (one ``allgather`` of every rank's layout and suspects)."""
    comm, rank, timeout = torus_comm.comm, torus_comm.rank, stall_timeout(torus_comm)

    def stalled():
        return f"{what} on rank {rank}: no progress for {timeout:g} s comparing variable lists: abort the job"

    mine = np.frombuffer(pickle.dumps((layout, _slotless_optimizers(variables))), np.uint8)
    sizes = gather_records(comm, np.array([mine.size], np.int64), timeout, stalled)[:, 0]
    blob = np.empty(int(sizes.sum()), np.uint8)
    faults.wait(comm.Iallgatherv(mine, [blob, [int(n) for n in sizes]]), timeout, stalled)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    got = [pickle.loads(blob[bounds[r]:bounds[r + 1]].tobytes()) for r in range(len(sizes))]
    counts = [int(c) for c in every[:, 0]]
    for built in (True, False):
        low = [r for r, (_, suspects) in enumerate(got) if any(b == built for _, b in suspects)]
        if not low:
            continue
        full = [r for r, (_, suspects) in enumerate(got) if not suspects and counts[r] > min(counts[k] for k in low)]
        if not full:
            continue
        name = next(p for p, b in got[low[0]][1] if b == built)
        if built:
            import keras

            return (f"{what} on rank {rank}: the optimizer {name!r} on rank(s) {low} says it is built but holds "
                    f"no slot variables ({counts[low[0]]} variables in all there, {counts[full[0]]} on rank(s) "
                    f"{full}). Keras {keras.__version__} loads an optimizer from an .h5 file that way: "
                    "keras.models.load_model / hvd.load_model of a .h5 builds it for no variables and drops the "
                    "saved optimizer state, and plain Keras then fails in fit with 'Unknown variable'. The model "
                    "is not at fault: save checkpoints as .keras instead of .h5 (model.save('model.keras'), "
                    "ModelCheckpoint('checkpoint-{epoch}.keras')) and resume from those, or compile the loaded "
                    "model with a fresh optimizer")
        return (f"{what} on rank {rank}: the optimizer {name!r} is not built on rank(s) {low} (no slot "
                f"variables) but is on rank(s) {full}: build it on every rank before broadcasting "
                "(optimizer.build(model.trainable_variables))")
    r, lay, lay_root = differ[0], got[differ[0]][0], got[root][0]
    k = next((i for i, (a, b) in enumerate(zip(lay, lay_root)) if a[1:] != b[1:]), min(len(lay), len(lay_root)))
    here = " ".join(map(str, lay[k])) if k < len(lay) else "nothing"
    there = " ".join(map(str, lay_root[k])) if k < len(lay_root) else "nothing"
    return (f"{what} on rank {rank}: rank(s) {differ} hold other variables than rank {root} (count {counts} "
            f"per rank, or shapes/dtypes differ; first difference: variable {k} is {here} on rank {r}, {there} "
            f"on rank {root}): build the same model and optimizer on every rank")
