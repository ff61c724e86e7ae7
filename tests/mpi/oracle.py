"""What the collective suites share: the configurations under test, fresh data per dtype and op, the oracle
(MPI's own ``Allreduce`` on every rank's input) and the error bound each comparison allows.

Error bounds (unit roundoff ``u``: 2**-11 float16, 2**-8 bfloat16, 2**-24 float32, 2**-53 float64):

* Integers, min and max, and float data made of small integers (sums and products stay exactly
  representable, so no rounding can happen in any order): exact.
* A float sum over ``p`` ranks takes ``p - 1`` pairwise operations; each rounds once, by at most
  ``u * |partial|`` and ``|partial| <= S = sum_i |x_i|``, so any order is within ``(p-1) u S`` of the exact sum
  (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 4.2). For float16/bfloat16
  each hop widens both operands to float32, adds (error ``<= u32 |partial|``, ``u32 = 2**-24``) and rounds
  once to 16 bits, so ``u + u32`` per hop. The reference accumulates in ``u_ref`` precision (float64; float32
  for the 16-bit types, then rounded once to the 16-bit type, as the issue asks): ``(p-1) u_ref S`` more,
  and for the 16-bit types ``u |ref|``. Bound: ``(p-1)(u + 2 u_ref) S + u_16 |ref|``.
* avg is the sum times ``fl(1/p)``: the sum's bound divided by ``p`` plus two roundings (``1/p`` and the
  product), ``2u |ref|``.
* prod of ``p`` values: ``p - 1`` multiplications, each with relative error ``<= u`` (+ ``u32`` for the
  16-bit types' float32 step), the reference's as many in ``u_ref`` and its final rounding: relative
  ``(p-1)(u + 2 u_ref) + u_16``.
* These first-order bounds (the avg term too) are multiplied by 1.05, which covers the second-order terms
  (``(1+u)^k - 1 <= 1.05 k u`` while ``k u <= 0.05``; at most ``5 * 2**-8`` here).
* Everything gets ``p`` times the smallest subnormal on top: below the normal range rounding is absolute.
"""
from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import torus
from torus.topology import default_dims

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32),
          np.dtype(np.int64)]
FLOATS = DTYPES[:4]
OPS = ["sum", "avg", "min", "max", "prod"]
_U = {np.dtype(np.float16): 2.0 ** -11, BF16: 2.0 ** -8, np.dtype(np.float32): 2.0 ** -24,
      np.dtype(np.float64): 2.0 ** -53}
_MPI_OP = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

# Every algorithm (shm: one node, shared memory), and every grid / node layout the issue names (unequal nodes:
# rpn2 at 3 and 5 ranks, rpn3 at 4 and 5 (3+2), rpn4 at 5 and 6); ids are stable across sizes so that the same
# tests are collected (in the same order) on every rank.
# hierarchical-nodes takes the real nodes (COMM_TYPE_SHARED): run across hosts by tests/cluster; on one host
# it is the same layout as one node of all ranks. Across several (emulated) nodes the node-level phases of
# hierarchical and torus2d run over shared memory (torus/schedules/phases.py; TORUS_SHM_PHASES=0 runs the
# suites without): torus2d-rpn2 (the default grid, rows the nodes of 2 at
# 4 and 6 ranks), torus2d-3x2-rpn3 and torus2d-2x3-rpn4 (rows inside nodes of 4 and 2) at 6 ranks;
# hierarchical-rpn2-p2p keeps MPI's messages there. swing: the default grid (a line at 1, 2, 3 and 5 ranks,
# 2x2 at 4, 2x3 at 6: the column folded), swing-1xN the line at 4 and 6 (folded at 6), swing-3x2 the row
# folded (6 ranks); swing_latency the latency-optimal all-reduce at every count on the default grid (swing
# itself takes it up to TORUS_SWING_LATENCY_BYTES).
CASES = ["ring", "native", "shm", "torus2d-1xN", "torus2d-Nx1", "torus2d-2x2", "torus2d-2x3", "torus2d-3x2",
         "torus2d-rpn2", "torus2d-3x2-rpn3", "torus2d-2x3-rpn4", "hierarchical-rpn1", "hierarchical-rpn2",
         "hierarchical-rpn3", "hierarchical-rpn4", "hierarchical-rpnN", "hierarchical-nodes", "hierarchical-rpn2-p2p",
         "swing", "swing-1xN", "swing-3x2", "swing_latency"]
