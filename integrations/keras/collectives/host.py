"""The settings of the Keras all-reduce of tensors: ``HostAllreduce`` and the knobs it resolves once.

A ``HostAllreduce`` is decided when made: its algorithm, the wire format of float32 buffers
(``compression``), whether a bucket uses a shared window (``window``, ``in_window``), whether buckets overlap
backprop (``overlap``: argument, ``TORUS_OVERLAP``, else on across nodes) and their cap (``bucket_bytes``:
argument, ``TORUS_BUCKET_BYTES``, else ``buckets.BUCKET_BYTES``). reducer.py builds the graph from these, and
buckets.py runs the buckets; nothing after construction branches on where the knobs came from.
"""
from __future__ import annotations

import warnings
import weakref

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from torus import knobs
from torus.integrations.keras.collectives.buckets import BUCKET_BYTES, BUCKET_GROWTH, Buckets
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
    """How one group of all-reduces of tensors runs: algorithm, wire format, window, overlap, buckets; the
    graph side is reducer.py, the host side buckets.py (its ``buckets``, and ``__call__`` for inline calls).

    float32 buffers travel as ``compression`` (float16/bfloat16, cast with ``torus.kernels.narrow`` and back
    with ``widen``; the reduction accumulates in float32 and rounds once per step of the schedule).
    ``window`` (default True): where the shared-memory transport runs the all-reduce, fuse into persistent
    ``TorusComm.alloc`` buffers instead (``in_window``, window.py; False keeps the out-of-place path
    everywhere, e.g. to compare). ``seconds`` / ``calls``: the wall time and number of inline calls.

    ``overlap``: inside a ``tf.function``, all-reduce in buckets of about ``bucket_bytes`` on the
    ``TorusComm``'s communication thread while the rest of the graph runs (buckets.py). ``None`` (default):
    ``TORUS_OVERLAP`` (``0``/``1``), else on where the ranks span several nodes. ``bucket_bytes``: ``None``:
    ``TORUS_BUCKET_BYTES``, else ``buckets.BUCKET_BYTES``. Where MPI does not allow a second thread
    (``MPI.Query_thread()`` below ``THREAD_SERIALIZED``) overlap stays off, with one warning if it was asked for;
    with one TensorFlow inter-op thread it stays on (the results are the same) with one warning: it hides nothing.
    Every call of this host, blocking or not, runs after the buckets queued before it
    (``torus.runtime.progress``: one collective at a time per ``TorusComm``). ``timeline``: a
    ``torus.timeline.Timeline`` (or None) that gets a span per all-reduce. ``sparse_as_dense``: where
    ``reducer.reduce_gradients`` densifies ``tf.IndexedSlices`` instead of all-gathering their rows.

    ``replica_apart`` (set by ``TorusStrategy``): the strategy's replica-context collectives (SyncBN's moments,
    the metric all-reduce) run on another ``TorusComm``, so the bucket starts need not wait for them in
    program order (reducer.py). Inside one graph, every op that hands work to this host runs after the one
    made before it (``after_previous`` / ``record``): the order every rank queues them in is the program's.
    """

    def __init__(self, torus_comm, algorithm: str = "auto", compression: str = "none", window: bool = True,
                 overlap: bool | None = None, bucket_bytes: int | None = None, timeline=None,
                 sparse_as_dense: bool = False):
        self.torus_comm, self.algorithm, self.window = torus_comm, algorithm, window
        self.wire = check_compression(compression)
        self.windows = WindowBuffers(torus_comm)
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

    def __call__(self, op: str, *arrays, groups=None, windowed=None) -> list:
        """All-reduce ``arrays`` (numpy) in buckets, both halves of the routine inline (``Buckets.run``) after
        every job queued before on the communication thread; one array per input, same shapes and dtypes.
        ``groups``: how many consecutive arrays form each bucket (default one each; a bucket's arrays share a
        dtype); ``windowed``: per bucket, whether it goes through a shared window (default none)."""
        groups = tuple(groups) if groups is not None else (1,) * len(arrays)
        windowed = tuple(windowed) if windowed is not None else (False,) * len(groups)
        return self.progress.call(self.buckets.run, op, arrays, groups, windowed)

    @property
    def seconds(self) -> float:
        """Wall seconds in inline calls so far (``Buckets.run``; benchmarks read it)."""
        return self.buckets.inline_seconds

    @property
    def calls(self) -> int:
        return self.buckets.inline_calls
