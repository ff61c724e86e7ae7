"""torus.kernels.cuda under numba's CUDA simulator, checked bit for bit against numpy and the host kernels.

The module turns the simulator on (``NUMBA_ENABLE_CUDASIM=1``) before numba.cuda is first imported, and
skips if numba.cuda was already imported for real hardware in this process. With ``NUMBA_ENABLE_CUDASIM=0``
in the environment the same tests run on a real GPU (as bench/gpu/gpu_run.sh does on a device machine). Buffers are
``numba.cuda.to_device`` arrays, so ``torus.kernels`` dispatches them to the device kernels (the Cython
kernels would reject them). The simulator runs each GPU thread as a Python thread (about 1.4 s per 10,000
elements), so sizes stay tiny: 0, 1, 33 (partial warp) and 257 (two blocks of 256). 160 cases, about 12 s
on 2 cores.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

_set_here = "numba.cuda" not in sys.modules and "NUMBA_ENABLE_CUDASIM" not in os.environ
if _set_here:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
from numba import cuda  # noqa: E402

if _set_here:  # numba has read it; the simulator stays on in this process, child processes are unaffected
    del os.environ["NUMBA_ENABLE_CUDASIM"]

SIMULATED = cuda.to_device.__module__.startswith("numba.cuda.simulator")
if not SIMULATED:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "0":
        pytest.skip("numba.cuda was imported for real hardware before this module could enable the CUDA "
                    "simulator; run this file in its own process (or with NUMBA_ENABLE_CUDASIM=0 on a GPU)",
                    allow_module_level=True)
    if not cuda.is_available():
        pytest.skip("NUMBA_ENABLE_CUDASIM=0 asks for a real GPU and numba finds none", allow_module_level=True)

import torus.kernels as kernels  # noqa: E402
from torus.ops import BFLOAT16, DTYPES, HALF_FORMAT, OPS  # noqa: E402

# Inf and NaN inputs are the point of several cases; numpy (and the simulator, which runs on numpy scalars)
# warns about them.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
SIZES = (0, 1, 33, 257)
F16 = np.dtype(np.float16)
BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(BITS[a.dtype.itemsize])


def _assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"{what}: bit patterns differ")


def _assert_matches_host(got: np.ndarray, host: np.ndarray, what: str) -> None:
    """Bit-equal to the host kernels, except that on a real GPU a NaN result may be encoded differently:
    arithmetic there returns the GPU's canonical NaN where x86 returns its default NaN (sign set) or
    propagates an input's payload. The simulator computes on the host, so there every bit must match."""
    if SIMULATED:
        _assert_bits_equal(got, host, what)
    else:
        _assert_same_values(got, host, what)


def _assert_same_values(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit-equal where ``want`` is a number; NaN (any payload) where ``want`` is NaN."""
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(_bits(got)[~nan], _bits(want)[~nan], err_msg=f"{what}: bit patterns differ")


def _random(rng, n: int, dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "i":
        return rng.integers(-1000, 1000, n).astype(dtype)
    return (rng.standard_normal(n) * 8).astype(dtype)


def _numpy_reduce(a: np.ndarray, b: np.ndarray, op: str, scale: float) -> np.ndarray:
    """The documented contract in plain numpy: 16-bit types in float32, one rounding when stored."""
    half = a.dtype in HALF_FORMAT
    x, y = (a.astype(np.float32), b.astype(np.float32)) if half else (a, b)
    if op in ("sum", "avg"):
        r = x + y
        if scale != 1:
            r = r * x.dtype.type(scale)
    elif op == "prod":
        r = x * y
    elif op == "min":
        r = np.where(y < x, y, x)
    else:
        r = np.where(y > x, y, x)
    return r.astype(a.dtype)


def _on_device(fn, *arrays: np.ndarray) -> list[np.ndarray]:
    """Run ``fn`` on device copies of ``arrays``; return all of them copied back. Copies go through unsigned
    views: numba copies through the buffer protocol, which has no float16 or bfloat16."""
    dev = [cuda.to_device(_bits(a)).view(a.dtype) for a in arrays]
    fn(*dev)
    return [d.view(BITS[a.dtype.itemsize]).copy_to_host().view(a.dtype) for d, a in zip(dev, arrays)]


def _on_host(fn, *arrays: np.ndarray) -> list[np.ndarray]:
    host = [a.copy() for a in arrays]
    fn(*host)
    return host


CASES = [(dt, op) for dt in DTYPES for op in OPS if not (op == "avg" and dt.kind == "i")]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{dt}-{op}" for dt, op in CASES])
def test_reduce_into_matches_numpy_and_host(rng, dtype, op, n):
    acc, src = _random(rng, n, dtype), _random(rng, n, dtype)
    scale = 1 / 3 if op == "avg" else 1.0
    fn = lambda a, s: kernels.reduce_into(a, s, op, scale)  # noqa: E731
    got, src_after = _on_device(fn, acc, src)
    _assert_bits_equal(got, _numpy_reduce(acc, src, op, scale), f"reduce_into({op}, {dtype}, n={n}) vs numpy")
    _assert_bits_equal(got, _on_host(fn, acc, src)[0], f"reduce_into({op}, {dtype}, n={n}) vs host")
    _assert_bits_equal(src_after, src, f"reduce_into({op}, {dtype}, n={n}) wrote to src")


@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{dt}-{op}" for dt, op in CASES])
def test_reduce_into_out_matches_host(rng, dtype, op):
    """out = op(acc, src) on the device: the host's bits, acc and src untouched."""
    acc, src, out = _random(rng, 257, dtype), _random(rng, 257, dtype), np.zeros(257, dtype)
    scale = 1 / 3 if op == "avg" else 1.0
    fn = lambda a, s, o: kernels.reduce_into(a, s, op, scale, o)  # noqa: E731
    acc_after, src_after, got = _on_device(fn, acc, src, out)
    _assert_bits_equal(got, _numpy_reduce(acc, src, op, scale), f"reduce_into({op}, {dtype}, out) vs numpy")
    _assert_bits_equal(got, _on_host(fn, acc, src, out)[2], f"reduce_into({op}, {dtype}, out) vs host")
    _assert_bits_equal(acc_after, acc, f"reduce_into({op}, {dtype}, out) wrote to acc")
    _assert_bits_equal(src_after, src, f"reduce_into({op}, {dtype}, out) wrote to src")


# Values where rounding and comparisons go wrong first: signed zeros, subnormals of both 16-bit formats and
# of float32, the largest finite values, infinities, NaN of both signs, and exact ties.
SPECIAL_F32 = np.array(
    [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan,
     2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -14, 6.1e-5, 1e-45, -1e-40, 2.0 ** -126, 1e-38,
     65504.0, 65519.99, 65520.0, -65520.0, 3.3895314e38, 3.4028235e38,
     1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 0.1, 1 / 3],
    np.float32)


def _special(dtype: np.dtype, n: int, rng) -> np.ndarray:
    """``n`` values of ``dtype``: the special values above, in random order, padded with random ones."""
    v = np.concatenate([SPECIAL_F32, (rng.standard_normal(n) * 8).astype(np.float32)])[:n]
    return rng.permutation(v).astype(dtype)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [F16, BFLOAT16, np.dtype(np.float32)], ids=str)