_comms: dict = {}
# recvcounts patterns for reduce-scatter and all-gather; those in BLOCK_FORM are passed as recvcounts=None.
PATTERNS = {
    "block0": [0] * SIZE,
    "block1": [1] * SIZE,
    "block7": [7] * SIZE,
    "uneven": [2 * r + 1 for r in range(SIZE)],
    "zeros": [0 if r % 2 else 5 + r for r in range(SIZE)],
    "last-only": [0] * (SIZE - 1) + [7],
    "large": [131_073] * SIZE,
}
BLOCK_FORM = ("block0", "block1", "block7", "large")


def one_node() -> bool:
    """Every rank shares this node's memory (collective on the first call, then cached): the cluster suites
    run these files across emulated hosts, where the shm case does not apply."""
    if "one node" not in _comms:
        shared = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        _comms["one node"] = WORLD.allreduce(shared.Get_size(), op=MPI.MIN) == SIZE
        shared.Free()
    return _comms["one node"]


def _config(case: str):
    """(algorithm, TorusComm keyword arguments) of a case, or skip when it does not fit this size."""
    algo, _, layout = case.partition("-")
    if algo == "shm" and not one_node():
        pytest.skip("the ranks span several nodes; shm serves one node")
    if algo == "torus2d" and layout.startswith("rpn"):  # the grid TorusComm picks on emulated nodes
        if SIZE not in (4, 6):
            pytest.skip(f"at {SIZE} ranks no grid axis of several ranks lies inside nodes of 2")
        return algo, {"ranks_per_node": 2}
    if algo == "swing" and layout == "1xN" and 1 in default_dims(SIZE):
        pytest.skip("the default grid is this line already")
    if algo == "torus2d" or algo == "swing" and layout:
        grid, _, nodes = layout.partition("-")
        X, Y = (SIZE if d == "N" else int(d) for d in grid.split("x"))
        if X * Y != SIZE:
            pytest.skip(f"a {grid} grid does not fit {SIZE} ranks")
        if grid == "Nx1" and SIZE == 1:
            pytest.skip("the same 1x1 grid as 1xN")
        return algo, {"dims": (X, Y), **({"ranks_per_node": int(nodes[3:])} if nodes else {})}
    if algo == "hierarchical" and layout == "nodes":
        if one_node():
            pytest.skip("one real node: the same layout as rpnN")
        return algo, {}
    if algo == "hierarchical" and layout.endswith("-p2p"):
        if SIZE < 3:
            pytest.skip("one node: no node-level phases to keep off shared memory")
        return algo, {"ranks_per_node": 2, "shm_phases": False}
    if algo == "hierarchical":
        rpn = SIZE if layout == "rpnN" else int(layout[3:])
        if layout == "rpnN" and SIZE <= 2 or layout in ("rpn3", "rpn4") and SIZE <= rpn or rpn > SIZE:
            pytest.skip("the same node layout as another case")
        return algo, {"ranks_per_node": rpn}
    return algo, {}


def torus_comm(case: str, segment_bytes: int | None = None, c_loop: bool = True):
    """(TorusComm, algorithm) for a case; communicators are built once per configuration (collectively:
    every rank runs the same tests in the same order) and reused, so the suites do not exhaust MPI's
    communicator ids. ``c_loop=False``: host buffers run through the Python step loop even where the C one
    (torus/runtime/c_step_loop.py) is available."""
    algo, kwargs = _config(case)
    key = (tuple(sorted(kwargs.items())), segment_bytes, c_loop)
    if key not in _comms:
        _comms[key] = torus.TorusComm(segment_bytes=segment_bytes, timeout=120, **kwargs)
        _comms[key]._executor.c_loop = c_loop
    return _comms[key], algo


