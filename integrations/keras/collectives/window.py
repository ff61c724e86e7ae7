"""Gradients fused straight into shared memory: the all-reduce of ``allreduce_tensors`` where the shared-memory
transport runs it (``algorithm="shm"``, or ``"auto"`` where it picks shm: every rank on one node).

There the tensors reach ``tf.numpy_function`` one by one (no ``tf.concat``) and are copied, cast to the wire
format where compressed, into one persistent buffer from ``TorusComm.alloc`` per layout (dtype and element
count), which is all-reduced in place: every rank reduces its chunk reading the peers' buffers where they
lie, so the transport's copy in disappears (torus/runtime/shm.py). The results are copied out into views of a
reusable host buffer, one view per tensor (no ``tf.split``), each 64-byte aligned so that TensorFlow takes it
without a copy.

Why reusing the output is safe: inside a graph TensorFlow keeps the returned arrays as the output tensors'
memory, holding a Python reference to them until the tensors die. A buffer is reused only when nothing but
this module refers to it (its reference count); otherwise, e.g. a custom loop that returned the gradients from
its ``tf.function`` and keeps them, another one is made (at most ``POOL`` per layout are kept).

Bounded: ``MAX_LAYOUTS`` shared buffers per ``WindowBuffers``; the least recently used is freed (collective:
every rank sees the same calls in the same order, so every rank frees the same one at the same call).
"""
from __future__ import annotations

import sys
from collections import OrderedDict

import numpy as np

from torus import IN_PLACE, kernels
from torus.errors import MismatchError

ALIGN = 64  # bytes: TensorFlow shares a numpy_function output's memory only at its alignment (EIGEN_MAX_ALIGN_BYTES)
MAX_LAYOUTS = 8  # shared buffers kept (a model's gradients, its metric states, a few more)
POOL = 2  # output buffers kept per layout


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


def _unused(entry) -> bool:
    """Nothing outside the pool refers to an output buffer: its views only by the pool's list (and here), its
    base only by the pool's tuple and the views (TensorFlow holds a returned view, or an array made from one,
    while the tensor lives)."""
    base, views = entry
    return sys.getrefcount(base) == len(views) + 3 and all(sys.getrefcount(v) == 3 for v in views)


class WindowBuffers:
    """The shared buffers and output buffers of one ``HostAllreduce``. ``windows``: how many shared buffers it
    holds now; ``made``: how many it has allocated so far."""

    def __init__(self, torus_comm):
        self.torus_comm = torus_comm
        self._shared: OrderedDict = OrderedDict()  # (wire dtype, count) -> TorusComm.alloc array
        self._plain: set = set()  # keys whose buffer is an ordinary array (/dev/shm too small)
        self._outputs: dict = {}  # (dtype, sizes) -> [(base, views)]
        self._buckets: dict = {}  # bucket slot -> TorusComm.alloc array
        self.made = 0

    @property
    def windows(self) -> int:
        return len(self._shared)

    def _window(self, wire: np.dtype, count: int) -> np.ndarray:
        key = (wire, count)
        buf = self._shared.get(key)
        if buf is not None:
            self._shared.move_to_end(key)
            return buf
        if len(self._shared) >= MAX_LAYOUTS:
            old_key, old = self._shared.popitem(last=False)
            if old_key not in self._plain:
                self.torus_comm.free_alloc(old)
            self._plain.discard(old_key)
        try:
            buf = self.torus_comm.alloc(count, wire)
        except MismatchError as e:  # alloc's agreement is the first collective of an all-reduce of a new size
            raise MismatchError(f"allreduce of tensors on rank {self.torus_comm.rank}: ranks passed tensors of "
                                f"another total size or dtype (their fused buffer: {e})") from e
        except MemoryError:  # the node's /dev/shm cannot hold it (raised on every rank): an ordinary buffer,
            buf = np.empty(count, wire)  # all-reduced in place by the ordinary path (one copy in more)
            self._plain.add(key)
        self._shared[key] = buf
        self.made += 1
        return buf

    def bucket_window(self, slot, wire: np.dtype, count: int) -> np.ndarray:
        """A shared buffer of its own for the gradient bucket ``slot`` (buckets.py; apart from the fused
        layouts, so that two buckets of one size never share one); an ordinary array where /dev/shm is too
        small. Collective, like ``TorusComm.alloc``."""
        try:
            buf = self.torus_comm.alloc(count, wire)
        except MemoryError:
            buf = np.empty(count, wire)
        else:
            self._buckets[slot] = buf
            self.made += 1
        return buf

    def free_bucket(self, slot) -> None:
        """Free ``slot``'s shared buffer, if it has one (collective)."""
        buf = self._buckets.pop(slot, None)
        if buf is not None:
            self.torus_comm.free_alloc(buf)

    def _output(self, dtype: np.dtype, pieces) -> list:
        """Views (one per piece, its shape, ALIGN-aligned) of an output buffer nothing else refers to."""
        key = (dtype, tuple(p.shape for p in pieces))
        pool = self._outputs.setdefault(key, [])
        for entry in pool:
            if _unused(entry):
                return entry[1]
        step = ALIGN // dtype.itemsize
        sizes = [p.size for p in pieces]
        offsets = np.cumsum([0] + [-(-n // step) * step for n in sizes])
        base = np.empty(int(offsets[-1]) + step, dtype)
        first = (-base.ctypes.data % ALIGN) // dtype.itemsize
        views = [base[first + o:first + o + n].reshape(p.shape) for o, n, p in zip(offsets, sizes, pieces)]
        if len(pool) < POOL:
            pool.append((base, views))
        return views

    def allreduce(self, pieces, op: str, algorithm: str, wire: np.dtype | None) -> list:
        """All-reduce the numpy arrays ``pieces`` (one dtype, any shapes) as one buffer of the ``wire`` dtype
        (float16/bfloat16 for float32 pieces, or None: their own); returns arrays of the same shapes (views
        that stay valid until the caller drops them). Collective, like ``TorusComm.allreduce``."""
        dtype = pieces[0].dtype
        on_wire = wire or dtype
        window = self._window(on_wire, sum(p.size for p in pieces))
        pack(pieces, window, wire is not None)
        self.torus_comm.allreduce(IN_PLACE, window, op=op, algorithm=algorithm)
        out, offset = self._output(dtype, pieces), 0
        for view in out:
            part = window[offset:offset + view.size]
            if wire is None:
                np.copyto(view.reshape(-1), part)
            else:
                kernels.widen(part, view.reshape(-1))
            offset += view.size
        return out
