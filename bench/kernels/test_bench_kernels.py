"""Host kernel throughput: torus.kernels (Cython, 1 and 2 OpenMP threads) against the numpy equivalent.

Run: ``python -m pytest bench/kernels/test_bench_kernels.py --benchmark-columns=median,ops`` (about 3 minutes on 2
cores). Each group holds one operation at one size, so the table compares like with like:

- reduce sum float32: ``kernels.reduce_into(acc, src, "sum")`` vs ``np.add(acc, src, out=acc)``;
  float16 vs numpy's float16 add; bfloat16 vs ml_dtypes' bfloat16 add (both ``out=acc``);
- sum+scale float32: ``reduce_into(acc, src, "avg", 0.5)`` (one pass) vs ``np.add`` then ``np.multiply``;
- narrow float32 -> float16/bfloat16 and widen back: ``kernels.narrow``/``widen`` into a preallocated array vs
  ``astype`` (which allocates) and ``np.copyto`` (numpy's same cast loop, into a preallocated array).

Sizes are bytes per operand (4 KiB, 1 MiB, 64 MiB). ``extra_info["bytes"]`` is the memory traffic of one
call (a reduction reads two operands and writes one: 3 x nbytes; a cast reads one and writes one), so
GB/s = bytes / median seconds. Inputs are normal random values (no subnormals, no overflow over many rounds).
"""
from __future__ import annotations

import numpy as np
import pytest

import torus.kernels as kernels
from torus.ops import BFLOAT16

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "64MiB": 64 << 20}
REDUCE_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BFLOAT16}
HALF_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}
THREADS = [1, 2]


def _operands(dtype: np.dtype, nbytes: int):
    """acc ~ N(0, 1) and src ~ N(0, 1e-3) of ``nbytes`` each: repeated in-place sums stay near 1."""
    rng = np.random.default_rng(0)
    n = nbytes // dtype.itemsize
    return (rng.standard_normal(n, np.float32).astype(dtype),
            (rng.standard_normal(n, np.float32) * 1e-3).astype(dtype))


def _setup(benchmark, group: str, bytes_moved: int) -> None:
    benchmark.group = group
    benchmark.extra_info["bytes"] = bytes_moved


# -- reduce sum ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES)
@pytest.mark.parametrize("num_threads", THREADS, indirect=True, ids=lambda t: f"{t}t")
def test_reduce_sum_torus(benchmark, dtype, size, num_threads):
    acc, src = _operands(REDUCE_DTYPES[dtype], SIZES[size])
    _setup(benchmark, f"reduce sum {dtype} {size}", 3 * SIZES[size])
    benchmark(kernels.reduce_into, acc, src, "sum")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES)
def test_reduce_sum_numpy(benchmark, dtype, size):
    acc, src = _operands(REDUCE_DTYPES[dtype], SIZES[size])
    _setup(benchmark, f"reduce sum {dtype} {size}", 3 * SIZES[size])
    benchmark(np.add, acc, src, out=acc)


# -- fused sum + scale (avg) -----------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("num_threads", THREADS, indirect=True, ids=lambda t: f"{t}t")
def test_sum_scale_torus(benchmark, size, num_threads):
    acc, src = _operands(np.dtype(np.float32), SIZES[size])
    _setup(benchmark, f"sum+scale float32 {size}", 3 * SIZES[size])
    benchmark(kernels.reduce_into, acc, src, "avg", 0.5)


@pytest.mark.parametrize("size", SIZES)
def test_sum_scale_numpy(benchmark, size):
    acc, src = _operands(np.dtype(np.float32), SIZES[size])
    _setup(benchmark, f"sum+scale float32 {size}", 3 * SIZES[size])

    def add_then_multiply():
        np.add(acc, src, out=acc)
        np.multiply(acc, np.float32(0.5), out=acc)

    benchmark(add_then_multiply)


# -- casts ------------------------------------------------------------------------------------------------

def _cast_operands(half: str, size: str):
    """float32 values and a float16/bfloat16 array of the same element count (``size`` = float32 bytes)."""
    wide = _operands(np.dtype(np.float32), SIZES[size])[0]
    return wide, wide.astype(HALF_DTYPES[half])


def _cast_bytes(size: str) -> int:
    return SIZES[size] + SIZES[size] // 2


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("num_threads", THREADS, indirect=True, ids=lambda t: f"{t}t")
def test_narrow_torus(benchmark, half, size, num_threads):
    wide, narrow = _cast_operands(half, size)
    _setup(benchmark, f"narrow float32->{half} {size}", _cast_bytes(size))
    benchmark(kernels.narrow, wide, narrow)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("how", ["astype", "copyto"])
def test_narrow_numpy(benchmark, half, size, how):
    wide, narrow = _cast_operands(half, size)
    _setup(benchmark, f"narrow float32->{half} {size}", _cast_bytes(size))
    if how == "astype":
        benchmark(wide.astype, narrow.dtype)
    else:
        benchmark(np.copyto, narrow, wide, casting="unsafe")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("num_threads", THREADS, indirect=True, ids=lambda t: f"{t}t")
def test_widen_torus(benchmark, half, size, num_threads):
    wide, narrow = _cast_operands(half, size)
    _setup(benchmark, f"widen {half}->float32 {size}", _cast_bytes(size))
    benchmark(kernels.widen, narrow, wide)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("how", ["astype", "copyto"])
def test_widen_numpy(benchmark, half, size, how):
    wide, narrow = _cast_operands(half, size)
    _setup(benchmark, f"widen {half}->float32 {size}", _cast_bytes(size))
    if how == "astype":
        benchmark(narrow.astype, np.float32)
    else:
        benchmark(np.copyto, wide, narrow)