def make(rng, dtype, op: str, count: int, exact: bool = True) -> np.ndarray:
    """Fresh data for ``op``: exact-friendly small integers, or (``exact=False``, floats only) standard
    normal values (prod: magnitudes in [0.5, 1.5] with random signs, so products of 6 stay in range)."""
    dt = np.dtype(dtype)
    if dt.kind == "i":
        info = np.iinfo(dt)
        if op == "prod":
            v = rng.integers(-3, 4, count)
        elif op == "sum":  # as large as SIZE <= 6 terms allow without overflow
            v = rng.integers(info.min // 8, info.max // 8, count)
        else:
            v = rng.integers(info.min, info.max, count, endpoint=True)
    elif exact:
        v = rng.integers(-2, 3, count) if op == "prod" else rng.integers(-8, 9, count)
    elif op == "prod":
        v = rng.choice([-1.0, 1.0], count) * rng.uniform(0.5, 1.5, count)
    else:
        v = rng.standard_normal(count)
    return v.astype(dt)


def sentinel(count: int, dtype) -> np.ndarray:
    """A recvbuf that shows every element the collective failed to write: NaN, or the most negative int."""
    dt = np.dtype(dtype)
    return np.full(count, np.iinfo(dt).min if dt.kind == "i" else np.nan, dt)


def expected(x: np.ndarray, op: str, exact: bool = True):
    """(reference, bound) for ``op`` over every rank's ``x``: int64 and None (exact) for integers, float64
    arrays otherwise. The oracle is ``MPI_Allreduce`` on ``x`` widened (see the module docstring)."""
    p, flat = SIZE, x.reshape(-1)
    if x.dtype.kind == "i":
        ref = np.empty(flat.size, np.int64)
        WORLD.Allreduce(flat.astype(np.int64), ref, op=_MPI_OP[op])
        return ref, None
    half = x.dtype in (np.dtype(np.float16), BF16)
    acc = np.float32 if half else np.float64
    ref = np.empty(flat.size, acc)
    WORLD.Allreduce(flat.astype(acc), ref, op=_MPI_OP[op])
    if half:
        ref = ref.astype(x.dtype)  # the float32 reduction rounded once
    ref = ref.astype(np.float64)
    u, u_ref = _U[x.dtype], 2.0 ** -24 if half else 2.0 ** -53
    bound = np.zeros(flat.size)
    u16 = u if half else 0.0
    if not exact and op in ("sum", "avg"):
        total_abs = np.empty(flat.size)
        WORLD.Allreduce(np.abs(flat.astype(np.float64)), total_abs)
        bound = 1.05 * ((p - 1) * (u + 2 * u_ref) * total_abs + u16 * np.abs(ref))
    elif not exact and op == "prod":
        bound = 1.05 * ((p - 1) * (u + 2 * u_ref) + u16) * np.abs(ref)
    if op == "avg":
        ref = ref / p
        bound = bound / p + 1.05 * 2 * u * np.abs(ref)
    if not exact:
        bound = bound + p * float(ml_dtypes.finfo(x.dtype).smallest_subnormal)
    return ref, bound


def assert_matches(result: np.ndarray, ref: np.ndarray, bound, what: str) -> None:
    """Elementwise ``|result - ref| <= bound`` (``bound`` None: exactly equal); names the first bad index."""
    got = result.reshape(-1)
    if bound is None:
        bad = got.astype(np.int64) != ref
        err = ""
    else:
        got = got.astype(np.float64)
        bad = ~(np.abs(got - ref) <= bound)
    if bad.any():
        i = int(np.argmax(bad))
        err = f" (allowed {bound[i]:.3g})" if bound is not None else ""
        raise AssertionError(f"{what} on rank {WORLD.Get_rank()}: {int(bad.sum())} of {got.size} elements "
                             f"wrong, first at index {i}: got {got[i]!r}, expected {ref[i]!r}{err}")


def assert_same_on_all_ranks(result: np.ndarray, what: str) -> None:
    """Every rank holds bitwise the same bytes (compared through a 128-bit digest of them)."""
    digest = hashlib.blake2b(np.ascontiguousarray(result).view(np.uint8).tobytes(), digest_size=16).digest()
    every = WORLD.allgather(digest)
    differ = [r for r, d in enumerate(every) if d != every[0]]
    assert not differ, f"{what}: ranks {differ} hold different bytes than rank 0"


def unchanged(before: np.ndarray, after: np.ndarray, what: str) -> None:
    assert before.tobytes() == after.tobytes(), f"{what} on rank {WORLD.Get_rank()}: sendbuf was modified"
