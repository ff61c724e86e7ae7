"""The host kernels (Cython, through torus.kernels) against numpy and ml_dtypes, bit for bit.

reduce_into and scale for every op and dtype (16-bit types: widen both operands to float32, operate, round
once to nearest even; numpy does float32 math the same way and numpy/ml_dtypes casts round to nearest even),
at lengths that take the serial and the OpenMP path; float16/bfloat16 widening of all 65,536 bit patterns;
narrowing of random float32 bit patterns (so subnormals, overflow, Inf and NaN) and of hand-picked ties.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from torus import kernels
from torus._ext import _reduce  # type: ignore[attr-defined]  # compiled, no stubs

BF16 = np.dtype(ml_dtypes.bfloat16)
HALVES = [np.dtype(np.float16), BF16]
DTYPES = [*HALVES, np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64)]
NUMPY_OP = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
# 0 and 1 take the early exits; 300,001 elements (600,002 bytes and more) > 2 threads x 256 KiB take the
# parallel path with a ragged end (test_thread_split_counts_bytes checks that they do).
LENGTHS = [0, 1, 7, 300_001]


@pytest.fixture(autouse=True)
def two_threads():
    before = kernels.get_num_threads()
    kernels.set_num_threads(2)
    yield
    kernels.set_num_threads(before)


def _operands(rng, dtype, op, n):
    if dtype.kind == "i":
        hi = 1000 if op == "prod" else np.iinfo(dtype).max // 2
        return rng.integers(-hi, hi, (2, n)).astype(dtype)
    return (rng.standard_normal((2, n)) * 100).astype(dtype)


def _expected(a, b, op, scale=1.0):
    """numpy's elementwise result: 16-bit types in float32 and rounded once; the scale in the operands'
    precision (float32 for 16-bit types), as the kernels document."""
    if a.dtype in HALVES:
        r = NUMPY_OP[op](a.astype(np.float32), b.astype(np.float32))
        with np.errstate(over="ignore"):  # products beyond float16's range round to Inf, as they should
            return (r * np.float32(scale) if scale != 1.0 else r).astype(a.dtype)
    r = NUMPY_OP[op](a, b)
    return r * a.dtype.type(scale) if scale != 1.0 else r


def _bits(x):
    return x.view(f"u{x.dtype.itemsize}")


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
@pytest.mark.parametrize("into", ["acc", "out"])
def test_reduce_into_matches_numpy(into, op, dtype, n, rng):
    """In place (acc = op(acc, src)) and into a third array (out = op(acc, src), acc only read): numpy's bits;
    src is never written."""
    a, b = _operands(rng, dtype, op, n)
    acc, src = a.copy(), b.copy()
    out = np.full(n, 7, dtype) if into == "out" else None
    kernels.reduce_into(acc, src, op, 1.0, out)
    np.testing.assert_array_equal(_bits(acc if out is None else out), _bits(_expected(a, b, op)))
    if out is not None:
        np.testing.assert_array_equal(_bits(acc), _bits(a))
    np.testing.assert_array_equal(_bits(src), _bits(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thread_split_counts_bytes(dtype):
    """A reduction forks as many OpenMP threads for a 16-bit array as for a float32 one of the same bytes
    (256 KiB per thread): counted in elements, the default 256 KiB segment across nodes went parallel for
    float16/bfloat16 only, and across emulated hosts such per-segment parallel regions made the 16-bit
    all-reduce slower than float32's (bench/wire/README.md). The test lengths above do take the parallel path."""
    per = (256 << 10) // dtype.itemsize
    for n, nthreads, want in [(0, 2, 1), (1, 2, 1), (per, 2, 1), (2 * per - 1, 2, 1), (2 * per, 2, 2),
                              (2 * per, 1, 1), (8 * per, 4, 4), (5 * per, 8, 5), (LENGTHS[-1], 2, 2)]:
        assert _reduce.threads(np.empty(n, dtype), nthreads) == want, (n, nthreads)


@pytest.mark.parametrize("dtype", DTYPES[:4], ids=str)
def test_reduce_into_out_fuses_the_scale(dtype, rng):
    a, b = _operands(rng, dtype, "sum", 300_001)
    out = np.empty_like(a)
    kernels.reduce_into(a, b, "sum", 1 / 3, out)
    np.testing.assert_array_equal(_bits(out), _bits(_expected(a, b, "sum", 1 / 3)))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES[:4], ids=str)
@pytest.mark.parametrize("factor", [1 / 3, 0.25, 1 / 6])
def test_reduce_into_fuses_the_avg_scale(factor, dtype, n, rng):
    a, b = _operands(rng, dtype, "sum", n)
    acc = a.copy()
    kernels.reduce_into(acc, b, "sum", factor)
    np.testing.assert_array_equal(_bits(acc), _bits(_expected(a, b, "sum", factor)))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES[:4], ids=str)
