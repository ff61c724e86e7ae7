"""The host side of every all-reduce of tensors: one routine per bucket (reducer.py builds the graph around it).

A bucket is a group of tensors of one dtype, all-reduced as one buffer. Its routine has two halves:

- ``pack`` (in the op that receives the tensors: TensorFlow may reuse their memory once it returns): copy them,
  cast to the wire format where compressed (``torus.kernels.narrow``), into the bucket's buffer. That is a
  persistent ``TorusComm.alloc`` window where the shared-memory transport runs the all-reduce (every rank
  reduces its chunk reading the peers' buffers where they lie: window.py), else a persistent staging array;
- ``reduce`` (inline, or on the communication thread while backprop goes on): ``TorusComm.allreduce`` of the
  buffer, in place (out of place into a fresh array where the buffer is a staging array in the tensors' own
  dtype), then unpack: one array per tensor, views of that fresh array or copies (widened where compressed)
  into reusable aligned output buffers (window.py). One timeline span, one flight-recorder caller.

``run`` does both halves for every bucket of one call, inline (overlap off, eager calls, shapes unknown when
traced). ``start`` and ``wait`` split them (overlap on): ``start`` packs, agrees on the layout the first time it
runs (its buckets' dtypes and sizes, the op, the wire format: ``MismatchError`` naming the ranks that differ,
before any bucket moves) and queues ``reduce`` on the ``TorusComm``'s communication thread
(``torus.runtime.progress``); ``wait`` returns the arrays and re-raises the thread's error. Buffers are kept per
(layout, bucket), at most ``MAX_STAGING`` per host, the least recently used freed (collective for a window:
every rank makes the same calls in the same order).

``plan`` groups tensors into buckets for overlap: reverse list order, which for a model's gradients is about
the order backprop produces them (why, and the ramp of caps: docs/design.md, "Gradient buckets").
"""
from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from torus import IN_PLACE, agreement, kernels, recorder
from torus.errors import MismatchError
from torus.errors import TimeoutError as TorusTimeout

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20  # the default cap (TORUS_BUCKET_BYTES); bench/overlap/overlap.py measures it
BUCKET_GROWTH = 2.0  # each bucket's cap over the one before (inf: DDP's rule); bench/overlap/overlap.py --bucket-growth
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


def by_dtype(dtypes: list) -> list[list[int]]:
    """One bucket per dtype, in the order the dtypes first appear, each one's indices in list order. Pure."""
    return [[i for i, d in enumerate(dtypes) if d == dt] for dt in dict.fromkeys(dtypes)]


def pack(pieces, buf: np.ndarray, narrow: bool) -> None:
    """Copy the numpy arrays ``pieces`` (one dtype, any shapes) one after another into the first elements of
    the flat ``buf``, cast with ``kernels.narrow`` (float32 to buf's float16/bfloat16) where ``narrow``; one
    pass, no temporary. ``buf`` must hold at least their total size."""
    offset = 0
    for p in pieces:
        part = buf[offset:offset + p.size]
        if narrow:
            kernels.narrow(p.reshape(-1), part)
        else:
            np.copyto(part, p.reshape(-1))
        offset += p.size


def unpack(buf: np.ndarray, outputs: list, widen: bool) -> None:
    """``pack``'s inverse: consecutive slices of the flat ``buf`` into ``outputs`` (arrays of any shapes),
    widened with ``kernels.widen`` where ``widen``."""
    offset = 0
    for view in outputs:
        part = buf[offset:offset + view.size]
        if widen:
            kernels.widen(part, view.reshape(-1))
        else:
            np.copyto(view.reshape(-1), part)
        offset += view.size


def views(flat: np.ndarray, shapes: list) -> list:
    """Consecutive views of the flat ``flat``, one per shape."""
    out, offset = [], 0
    for shape in shapes:
        n = int(np.prod(shape, dtype=np.int64))
        out.append(flat[offset:offset + n].reshape(shape))
        offset += n
    return out


