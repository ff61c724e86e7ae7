"""Gradient buckets all-reduced on the communication thread while TensorFlow computes the rest of backprop.

``allreduce_bucketed(host, tensors, op)`` is ``allreduce_tensors`` inside a ``tf.function`` when
``host.overlap`` is on. At trace time the tensors are grouped into buckets (``plan``: reverse list order, which
for a model's gradients is about the order backprop produces them; one dtype per bucket; the first bucket at
most ``FIRST_BUCKET_BYTES`` as in PyTorch DDP, each next one's cap ``host.bucket_growth`` times the one before,
up to ``host.bucket_bytes``: why, docs/design.md, "Gradient buckets"). Per bucket the graph gets

- a *start* op (``tf.numpy_function``; stateless where ``host.replica_apart``, so that no earlier stateful op
  such as a SyncBN all-reduce gates it in program order) whose inputs are only that bucket's tensors, so
  TensorFlow runs it as soon as they exist: it copies them (cast to the wire dtype where compressed) into the
  bucket's persistent buffer, queues the bucket's all-reduce on the ``TorusComm``'s communication thread
  (``torus.runtime.progress``) and returns a token. Each start has a control dependency on the previous op of
  its host (``after_previous``): every rank queues the buckets in the order of ``plan``, fixed by the model,
  never by readiness;
- a *wait* op taking that token and the last start's token: it runs only after every start (a blocked wait
  must not hold one of TensorFlow's inter-op threads while backprop still needs it), blocks until the
  bucket is reduced (the GIL released), re-raises the thread's error, and returns the bucket's result.

The reduction itself is ``TorusComm.allreduce`` of the whole bucket with the host's algorithm (where that is the
shared-memory transport, in place in a ``TorusComm.alloc`` buffer per bucket: window.py), so every algorithm,
transport and compression works per bucket as for the fused buffer. The first time a layout (its buckets'
dtypes and sizes, the op, the wire format) runs, the ranks agree on it in its first start, before any of its
buckets moves (``MismatchError`` naming the ranks that differ and both layouts; inside a ``tf.function`` it
reaches the caller as TensorFlow wraps a Python error of a ``tf.numpy_function``: a ``tf.errors.OpError``,
here ``InvalidArgumentError`` as for any ``ValueError``, whose message starts with it). Results are bitwise
equal across ranks; against one fused buffer they differ only by float summation order (chunks fall
elsewhere).

Program order, the timing kept per host and the timeline spans: docs/design.md ("Gradient buckets").
"""
from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
import tensorflow as tf

from torus import IN_PLACE, agreement, kernels, recorder
from torus.errors import MismatchError
from torus.errors import TimeoutError as TorusTimeout
from torus.integrations.keras.collectives.window import pack

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20  # the default cap (TORUS_BUCKET_BYTES); bench/overlap.py measures it
BUCKET_GROWTH = 2.0  # each bucket's cap over the one before (inf: DDP's rule); bench/overlap.py --bucket-growth
MAX_STAGING = 64  # bucket buffers kept per host (a model's buckets; layouts seen before, least recent freed)


def plan(sizes_bytes: list[int], dtypes: list, cap: int, first_cap: int = FIRST_BUCKET_BYTES,
         growth: float = BUCKET_GROWTH) -> list[list[int]]:
    """Buckets of tensor indices: walk the indices last to first, add each to the open bucket of its dtype,
    close a bucket once it holds at least its cap: ``min(cap, first_cap * growth**k)`` for the k-th bucket
    opened (``growth`` >= 1; ``inf`` gives PyTorch DDP's rule, ``first_cap`` then ``cap``).
    Returns the buckets in the order they were opened (each one's indices in walk order). Pure."""
    if not growth >= 1:
        raise ValueError(f"buckets.plan: growth={growth!r}: must be at least 1")
    buckets: list[list[int]] = []
    sizes: list[int] = []
    caps: list[float] = []
    next_cap: float = min(cap, first_cap)  # kept at most cap: growth ** k alone overflows a float past ~1,000 buckets
    open_: dict = {}
    for i in reversed(range(len(sizes_bytes))):
        b = open_.get(dtypes[i])
        if b is None:
            b = open_[dtypes[i]] = len(buckets)
            buckets.append([])
            sizes.append(0)
            caps.append(next_cap)
            next_cap = min(cap, next_cap * growth)
        buckets[b].append(i)
        sizes[b] += sizes_bytes[i]
        if sizes[b] >= caps[b]:
            del open_[dtypes[i]]
    return buckets


