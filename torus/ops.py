"""Reduction operations and the dtype rules they follow.

``op`` names: ``"sum"``, ``"avg"`` (the sum divided by the number of ranks), ``"min"``, ``"max"``, ``"prod"``.
dtypes: float16, bfloat16 (ml_dtypes), float32, float64, int32, int64. float16 and bfloat16 are reduced with
float32 arithmetic: every pairwise operation widens both operands to float32 and rounds the result once.
``"avg"`` on integers raises ``TypeError`` (an integer mean is not representable without a rounding rule).

Averages never overflow where the mean fits (see ``avg_factors``): float16/bfloat16 inputs are first scaled by
the power of two ``2**-k`` (``2**k >= size``; exact, like NCCL's and Horovod's pre-scaling but without their
rounding), so every partial sum is at most the largest input in magnitude, and the remaining ``2**k / size``
is fused into the final reduction. float32/float64 are summed as they are and scaled by ``1 / size`` in the
final reduction (no extra pass over the buffer); their partial sums overflow only past the type's maximum.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

OPS = ("sum", "avg", "min", "max", "prod")
# Kernel operation codes (src/_reduce.pyx); avg is a sum with a fused final scale.
OP_CODE = {"sum": 0, "avg": 0, "prod": 1, "min": 2, "max": 3}

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64),
          np.dtype(np.int32), np.dtype(np.int64))
# Stable small integers for the cross-rank agreement check.
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES)}
HALF_FORMAT = {np.dtype(np.float16): 0, BFLOAT16: 1}


def avg_factors(dtype: np.dtype, size: int) -> tuple:
    """``(pre, post)``: an average over ``size`` ranks scales each input by ``pre`` before the sum and the sum
    by ``post``. 16-bit floats: ``pre = 2**-k`` with ``2**k`` the smallest power of two ``>= size`` (exact
    unless the scaled value is subnormal, where it rounds by at most half the smallest subnormal), so that a
    partial sum of ``m <= size`` scaled inputs stays within the inputs' range; ``post = 2**k / size`` (1.0
    when ``size`` is a power of two). Other dtypes: ``(1.0, 1 / size)``."""
    if dtype not in HALF_FORMAT:
        return 1.0, 1.0 / size
    k = (size - 1).bit_length()
    return 2.0 ** -k, 2.0 ** k / size


def check_op_dtype(operation: str, rank: int, op: str, dtype) -> np.dtype:
    """Return ``np.dtype(dtype)`` if ``op`` applies to it; raise ``ValueError``/``TypeError`` naming the call."""
    if op not in OPS:
        raise ValueError(f"{operation} on rank {rank}: unknown op {op!r}; expected one of {', '.join(OPS)} (or "
                         "mpi4py's MPI.SUM, MPI.MIN, MPI.MAX, MPI.PROD)")
    dt = np.dtype(dtype)
    if dt not in DTYPE_CODE:
        names = ", ".join(str(d) for d in DTYPES)
        raise TypeError(f"{operation} on rank {rank}: unsupported dtype {dt}; expected one of {names}")
    if op == "avg" and dt.kind == "i":
        raise TypeError(f"{operation} on rank {rank}: op 'avg' is not defined for integer dtype {dt}; "
                        "use 'sum' and divide")
    return dt
