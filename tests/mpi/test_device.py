"""Collectives on GPU buffers: every algorithm, grid and node layout, both ways of handling them (``host``:
the whole buffer reduced in pinned host memory; ``gpu``: ``gpu_reduce=True``, reduced on the GPU with each
message staged through a host mirror, ``torus/runtime/memory.py``), against MPI_Allreduce (oracle.py) and
bit for bit against the same call on host buffers.

Without a GPU this runs under numba's CUDA simulator (turned on here, before numba.cuda is first imported in
this process): device arrays are then host memory behind numba's device-array interface, so the staging
logic (which regions are copied to the host mirror before a send, which receives are copied to the device)
and the kernel dispatch are what is tested. With ``NUMBA_ENABLE_CUDASIM=0`` set and a GPU present the same
tests run on the GPU (bench/gpu/gpu_run.sh). The simulator runs one Python thread per GPU thread, so counts stay
small (37 elements, segments of 16 bytes so every chunk is several messages).
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

if _set_here:
    del os.environ["NUMBA_ENABLE_CUDASIM"]
SIMULATED = cuda.to_device.__module__.startswith("numba.cuda.simulator")
if not SIMULATED and not cuda.is_available():
    pytest.skip("numba.cuda was imported for real hardware and there is no GPU", allow_module_level=True)

from test_avg_range import assert_finite_mean, big_inputs, exact_mean  # noqa: E402

import torus  # noqa: E402
from oracle import (  # noqa: E402
    BF16,
    CASES,
    PATTERNS,
    SIZE,
    WORLD,
    assert_matches,
    assert_same_on_all_ranks,
    expected,
    make,
    sentinel,
    torus_comm,
)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
COUNT = 37
SEGMENT = 16
STAGING = ["host", "gpu"]


def comm(case: str, staging: str, segment_bytes: int | None = SEGMENT):
    tc, algo = torus_comm(case, segment_bytes=segment_bytes)
    tc.gpu_reduce = staging == "gpu"  # changes no message, so the cached communicators can be shared
    return tc, algo


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def to_device(a: np.ndarray):
    """A device copy of ``a``, through an unsigned view: numba copies through the buffer protocol, which has
    no float16 or bfloat16."""
    return cuda.to_device(a.view(_UINT[a.dtype.itemsize])).view(a.dtype)


def to_host(d) -> np.ndarray:
    return d.view(_UINT[d.dtype.itemsize]).copy_to_host().view(d.dtype)


@pytest.mark.parametrize("staging", STAGING)
@pytest.mark.parametrize("mode", ["in", "out"])
@pytest.mark.parametrize("dtype, op", [(BF16, "sum"), (np.dtype(np.float16), "avg"), (np.dtype(np.float32), "max"),
                                       (np.dtype(np.float32), "avg"), (np.dtype(np.int32), "sum")], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_allreduce(case, staging, dtype, op, mode, rng):
    tc, algo = comm(case, staging)
    x = make(rng, dtype, op, COUNT)
    what = f"device allreduce({algo}, {op}, {dtype}, {mode})"
    host = tc.allreduce(x, op=op, algorithm=algo)
    if mode == "in":
        d = to_device(x)
        assert tc.allreduce(torus.IN_PLACE, d, op=op, algorithm=algo) is d
    else:
        send, d = to_device(x), to_device(sentinel(COUNT, dtype))
        assert tc.allreduce(send, d, op=op, algorithm=algo) is d
        assert _bits(to_host(send)) == _bits(x), f"{what}: sendbuf was modified"
    got = to_host(d)
    ref, bound = expected(x, op)
    assert_matches(got, ref, bound, what)
    assert _bits(got) == _bits(host), f"{what}: device and host results differ in their bits"
    assert_same_on_all_ranks(got, what)


@pytest.mark.parametrize("case", ["torus2d-rpn2", "hierarchical-rpn2", "hierarchical-rpn3"])
def test_phased_calls_run_their_plans_on_the_device(case, monkeypatch, rng):
    """Across (emulated) nodes, a phased all-reduce of a device buffer reduced on the GPU runs its plans on the
    device and only its shared-memory phases through the host mirror, in the phases' order, instead of
    staging the whole call (a rank alone on its node has no shared-memory phase); the result is the
    oracle's and the host call's bits."""
    from torus.runtime import executor
    from torus.schedules import phases

    tc, algo = comm(case, "gpu")
    if not tc.shm_phases or phases.node_level("allreduce", algo, tc.topology) is None:
        pytest.skip("no node-level phase of several ranks in this layout")
    seen: list = []
    for cls, name, kind in [(executor._ShmPhase, "run_device", "shm"), (executor.Executor, "run_device", "plan")]:
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *a, real=real, kind=kind, **k: (seen.append(kind), real(*a, **k))[1])
    x = make(rng, np.float32, "sum", COUNT)
    host = tc.allreduce(x, algorithm=algo)
    d = to_device(x)
    tc.allreduce(torus.IN_PLACE, d, algorithm=algo)
    got = to_host(d)
    want = ["shm" if isinstance(ph, executor._ShmPhase) else "plan"
            for ph in tc._executor.phases("allreduce", algo, tc.topology, COUNT, 4, True)]
    assert seen == want, (seen, want)
    assert WORLD.allreduce(want.count("shm")), "no rank ran a shared-memory phase"
    assert_matches(got, *expected(x, "sum"), f"device phased allreduce({algo})")
    assert _bits(got) == _bits(host), f"device phased allreduce({algo}): device and host results differ"


@pytest.mark.parametrize("staging", STAGING)
@pytest.mark.parametrize("count", [0, 1, max(SIZE - 1, 0), 1003])
@pytest.mark.parametrize("case", ["ring", "native", "torus2d-2x2", "torus2d-2x3", "hierarchical-rpn2"])
def test_allreduce_counts_and_allocation(case, staging, count, rng):
    """recvbuf=None allocates a device array; counts 0, 1 and fewer than the ranks; default segments."""
    tc, algo = comm(case, staging, None)
    x = make(rng, np.float32, "sum", count)
    out = tc.allreduce(to_device(x), algorithm=algo)
    assert torus.kernels.is_device(out) and out.shape == x.shape and out.dtype == x.dtype
    assert_matches(to_host(out), *expected(x, "sum"), f"device allreduce({algo}, count={count})")


@pytest.mark.parametrize("staging", STAGING)
@pytest.mark.parametrize("mode", ["in", "out"])
@pytest.mark.parametrize("pattern", ["uneven", "zeros", "block7"])
@pytest.mark.parametrize("case", CASES)
def test_reduce_scatter(case, staging, pattern, mode, rng):
    tc, algo = comm(case, staging)
    counts = PATTERNS[pattern]
    x = make(rng, np.float32, "avg", sum(counts))
    lo, hi = sum(counts[:WORLD.Get_rank()]), sum(counts[:WORLD.Get_rank() + 1])
    what = f"device reduce_scatter({algo}, {pattern}, {mode})"
    host = tc.reduce_scatter(x, recvcounts=counts, op="avg", algorithm=algo)
    if mode == "in":
        d = to_device(x)
        tc.reduce_scatter(torus.IN_PLACE, d, recvcounts=counts, op="avg", algorithm=algo)
        full = to_host(d)
        got = full[lo:hi]
        outside = np.concatenate([full[:lo], full[hi:]])
        assert _bits(outside) == _bits(np.concatenate([x[:lo], x[hi:]])), f"{what}: wrote outside its block"
    else:
        d = to_device(sentinel(hi - lo, np.float32))
        assert tc.reduce_scatter(to_device(x), d, recvcounts=counts, op="avg", algorithm=algo) is d
        got = to_host(d)
    ref, bound = expected(x, "avg")
    assert_matches(got, ref[lo:hi], bound[lo:hi], what)
    assert _bits(got) == _bits(host), f"{what}: device and host results differ in their bits"


@pytest.mark.parametrize("staging", STAGING)
@pytest.mark.parametrize("mode", ["in", "out"])
@pytest.mark.parametrize("pattern", ["uneven", "zeros", "block7"])
@pytest.mark.parametrize("case", CASES)
def test_allgather(case, staging, pattern, mode, rng):
    tc, algo = comm(case, staging)
    counts = PATTERNS[pattern]
    rank = WORLD.Get_rank()
    mine = make(rng, BF16, "max", counts[rank])
    every = WORLD.allgather(mine)  # the oracle: every rank's block, in rank order
    want = np.concatenate(every) if every else mine
    lo = sum(counts[:rank])
    d = to_device(sentinel(sum(counts), BF16))
    if mode == "in":
        if mine.size:
            d[lo:lo + mine.size].view(np.uint16).copy_to_device(mine.view(np.uint16))
        tc.allgather(torus.IN_PLACE, d, recvcounts=counts, algorithm=algo)
    else:
        tc.allgather(to_device(mine), d, recvcounts=counts, algorithm=algo)
    got = to_host(d)
    assert _bits(got) == _bits(want), f"device allgather({algo}, {pattern}, {mode}) on rank {rank}: wrong"


@pytest.mark.parametrize("threshold, on_gpu", [(1 << 30, False), (64, True)])
def test_by_default_large_buffers_are_reduced_on_the_gpu(monkeypatch, threshold, on_gpu, rng):
    """gpu_reduce=None: the GPU path (Executor.run_device) from GPU_REDUCE_MIN_BYTES up, the host path below; the
    threshold is lowered here so that a simulated 37-element buffer (148 bytes) crosses it."""
    tc, algo = comm("ring", "gpu")
    tc.gpu_reduce = None
    monkeypatch.setattr(torus.comm, "GPU_REDUCE_MIN_BYTES", threshold)
    calls = []
    runtime = type(tc._executor)
    real = runtime.run_device
    monkeypatch.setattr(runtime, "run_device", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    x = make(rng, np.float32, "sum", COUNT)
    d = to_device(x)
    tc.allreduce(torus.IN_PLACE, d, algorithm=algo)
    assert_matches(to_host(d), *expected(x, "sum"), "allreduce with gpu_reduce=None")
    assert bool(calls) == on_gpu, f"reduced on the {'host' if on_gpu else 'GPU'}, expected the other"


def test_host_and_device_buffers_mixed_raise_before_any_message():
    tc, _ = torus_comm("ring")
    x = np.ones(8, np.float32)
    with pytest.raises(TypeError, match=rf"allreduce on rank {WORLD.Get_rank()}: sendbuf is in GPU memory "
                                        "and recvbuf in host memory"):
        tc.allreduce(to_device(x), np.empty(8, np.float32))
    with pytest.raises(TypeError, match="sendbuf is in host memory and recvbuf in GPU memory"):
        tc.allreduce(x, to_device(x))
    d = to_device(np.ones(16, np.float32))
    with pytest.raises(ValueError, match=r"sendbuf \(device array\) is not C-contiguous"):
        tc.allreduce(d.reshape(4, 4)[:, ::2], cuda.device_array((4, 2), np.float32))
    with pytest.raises(ValueError, match="overlap"):
        tc.allreduce(d[0:8], d[4:12])
    # Every rank raised locally and (check on) announced it; this call completes those announcements.
    assert_matches(tc.allreduce(x), np.full(8, SIZE), None, "allreduce after the errors")


@pytest.mark.parametrize("staging", STAGING)
@pytest.mark.parametrize("case", CASES)
def test_avg_of_large_halves_does_not_overflow(case, staging, rng):
    """GPU buffers, both stagings: float16 inputs whose partial sums leave the range, the mean does not
    (test_avg_range.py has the host suite and the bound)."""
    tc, algo = comm(case, staging)
    x = big_inputs(rng, np.dtype(np.float16), COUNT)
    ref, bound = exact_mean(x)
    d = to_device(x)
    tc.allreduce(torus.IN_PLACE, d, op="avg", algorithm=algo)
    got = to_host(d)
    assert_finite_mean(got, ref, bound, f"device allreduce({algo}, avg, {staging})")
    assert_same_on_all_ranks(got, f"device allreduce({algo}, avg, {staging})")
    counts = [COUNT // SIZE + (r < COUNT % SIZE) for r in range(SIZE)]
    lo, hi = sum(counts[:WORLD.Get_rank()]), sum(counts[:WORLD.Get_rank() + 1])
    out = tc.reduce_scatter(to_device(x), recvcounts=counts, op="avg", algorithm=algo)
    assert_finite_mean(to_host(out), ref[lo:hi], bound[lo:hi], f"device reduce_scatter({algo}, avg, {staging})")
