"""The buffers of the bucket routine (buckets.py) that outlive a call: shared windows and output buffers.

A bucket all-reduced by the shared-memory transport (``algorithm="shm"``, or ``"auto"`` where it picks shm:
every rank on one node) is packed into a persistent buffer from ``TorusComm.alloc`` and all-reduced in place:
every rank reduces its chunk reading the peers' buffers where they lie, so the transport's copy in disappears
(torus/runtime/shm.py). Where the node's /dev/shm cannot hold it (``MemoryError`` on every rank), an ordinary
array takes its place (one copy in more).

Results that lie in a persistent buffer (a window, or a compressed bucket's wire buffer) are copied out into
views of a reusable output buffer, one view per tensor, each 64-byte aligned so that TensorFlow takes it
without a copy. Why reusing the output is safe: inside a graph TensorFlow keeps the returned arrays as the output
tensors' memory, holding a Python reference to them until the tensors die. A buffer is reused only when nothing
but this module refers to it (its reference count); otherwise, e.g. a custom loop that returned the gradients
from its ``tf.function`` and keeps them, another one is made (at most ``POOL`` per layout are kept).
"""
from __future__ import annotations

import sys

import numpy as np

from torus.errors import MismatchError

ALIGN = 64  # bytes: TensorFlow shares a numpy_function output's memory only at its alignment (EIGEN_MAX_ALIGN_BYTES)
POOL = 2  # output buffers kept per layout


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
        self._shared: dict = {}  # bucket key -> TorusComm.alloc array
        self._outputs: dict = {}  # (dtype, shapes) -> [(base, views)]
        self.made = 0

    @property
    def windows(self) -> int:
        return len(self._shared)

    def alloc(self, key, wire: np.dtype, count: int) -> np.ndarray:
        """A shared buffer of ``count`` elements of ``wire`` for the bucket ``key``; an ordinary array where
        /dev/shm is too small (``MemoryError`` on every rank). Collective, like ``TorusComm.alloc``; its
        ``MismatchError`` (the ranks' sizes or dtypes differ) names the tensors."""
        try:
            buf = self.torus_comm.alloc(count, wire)
        except MismatchError as e:  # alloc's agreement is the first collective of an all-reduce of a new size
            raise MismatchError(f"allreduce of tensors on rank {self.torus_comm.rank}: ranks passed tensors of "
                                f"another total size or dtype (their fused buffer: {e})") from e
        except MemoryError:
            return np.empty(count, wire)
        self._shared[key] = buf
        self.made += 1
        return buf

    def free(self, key) -> None:
        """Free ``key``'s shared buffer, if it has one (collective)."""
        buf = self._shared.pop(key, None)
        if buf is not None:
            self.torus_comm.free_alloc(buf)

    def outputs(self, dtype: np.dtype, shapes: list) -> list:
        """Views (one per shape, ALIGN-aligned) of an output buffer of ``dtype`` nothing else refers to."""
        key = (dtype, tuple(shapes))
        pool = self._outputs.setdefault(key, [])
        for entry in pool:
            if _unused(entry):
                return entry[1]
        step = ALIGN // dtype.itemsize
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        offsets = np.cumsum([0] + [-(-n // step) * step for n in sizes])
        base = np.empty(int(offsets[-1]) + step, dtype)
        first = (-base.ctypes.data % ALIGN) // dtype.itemsize
        views = [base[first + o:first + o + n].reshape(s) for o, n, s in zip(offsets, sizes, shapes)]
        if len(pool) < POOL:
            pool.append((base, views))
        return views
