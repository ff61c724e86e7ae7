"""The MPI library's own collectives: the oracle, the small-message path and the bar to beat.

float16 and bfloat16, which MPI has no reduction for, travel as 16-bit words and are reduced by a user-defined
commutative ``MPI.Op`` that calls the same kernels as the schedules (float32 arithmetic, one rounding).
``avg`` is a sum followed by one scaling pass. All-reduce calls are split into pieces of at most 2**30
elements so that no count reaches the 32-bit limit of the classic MPI interface.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from torus import kernels
from torus.ops import HALF_FORMAT

_MPI_OP = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
_MAX_PIECE = 1 << 30
_half_ops: dict = {}


def _half_op(dtype: np.dtype, op: str) -> MPI.Op:
    key = (dtype, op)
    if key not in _half_ops:
        kop = "sum" if op == "avg" else op

        def reduce(inbuf, inoutbuf, datatype):
            src = np.frombuffer(inbuf, dtype=dtype)
            acc = np.frombuffer(inoutbuf, dtype=dtype)
            kernels.reduce_into(acc, src, kop)

        _half_ops[key] = MPI.Op.Create(reduce, commute=True)
    return _half_ops[key]


def _spec(buf: np.ndarray, op: str):
    if buf.dtype in HALF_FORMAT:
        return [buf.view(np.uint16), MPI.UINT16_T], _half_op(buf.dtype, op)
    return buf, _MPI_OP[op]


def allreduce(comm: MPI.Comm, buf: np.ndarray, op: str, scale: float) -> None:
    """In place on ``buf`` (1-D contiguous); ``scale`` is applied once at the end for avg."""
    for lo in range(0, buf.size, _MAX_PIECE):
        piece = buf[lo:lo + _MAX_PIECE]
        spec, mpi_op = _spec(piece, op)
        comm.Allreduce(MPI.IN_PLACE, spec, op=mpi_op)
    if scale != 1.0 and buf.size:
        kernels.scale(buf, scale)


def reduce_scatter(comm: MPI.Comm, work: np.ndarray, out: np.ndarray, counts, op: str, scale: float) -> None:
    """Reduce ``work`` (all blocks) across ranks; block ``rank`` lands in ``out``."""
    sspec, mpi_op = _spec(work, op)
    rspec, _ = _spec(out, op)
    comm.Reduce_scatter(sspec, rspec, list(counts), op=mpi_op)
    if scale != 1.0 and out.size:
        kernels.scale(out, scale)


def allgather(comm: MPI.Comm, buf: np.ndarray, counts, displs) -> None:
    """In place: block ``rank`` of ``buf`` is already filled; every block is filled afterwards."""
    raw = buf.view(np.uint8)
    isz = buf.itemsize
    comm.Allgatherv(MPI.IN_PLACE, [raw, ([c * isz for c in counts], [d * isz for d in displs]), MPI.BYTE])