def test_reduce_into_special_values_match_host(rng, dtype, op):
    acc, src = _special(dtype, 257, rng), _special(dtype, 257, rng)
    scale = 0.125 if op == "avg" else 1.0
    fn = lambda a, s: kernels.reduce_into(a, s, op, scale)  # noqa: E731
    got = _on_device(fn, acc, src)[0]
    _assert_matches_host(got, _on_host(fn, acc, src)[0], f"reduce_into({op}, {dtype}) on specials vs host")
    _assert_same_values(got, _numpy_reduce(acc, src, op, scale), f"reduce_into({op}, {dtype}) on specials")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [F16, BFLOAT16, np.dtype(np.float32), np.dtype(np.float64)], ids=str)
def test_scale_matches_numpy_and_host(rng, dtype, n):
    buf = _special(dtype, n, rng)
    factor = 1 / 3
    got = _on_device(lambda b: kernels.scale(b, factor), buf)[0]
    arith = np.float64 if dtype == np.float64 else np.float32
    want = (buf.astype(arith) * arith(factor)).astype(dtype)
    _assert_same_values(got, want, f"scale({dtype}, n={n}) vs numpy")
    _assert_matches_host(got, _on_host(lambda b: kernels.scale(b, factor), buf)[0], f"scale({dtype}, n={n}) vs host")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [F16, BFLOAT16], ids=str)
def test_narrow_matches_numpy_and_host(rng, dtype, n):
    src, dst = _special(np.float32, n, rng), np.zeros(n, dtype)
    got = _on_device(kernels.narrow, src, dst)[1]
    _assert_same_values(got, src.astype(dtype), f"narrow(float32 -> {dtype}, n={n}) vs numpy")
    _assert_bits_equal(got, _on_host(kernels.narrow, src, dst)[1], f"narrow(float32 -> {dtype}, n={n}) vs host")


def _half_patterns(rng, n: int) -> np.ndarray:
    """16-bit patterns: zeros, subnormals, the normal/subnormal edges, Inf and NaN of both signs, random."""
    edges = np.array([0x0000, 0x8000, 0x0001, 0x03ff, 0x0400, 0x7bff, 0x7c00, 0xfc00, 0x7e00, 0xfe00, 0x7c01,
                      0x007f, 0x0080, 0x7f7f, 0x7f80, 0xff80, 0x7fc0, 0x7f81, 0x3c00, 0xbc00], np.uint16)
    return np.concatenate([edges, rng.integers(0, 1 << 16, n, dtype=np.uint16)])[:n]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [F16, BFLOAT16], ids=str)
def test_widen_matches_numpy_and_host(rng, dtype, n):
    src, dst = _half_patterns(rng, n).view(dtype), np.zeros(n, np.float32)
    got = _on_device(kernels.widen, src, dst)[1]
    _assert_same_values(got, src.astype(np.float32), f"widen({dtype} -> float32, n={n}) vs numpy")
    _assert_bits_equal(got, _on_host(kernels.widen, src, dst)[1], f"widen({dtype} -> float32, n={n}) vs host")


def test_unknown_op_raises():
    a = cuda.to_device(np.ones(4, np.float32))
    with pytest.raises(KeyError):
        kernels.reduce_into(a, a, "mean")