class Buckets:
    """The buckets of one ``HostAllreduce`` (reducer.py): buffers, the routine, tokens, layout agreement, time.
    ``steps``: gradient steps so far (bucket 0 of an overlapped call starts one); ``comm_seconds`` /
    ``exposed_seconds`` / ``buckets_run``: the overlapped buckets' all-reduce time, the time ``wait`` blocked,
    and how many ran; ``inline_seconds`` / ``inline_calls``: the same for ``run``'s calls (all of it exposed)."""

    def __init__(self, host):
        self.host = host
        self._staging: OrderedDict = OrderedDict()  # (layout, bucket) -> the buffer its pack fills
        self._pending: dict = {}  # token -> Future of the bucket's arrays
        self._layouts: dict = {}  # (op, ((dtype, count), ...)) -> layout id
        self._describe_of: list = []  # layout id -> that key
        self._agreed: set = set()
        self._tokens = 0
        self.steps = 0
        self.comm_seconds = self.exposed_seconds = self.inline_seconds = 0.0
        self.buckets_run = self.inline_calls = 0

    def layout_id(self, op: str, groups) -> int:
        """A small id for an overlapped call's layout, made at trace time: ``groups`` is [(numpy dtype, element
        count)] per bucket."""
        key = (op, tuple((np.dtype(d).str, int(n)) for d, n in groups))
        found = self._layouts.get(key)
        if found is None:
            found = self._layouts[key] = len(self._describe_of)
            self._describe_of.append(key)
        return found

    def _buffer(self, key, dtype: np.dtype, count: int, windowed: bool) -> np.ndarray:
        """The persistent buffer of bucket ``key`` = (layout, bucket): a shared window (collective, so made on
        the communication thread) or a staging array."""
        buf = self._staging.get(key)
        if buf is not None:
            self._staging.move_to_end(key)
            return buf
        windows = self.host.windows
        buf = self.host.progress.call(windows.alloc, key, dtype, count) if windowed else np.empty(count, dtype)
        self._staging[key] = buf
        while len(self._staging) > MAX_STAGING:  # every rank drops the same one (same calls, same order)
            old_key, _ = self._staging.popitem(last=False)
            self.host.progress.call(windows.free, old_key)
        return buf

    def pack(self, key, windowed: bool, pieces) -> np.ndarray:
        """The routine's first half: the buffer of the bucket ``key`` (layout, bucket), filled with ``pieces``."""
        wire = self.host.wire_of(pieces[0].dtype)
        buf = self._buffer(key, wire or pieces[0].dtype, sum(p.size for p in pieces), windowed)
        pack(pieces, buf, wire is not None)
        return buf

    def reduce(self, bucket: int, buf: np.ndarray, op: str, dtype: np.dtype, shapes: list, windowed: bool,
               span: str, caller: str) -> list:
        """The routine's second half: all-reduce ``buf`` with ``op`` and unpack it into one array of ``dtype``
        per shape of ``shapes``, under the flight recorder's ``caller``, timed as the timeline span ``span``."""
        t0 = time.perf_counter()
        host, tc = self.host, self.host.torus_comm
        wire = host.wire_of(dtype)
        recorder.caller.value = caller
        try:
            if wire is None and not windowed:
                out = views(tc.allreduce(buf, np.empty_like(buf), op=op, algorithm=host.algorithm), shapes)
            else:
                tc.allreduce(IN_PLACE, buf, op=op, algorithm=host.algorithm)
                out = host.windows.outputs(dtype, shapes)
                unpack(buf, out, wire is not None)
        finally:
            recorder.caller.value = "user"
        if host.timeline is not None:
            algorithm = host.algorithm if host.algorithm != "auto" else tc.auto_choice("allreduce", buf.nbytes, True)
            host.timeline.span(span, host.lane, t0, time.perf_counter(), bucket=bucket, nbytes=int(buf.nbytes),
                               algorithm=algorithm, wire=str(buf.dtype), op=op)
        return out

    def run(self, op: str, arrays, groups, windowed) -> list:
        """Every bucket of one call, both halves inline: ``arrays`` are the tensors' values in bucket order,
        ``groups`` how many belong to each bucket, ``windowed`` whether each uses a window. Returns one array
        per tensor, in the same order. Run after every job queued before it: ``progress.call(run, ...)``."""
        t0 = time.perf_counter()
        arrays = [np.asarray(a) for a in arrays]
        firsts = [int(k) for k in np.cumsum([0, *groups])[:-1]]
        buckets = [arrays[k:k + n] for k, n in zip(firsts, groups)]
        layout = (op, tuple((b[0].dtype.str, sum(a.size for a in b)) for b in buckets))  # keys the buffers
        out: list = []
        for k, pieces in enumerate(buckets):
            buf = self.pack((layout, k), windowed[k], pieces)
            out += self.reduce(k, buf, op, pieces[0].dtype, [p.shape for p in pieces], windowed[k],
                               self.host.name, f"keras {self.host.name}")
        self.inline_seconds += time.perf_counter() - t0
        self.inline_calls += 1
        return out

    def start(self, layout: int, bucket: int, windowed: bool, pieces) -> np.int64:
        """Pack ``pieces`` (numpy arrays, one dtype) into the bucket's buffer, queue its reduce; a token."""
        t0 = time.perf_counter()
        host = self.host
        if bucket == 0 and layout not in self._agreed:  # before any bucket of it moves or gets a shared buffer
            host.progress.call(self._agree, layout)
            self._agreed.add(layout)
        if bucket == 0:
            self.steps += 1  # for the flight recorder's caller: this process' gradient step, counted from 1
        buf = self.pack((layout, bucket), windowed, pieces)
        self._tokens += 1
        token = self._tokens
        self._pending[token] = host.progress.submit(
            self._reduce_timed, bucket, buf, self._describe_of[layout][0], pieces[0].dtype,
            [p.shape for p in pieces], windowed, f"keras step {self.steps} gradient bucket {bucket} (layout {layout})")
        if host.timeline is not None:
            host.timeline.span(f"bucket {bucket} start", "start", t0, time.perf_counter(), bucket=bucket,
                               nbytes=int(buf.nbytes))
        return np.int64(token)

    def _reduce_timed(self, bucket, buf, op, dtype, shapes, windowed, caller) -> tuple[list, int]:
        t0 = time.perf_counter()
        out = self.reduce(bucket, buf, op, dtype, shapes, windowed, f"bucket {bucket} allreduce", caller)
        self.comm_seconds += time.perf_counter() - t0
        self.buckets_run += 1
        return out, bucket

    def wait(self, token) -> list:
        """The reduced arrays of ``token``'s bucket (one per tensor); re-raises the thread's error."""
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

    def _describe(self, layout: int) -> str:
        op, groups = self._describe_of[layout]
        sizes = ", ".join(f"{np.dtype(d).name}[{n}]" for d, n in groups)
        return f"{len(groups)} bucket{'s' if len(groups) != 1 else ''} ({sizes}), op {op}"

    def _agree(self, layout: int) -> None:
        tc = self.host.torus_comm
        rank, timeout = tc.rank, tc._executor.timeout
        # a collective on the TorusComm's communicator: in the flight record, so that the doctor can name a
        # rank whose layout differs (its count) or that agrees while the others already reduce (its operation)
        groups = self._describe_of[layout][1]
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