def test_scale_matches_numpy(dtype, n, rng):
    a = (rng.standard_normal(n) * 100).astype(dtype)
    buf = a.copy()
    kernels.scale(buf, 1 / 3)
    if dtype in HALVES:
        want = (a.astype(np.float32) * np.float32(1 / 3)).astype(dtype)
    else:
        want = a * dtype.type(1 / 3)
    np.testing.assert_array_equal(_bits(buf), _bits(want))


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_widen_every_bit_pattern(dtype):
    """All 65,536 values, NaNs included (payload and sign kept), match numpy's / ml_dtypes' cast exactly."""
    src = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)
    out = np.full(src.size, np.nan, np.float32)
    kernels.widen(src, out)
    np.testing.assert_array_equal(out.view(np.uint32), src.astype(np.float32).view(np.uint32))


def _ties(dtype):
    """float32 values exactly halfway between two neighbours of ``dtype`` (even and odd lower neighbour),
    in the normal and the subnormal range, and at the overflow threshold."""
    info = ml_dtypes.finfo(dtype)
    mant = info.nmant  # 10 for float16, 7 for bfloat16
    vals = []
    for e in (0, -3, 5):
        for m in (0, 1, 2, 3, (1 << mant) - 1):
            lo = np.float64(2.0 ** e * (1 + m / 2 ** mant))
            vals.append(lo + 2.0 ** (e - mant - 1))  # halfway to the next value
    tiny = float(info.smallest_subnormal)
    vals += [tiny / 2, 3 * tiny / 2, 5 * tiny / 2, tiny / 4, 3 * tiny / 4]  # subnormal ties and near-ties
    big = float(info.max)
    vals += [big, big + 2.0 ** (np.log2(big).astype(int) - mant - 1)]  # max, and the tie that rounds to Inf
    vals += [np.nextafter(np.float32(vals[-1]), np.float32(0)), np.float32(np.inf)]
    vals = np.array(vals, np.float32)
    return np.concatenate([vals, -vals])


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_narrow_matches_numpy_and_ml_dtypes(dtype, rng):
    """Random float32 bit patterns (every exponent: subnormals, overflow, Inf, NaN), random values in the
    16-bit range, and exact ties; NaNs must stay NaN (the payload is not specified)."""
    bits = rng.integers(0, 1 << 32, 200_001, dtype=np.uint64).astype(np.uint32).view(np.float32)
    in_range = (rng.standard_normal(200_001) * np.exp2(rng.integers(-30, 16, 200_001))).astype(np.float32)
    src = np.concatenate([bits, in_range, _ties(dtype)])
    out = np.zeros(src.size, dtype)
    kernels.narrow(src, out)
    with np.errstate(over="ignore", invalid="ignore"):
        want = src.astype(dtype)
    nan = np.isnan(src)
    assert np.isnan(out.astype(np.float32)[nan]).all()
    np.testing.assert_array_equal(_bits(out)[~nan], _bits(want)[~nan])


def test_ties_round_to_even():
    """Independent of numpy: 1 + 2**-11 lies halfway between float16 1 and 1 + 2**-10 and rounds to 1
    (even); 1 + 3 * 2**-11 rounds up to 1 + 2**-9; likewise for bfloat16 at 2**-8."""
    for dtype, half_ulp in ((np.dtype(np.float16), 2.0 ** -11), (BF16, 2.0 ** -8)):
        src = np.array([1 + half_ulp, 1 + 3 * half_ulp, -(1 + half_ulp)], np.float32)
        out = np.zeros(3, dtype)
        kernels.narrow(src, out)
        assert out.astype(np.float64).tolist() == [1.0, 1 + 4 * half_ulp, -1.0]


def _read_only(n):
    a = np.ones(n, np.float32)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("acc, src, error, words", [
    (np.ones(3, np.float32), np.ones(4, np.float32), ValueError, "3 x float32, src is 4 x float32"),
    (np.ones(4, np.float32), np.ones(4, np.float64), ValueError, "src is 4 x float64"),
    (np.ones(8, np.float32)[::2], np.ones(4, np.float32), ValueError, "C-contiguous"),
    (np.ones(4, np.float32), np.ones(8, np.float32)[::2], ValueError, "C-contiguous"),
    (_read_only(4), np.ones(4, np.float32), ValueError, "read-only"),
    (np.ones(4, np.uint8), np.ones(4, np.uint8), TypeError, "unsupported dtype uint8"),
    ([1.0, 2.0], [1.0, 2.0], TypeError, "expected numpy or CUDA arrays, got list"),
], ids=["count", "dtype", "strided acc", "strided src", "read-only", "uint8", "list"])
def test_reduce_into_refuses_mismatched_buffers(acc, src, error, words):
    """The kernel's entry point reads only array headers, yet never runs its loop on arrays that do not fit."""
    before = np.array(acc, copy=True)
    with pytest.raises(error, match=words):
        kernels.reduce_into(acc, src, "sum")
    np.testing.assert_array_equal(np.asarray(acc), before)


def test_reduce_into_refuses_an_out_that_overlaps_an_operand():
    buf = np.arange(8, dtype=np.float32)
    before = buf.copy()
    for acc, src, out in [(buf[:4], np.ones(4, np.float32), buf[2:6]), (np.ones(4, np.float32), buf[:4], buf[3:7])]:
        with pytest.raises(ValueError, match="out overlaps an operand"):
            kernels.reduce_into(acc, src, "sum", 1.0, out)
    np.testing.assert_array_equal(buf, before)
