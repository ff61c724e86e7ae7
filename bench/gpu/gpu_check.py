#!/usr/bin/env python
"""Real-GPU check of torus.kernels.cuda: bit-exact correctness against numpy, then throughput against CuPy.

Not run by the test suites (tests/test_cuda_kernels.py covers the same kernels under numba's simulator).
On a device machine it is step 1 of ``bash bench/gpu/gpu_run.sh`` (which also builds torus._ext there and carries
the numpy that the machine's numba-cuda needs); alone: ``python bench/gpu/gpu_check.py``.

With torus installed (or torus/_ext built in place) the check also goes through the ``torus.kernels``
dispatch and compares with the host (Cython) kernels; without it, only numpy, ml_dtypes and numba-cuda are
needed and the device module is loaded on its own. Exit status 1 if any element is wrong. On a GPU a NaN
result may be encoded differently from the host's (the GPU's canonical NaN): it counts as right, and the
number of such elements is reported per check (``nan_encoding_differs``).

Correctness: reduce_into for every op and dtype (sizes 0, 1, 33, 257, 1 Mi + 3; the ``out=`` form at the
largest), scale, and both casts on all 65,536 16-bit patterns and on random float32 bit patterns (NaN, Inf,
subnormals, ties included), each compared bit for bit with the numpy expression of the contract (NaN
payloads only need to be NaN).
Throughput: reduce (sum float32/float16/bfloat16, fused sum+scale float32), scale, narrow and widen from
1 MiB to 256 MiB per operand; wall time of one call including its launch and synchronise (what a schedule
waits for), median of ``--iters``; GB/s = bytes moved (reads + writes) / time. The baseline is CuPy (``add``
with ``out=``, ``add`` then ``multiply``, ``multiply``, ``copyto``) if installed, else a plain numba
elementwise kernel; bfloat16 has no CuPy dtype, so its rows have no baseline. Prints a table; writes
``gpu_check.json`` to ``$OUT`` (or ``--out``) when set.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,4,16,64,256", help="throughput sizes, MiB per operand")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per measurement (after 3 warm-up calls)")
    ap.add_argument("--check-sizes", default="0,1,33,257,1048579", help="element counts for the reduce check")
    ap.add_argument("--patterns", type=int, default=1 << 22, help="random float32 bit patterns for narrow")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json (default: $OUT)")
    ap.add_argument("--simulate", action="store_true",
                    help="run under NUMBA_ENABLE_CUDASIM=1 (tests this script on a CPU; use tiny sizes)")
    return ap.parse_args()


ARGS = _parse_args()
if ARGS.simulate:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

try:
    import cupy as cp
except ImportError:
    cp = None


def _load_kernels():
    """(device module, torus.kernels or None): the full package when it imports, else cuda.py on its own."""
    sys.path.insert(0, str(ROOT))
    try:
        import torus.kernels as host
        from torus.kernels import cuda as device
        return device, host
    except ImportError as exc:  # no built torus._ext or no mpi4py here: stand-in packages, no __init__ run
        print(f"torus.kernels does not import ({exc}); loading torus/kernels/cuda.py on its own")
        for name, path in (("torus", ROOT / "torus"), ("torus.kernels", ROOT / "torus" / "kernels")):
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(path)]
            sys.modules[name] = pkg
        for name in ("torus.ops", "torus.kernels.cuda"):
            spec = importlib.util.spec_from_file_location(name, ROOT / (name.replace(".", "/") + ".py"))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        return sys.modules["torus.kernels.cuda"], None


KC, HOST = _load_kernels()
# Device calls go through the torus.kernels dispatch when it is there (so its routing is checked too).
DEV = HOST if HOST is not None else KC
BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
DTYPES = (F16, BF16, F32, np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))
OPS = ("sum", "avg", "min", "max", "prod")
BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


# -- correctness ------------------------------------------------------------------------------------------

def _wrong(got: np.ndarray, want: np.ndarray, exact: bool) -> int:
    """Elements whose bits differ; with ``exact=False`` any NaN matches any NaN."""
    g, w = got.view(BITS[got.dtype.itemsize]), want.view(BITS[want.dtype.itemsize])
    bad = g != w
    if not exact and (want.dtype.kind == "f" or want.dtype == BF16):
        bad &= ~(np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32)))
    return int(bad.sum())


def _numpy_reduce(a, b, op, scale):
    half = a.dtype in (F16, BF16)
    x, y = (a.astype(np.float32), b.astype(np.float32)) if half else (a, b)
    if op in ("sum", "avg"):
        r = x + y if scale == 1 else (x + y) * x.dtype.type(scale)
    elif op == "prod":
        r = x * y
    elif op == "min":
        r = np.where(y < x, y, x)
    else:
        r = np.where(y > x, y, x)
    return r.astype(a.dtype)


def _random(rng, n, dtype):
    if dtype.kind == "i":
        return rng.integers(-1000, 1000, n).astype(dtype)
    v = rng.standard_normal(n).astype(np.float32) * 8
    v[: min(n, 8)] = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 65520.0, 1 + 2.0 ** -11])[: min(n, 8)]
    return rng.permutation(v).astype(dtype)


def _to_device(a):
    """numba copies through the buffer protocol, which has no float16/bfloat16: copy an unsigned view."""
    return cuda.to_device(a.view(BITS[a.dtype.itemsize])).view(a.dtype)


def _to_host(d):
    return d.view(BITS[d.dtype.itemsize]).copy_to_host().view(d.dtype)


def _device_run(fn, arrays, use_cupy: bool):
    dev = [cp.asarray(a) if use_cupy else _to_device(a) for a in arrays]
    fn(*dev)
    return [cp.asnumpy(d) if use_cupy else _to_host(d) for d in dev]


def _host_run(fn, arrays):
    host = [a.copy() for a in arrays]
    fn(*host)
    return host


def check(rng) -> list[dict]:
    rows = []

    def record(what, got, want, host_fn, arrays, out):
        """NaN-tolerant count against numpy; exact count against the host kernels (arrays[out] is written)."""
        row = {"check": what, "n": int(got.size), "wrong_vs_numpy": _wrong(got, want, False)}
        if HOST is not None:  # a GPU's arithmetic returns its canonical NaN: count encodings apart
            host = _host_run(host_fn, arrays)[out]
            row["wrong_vs_host"] = _wrong(got, host, False)
            row["nan_encoding_differs"] = _wrong(got, host, True) - row["wrong_vs_host"]
        rows.append(row)

    wrappers = [("numba", False)] + ([("cupy", True)] if cp is not None else [])
    for dtype in DTYPES:
        for op in OPS:
            if op == "avg" and dtype.kind == "i":
                continue
            scale = 1 / 3 if op == "avg" else 1.0
            for n in [int(s) for s in ARGS.check_sizes.split(",")]:
                for lib, use_cupy in wrappers:
                    if use_cupy and dtype == BF16:
                        continue  # CuPy has no bfloat16
                    a, b = _random(rng, n, dtype), _random(rng, n, dtype)
                    got = _device_run(lambda x, y, op=op, scale=scale: DEV.reduce_into(x, y, op, scale), [a, b],
                                      use_cupy)[0]
                    record(f"reduce_into {op} {dtype} ({lib})", got, _numpy_reduce(a, b, op, scale),
                           lambda x, y, op=op, scale=scale: HOST.reduce_into(x, y, op, scale), [a, b], 0)
    n = max(int(s) for s in ARGS.check_sizes.split(","))
    for dtype in DTYPES:  # the three-operand form (out=): acc and src read, out written
        for op in OPS:
            if op == "avg" and dtype.kind == "i":
                continue
            scale = 1 / 3 if op == "avg" else 1.0
            a, b = _random(rng, n, dtype), _random(rng, n, dtype)
            got = _device_run(lambda x, y, z, op=op, scale=scale: DEV.reduce_into(x, y, op, scale, z),
                              [a, b, np.zeros(n, dtype)], False)
            record(f"reduce_into out= {op} {dtype}", got[2], _numpy_reduce(a, b, op, scale),
                   lambda x, y, z, op=op, scale=scale: HOST.reduce_into(x, y, op, scale, z),
                   [a, b, np.zeros(n, dtype)], 2)
            record(f"reduce_into out= {op} {dtype}: acc unchanged", got[0], a,
                   lambda x, y, z: None, [a, b, np.zeros(n, dtype)], 0)
    for dtype in (F16, BF16, F32, np.dtype(np.float64)):
        buf = _random(rng, 257, dtype)
        arith = np.float64 if dtype == np.float64 else np.float32
        got = _device_run(lambda x: DEV.scale(x, 1 / 3), [buf], False)[0]
        record(f"scale {dtype}", got, (buf.astype(arith) * arith(1 / 3)).astype(dtype),
               lambda x: HOST.scale(x, 1 / 3), [buf], 0)
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    if ARGS.simulate:
        patterns = patterns[rng.integers(0, 1 << 16, 257)]
    wide_bits = rng.integers(0, 1 << 32, ARGS.patterns, dtype=np.uint64).astype(np.uint32)
    for dtype in (F16, BF16):
        src = patterns.view(dtype)
        got = _device_run(DEV.widen, [src, np.zeros(src.size, np.float32)], False)[1]
        record(f"widen {dtype}->float32 (all patterns)", got, src.astype(np.float32),
               HOST and HOST.widen, [src, np.zeros(src.size, np.float32)], 1)
        wide = wide_bits.view(np.float32)
        got = _device_run(DEV.narrow, [wide, np.zeros(wide.size, dtype)], False)[1]
        with np.errstate(over="ignore"):
            want = wide.astype(dtype)
        record(f"narrow float32->{dtype} (random bit patterns)", got, want,
               HOST and HOST.narrow, [wide, np.zeros(wide.size, dtype)], 1)
    return rows


# -- throughput -------------------------------------------------------------------------------------------

@cuda.jit
def _numba_add(a, b):
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] += b[i]


def _sync():
    cuda.synchronize()
    if cp is not None:
        cp.cuda.Device().synchronize()


def _median_seconds(fn) -> float:
    for _ in range(3):
        fn()
    _sync()
    times = []
    for _ in range(ARGS.iters):
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _baseline(kind: str, dtype, x, y):
    """The comparable CuPy call (or numba kernel) on ``x``/``y``, or None where there is none."""
    if dtype == BF16:
        return None
    if cp is None:
        if kind != "reduce sum":
            return None
        blocks = min(-(-x.size // 256), 4096)
        return lambda: _numba_add[blocks, 256](x, y)
    cx, cy = cp.asarray(x), cp.asarray(y)  # zero-copy views of the same device memory
    return {"reduce sum": lambda: cp.add(cx, cy, out=cx),
            "sum+scale": lambda: (cp.add(cx, cy, out=cx), cp.multiply(cx, 0.5, out=cx)),
            "scale": lambda: cp.multiply(cx, 0.5, out=cx),
            "narrow": lambda: cp.copyto(cy, cx, casting="unsafe"),
            "widen": lambda: cp.copyto(cx, cy)}[kind]


def bench() -> list[dict]:
    rows = []
    for mib in [float(s) for s in ARGS.sizes_mib.split(",")]:
        nbytes = int(mib * (1 << 20))
        cases = [("reduce sum", F32), ("reduce sum", F16), ("reduce sum", BF16), ("sum+scale", F32),
                 ("scale", F32), ("narrow", F16), ("narrow", BF16), ("widen", F16), ("widen", BF16)]
        for kind, dtype in cases:
            if kind in ("narrow", "widen"):  # x: float32 operand of nbytes, y: its 16-bit twin
                n = nbytes // 4
                x, y = _to_device(np.ones(n, np.float32)), _to_device(np.ones(n, dtype))
                moved = n * 6
                fn = (lambda: KC.narrow(x, y)) if kind == "narrow" else (lambda: KC.widen(y, x))
            else:
                n = nbytes // dtype.itemsize
                x, y = _to_device(np.ones(n, dtype)), _to_device(np.zeros(n, dtype))
                moved = (3 if kind != "scale" else 2) * n * dtype.itemsize
                fn = {"reduce sum": lambda: KC.reduce_into(x, y, "sum"),
                      "sum+scale": lambda: KC.reduce_into(x, y, "avg", 0.5),
                      "scale": lambda: KC.scale(x, 0.5)}[kind]
            t = _median_seconds(fn)
            base_fn = _baseline(kind, dtype, x, y)
            tb = _median_seconds(base_fn) if base_fn is not None else None
            rows.append({"op": kind, "dtype": str(dtype), "MiB": mib, "count": n, "bytes_moved": moved,
                         "torus_s": t, "torus_GBps": moved / t / 1e9,
                         "baseline": None if tb is None else ("cupy" if cp is not None else "numba add"),
                         "baseline_s": tb, "baseline_GBps": None if tb is None else moved / tb / 1e9})
            x = y = fn = base_fn = None  # free this size's device arrays before the next one's
    return rows


def main() -> int:
    dev = cuda.get_current_device()
    name = getattr(dev, "name", b"CUDA simulator")
    info = {"device": name.decode() if isinstance(name, bytes) else str(name),
            "cc": getattr(dev, "compute_capability", None),
            "simulator": bool(ARGS.simulate), "cupy": None if cp is None else cp.__version__,
            "numba_cuda": importlib.metadata.version("numba-cuda"), "host_kernels": HOST is not None}
    print(json.dumps(info))
    rng = np.random.default_rng(0)
    t0 = time.time()
    with np.errstate(all="ignore"):  # Inf and NaN inputs are deliberate
        checks = check(rng)
    wrong = sum(r["wrong_vs_numpy"] + r.get("wrong_vs_host", 0) for r in checks)
    for r in checks:
        if r["wrong_vs_numpy"] or r.get("wrong_vs_host"):
            print(f"WRONG {r}")
    print(f"{len(checks)} checks, {wrong} wrong elements ({time.time() - t0:.1f} s)")
    perf = bench()
    print(f"{'op':>11s} {'dtype':>9s} {'MiB':>7s} {'count':>11s} {'torus us':>10s} {'GB/s':>8s} "
          f"{'base us':>10s} {'GB/s':>8s}  (base: {perf[0]['baseline'] if perf else '-'})")
    for r in perf:
        base = (f"{r['baseline_s'] * 1e6:10.1f} {r['baseline_GBps']:8.1f}" if r["baseline_s"] is not None
                else f"{'-':>10s} {'-':>8s}")
        print(f"{r['op']:>11s} {r['dtype']:>9s} {r['MiB']:7g} {r['count']:11d} {r['torus_s'] * 1e6:10.1f} "
              f"{r['torus_GBps']:8.1f} {base}")
    if ARGS.out:
        Path(ARGS.out).mkdir(parents=True, exist_ok=True)
        path = Path(ARGS.out) / "gpu_check.json"
        path.write_text(json.dumps({"info": info, "checks": checks, "throughput": perf}, indent=1))
        print(f"wrote {path}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