class Buckets:
    """The host side of the bucketed all-reduce of one ``HostAllreduce``: staging buffers, tokens, layout
    agreement, time. ``start`` and ``wait`` run inside the graph's ``tf.numpy_function`` ops."""

    def __init__(self, host):
        self.host = host
        self._staging: OrderedDict = OrderedDict()  # (layout, bucket) -> buffer the start copies into
        self._pending: dict = {}  # token -> Future of the bucket's result
        self._layouts: list = []  # layout id -> (op, wire name, ((dtype, count), ...))
        self._agreed: set = set()
        self._tokens = 0
        self.steps = 0  # gradient steps of this process (bucket 0 starts one)
        self.comm_seconds = self.exposed_seconds = 0.0
        self.buckets_run = 0

    def layout_id(self, op: str, groups: list) -> int:
        """A small id for a layout, made at trace time: ``groups`` is [(numpy dtype, element count)]."""
        key = (op, tuple((np.dtype(d).str, int(n)) for d, n in groups))
        if key not in self._layouts:
            self._layouts.append(key)
        return self._layouts.index(key)

    def _buffer(self, layout: int, bucket: int, dtype: np.dtype, count: int, windowed: bool) -> np.ndarray:
        key = (layout, bucket)
        buf = self._staging.get(key)
        if buf is not None:
            self._staging.move_to_end(key)
            return buf
        if windowed:  # a shared TorusComm.alloc buffer: collective, so it is made on the communication thread
            buf = self.host.progress.call(self.host.windows.bucket_window, key, dtype, count)
        else:
            buf = np.empty(count, dtype)
        self._staging[key] = buf
        while len(self._staging) > MAX_STAGING:  # every rank drops the same one (same calls, same order)
            old_key, old = self._staging.popitem(last=False)
            self.host.progress.call(self.host.windows.free_bucket, old_key)
        return buf

    def start(self, layout: int, bucket: int, windowed: bool, pieces) -> np.int64:
        """Copy ``pieces`` (numpy arrays, one dtype) into the bucket's buffer, queue its all-reduce; a token."""
        t0 = time.perf_counter()
        host, dtype = self.host, pieces[0].dtype
        wire = host.wire_of(dtype)
        count = sum(p.size for p in pieces)
        if bucket == 0 and layout not in self._agreed:  # before any bucket of it moves or gets a shared buffer
            host.progress.call(self._agree, layout)
            self._agreed.add(layout)
        if bucket == 0:
            self.steps += 1  # for the flight recorder's caller: this process' gradient step, counted from 1
        buf = self._buffer(layout, bucket, wire or dtype, count, windowed)
        pack(pieces, buf, wire is not None)  # TensorFlow may reuse the inputs' memory once this op returns
        self._tokens += 1
        token = self._tokens
        self._pending[token] = host.progress.submit(self._reduce, layout, bucket, buf, dtype, wire, windowed,
                                                    self.steps)
        if host.timeline is not None:
            host.timeline.span(f"bucket {bucket} start", "start", t0, time.perf_counter(), bucket=bucket,
                               nbytes=int(buf.nbytes))
        return np.int64(token)

    def wait(self, token) -> np.ndarray:
        """The reduced bucket of ``token`` (a fresh array in the tensors' dtype); re-raises the thread's error."""
        t0 = time.perf_counter()
        future = self._pending.pop(int(token))
        try:
            out, bucket = future.result()
        finally:
            t1 = time.perf_counter()
            self.exposed_seconds += t1 - t0
        if self.host.timeline is not None:
            self.host.timeline.span(f"bucket {bucket} wait", "wait", t0, t1, bucket=bucket)
        return out

    def _reduce(self, layout: int, bucket: int, buf: np.ndarray, dtype: np.dtype, wire, windowed: bool,
                step: int):
        """On the communication thread: all-reduce the bucket, cast back; returns (result, bucket)."""
        t0 = time.perf_counter()
        host, tc = self.host, self.host.torus_comm
        op = self._layouts[layout][0]
        recorder.caller.value = f"keras step {step} gradient bucket {bucket} (layout {layout})"
        try:
            if wire is None and not windowed:
                out = tc.allreduce(buf, np.empty_like(buf), op=op, algorithm=host.algorithm)
            else:
                tc.allreduce(IN_PLACE, buf, op=op, algorithm=host.algorithm)
        finally:
            recorder.caller.value = "user"
        if wire is not None or windowed:
            out = np.empty(buf.size, dtype)
            if wire is None:
                np.copyto(out, buf)
            else:
                kernels.widen(buf, out)
        t1 = time.perf_counter()
        self.comm_seconds += t1 - t0
        self.buckets_run += 1
        if host.timeline is not None:
            algorithm = host.algorithm if host.algorithm != "auto" else tc.auto_choice("allreduce", buf.nbytes, True)
            host.timeline.span(f"bucket {bucket} allreduce", "comm", t0, t1, bucket=bucket, nbytes=int(buf.nbytes),
                               algorithm=algorithm, wire=str(buf.dtype), op=op)
        return out, bucket

    def _describe(self, layout: int) -> str:
        op, groups = self._layouts[layout]
        sizes = ", ".join(f"{np.dtype(d).name}[{n}]" for d, n in groups)
        return f"{len(groups)} bucket{'s' if len(groups) != 1 else ''} ({sizes}), op {op}"

    def _agree(self, layout: int) -> None:
        tc = self.host.torus_comm
        rank, timeout = tc.rank, tc._executor.timeout
        # a collective on the TorusComm's communicator: in the flight record, so that the doctor can name a
        # rank whose layout differs (its count) or that agrees while the others already reduce (its operation)
        groups = self._layouts[layout][1]
        recorder.caller.value = f"keras step {self.steps + 1} gradient bucket layout {layout}"
        record = tc.recorder.begin("bucket layout agreement", sum(n for _, n in groups), np.dtype(groups[0][0]),
                                   "allgather") if tc.recorder.capacity and groups else None
        try:
            self._agree_or_raise(layout, tc, rank, timeout)
        except BaseException as exc:
            if record is not None:
                recorder.fail(record, exc)
                if isinstance(exc, TorusTimeout):
                    recorder.on_stall(tc.recorder, exc)
            raise
        finally:
            recorder.caller.value = "user"
        if record is not None:
            recorder.end(record)

    def _agree_or_raise(self, layout: int, tc, rank: int, timeout) -> None:
        differ, texts = agreement.texts_that_differ(tc.comm, self._describe(layout), timeout, lambda: (
            f"allreduce of gradient buckets on rank {rank}: no progress for {timeout:g} s agreeing on the bucket "
            "layout: some rank did not reach this step (it raised, exited or is stuck)"))
        if differ:
            raise MismatchError(
                f"allreduce of gradient buckets on rank {rank}: {agreement.ranks_text(differ)} bucket the "
                f"gradients differently from rank 0 (rank 0: {texts[0]}; rank {differ[0]}: {texts[differ[0]]}): "
                "every rank must build the same model (same trainable variables, shapes and dtypes, in the same "
                "order) and the same TorusStrategy(bucket_bytes=..., compression=...)")


def allreduce_bucketed(host, dense: list, op: str) -> list:
    """The graph side: starts and waits for ``dense`` (tensors of fully defined shapes); see the module
    docstring. Returns tensors of the same shapes and dtypes, in the same order."""
    nbytes = [t.shape.num_elements() * t.dtype.size for t in dense]
    buckets = plan(nbytes, [t.dtype for t in dense], host.bucket_bytes, growth=host.bucket_growth)
    buckets = [b for b in buckets if sum(nbytes[i] for i in b)]  # nothing to send for empty tensors
    groups = [(dense[b[0]].dtype.as_numpy_dtype, sum(dense[i].shape.num_elements() for i in b)) for b in buckets]
    layout = host.buckets.layout_id(op, groups)
    result = [tf.zeros_like(t) for t in dense]  # empty tensors (the only ones left out) are their own result
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
    for k, b in enumerate(buckets):
        fused = tf.numpy_function(lambda token, last: host.buckets.wait(token), [tokens[k], tokens[-1]],
                                  dense[b[0]].dtype, stateful=True, name=f"torus_bucket{k}_wait")
        fused.set_shape([groups[k][1]])
        parts = tf.split(fused, [dense[i].shape.num_elements() for i in b], num=len(b))
        for i, part in zip(b, parts):
            result[i] = tf.reshape(part, dense[i].shape)
    return result
