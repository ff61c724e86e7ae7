"""Bad arguments raise on the calling rank, before any data message, naming the operation and the rank.

Every rank makes the same bad call here (a mismatch between ranks is a different suite). Each call goes to a
copy of the TorusComm whose communicators and executor raise AssertionError when touched, so a check that
only fires after some communication fails the test. The one message allowed: with the argument check on, the
rank posts its share of the signature all-gather marked "argument error", so that the other ranks fail at
once instead of waiting for it (tests/mpi/test_mismatch.py); the fake communicator records it and the test
asserts it is that mark and nothing else. After each test the real communicator still has to produce a
correct all-reduce.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
from mpi4py import MPI

import torus
from oracle import SIZE, WORLD, assert_matches, expected, make

RANK = WORLD.Get_rank()
F32 = np.float32


class _NoMessages:
    def __getattr__(self, name):
        raise AssertionError(f"communicated ({name}) before rejecting the arguments")


class _Done:
    def Test(self):  # noqa: N802 - mpi4py's name
        return True


class _ErrorReportOnly(_NoMessages):
    """Allows one thing: the signature all-gather, recorded (its send buffer) instead of sent."""

    def __init__(self):
        self.reports = []

    def Iallgather(self, mine, every):  # noqa: N802
        self.reports.append(np.array(mine))
        return _Done()


@pytest.fixture(scope="module")
def real():
    return torus.TorusComm(timeout=120)


@pytest.fixture
def tc(real, rng):
    """A copy of ``real`` that cannot communicate; afterwards ``real`` must still work."""
    offline = copy.copy(real)
    for name in ("cart", "row_comm", "col_comm", "local_comm", "cross_comm", "_executor"):
        setattr(offline, name, _NoMessages())
    offline.comm, offline._announcements = _ErrorReportOnly(), []
    yield offline
    for report in offline.comm.reports:  # only ever the error mark: no signature of a call that goes ahead
        assert report[-1] == 1 and (report[1:-1] == -1).all(), report
    assert len(offline.comm.reports) == (1 if offline.check else 0), offline.comm.reports
    x = make(rng, np.int64, "sum", 10)
    ref, _ = expected(x, "sum")
    for algo in torus.ALGORITHMS:
        assert_matches(real.allreduce(x, op="sum", algorithm=algo), ref, None,
                       f"allreduce({algo}) after a rejected call")


def _readonly(a):
    a.flags.writeable = False
    return a


def _overlapping():
    """sendbuf and recvbuf: two views of one array, shifted by one element."""
    a = np.zeros(N + 1, F32)
    return a[:N], a[1:]


def _ints(n):
    return np.arange(n, dtype=np.int32)


N = 4 * SIZE  # divides into SIZE blocks of 4
ALLREDUCE = {
    "complex dtype": (TypeError, lambda t: t.allreduce(np.zeros(N, np.complex64))),
    "uint8 dtype": (TypeError, lambda t: t.allreduce(np.zeros(N, np.uint8))),
    "bool dtype": (TypeError, lambda t: t.allreduce(np.zeros(N, bool), op="max")),
    "avg on int32": (TypeError, lambda t: t.allreduce(_ints(N), op="avg")),
    "avg on int64": (TypeError, lambda t: t.allreduce(np.zeros(N, np.int64), op="avg", algorithm="ring")),
    "unknown op": (ValueError, lambda t: t.allreduce(np.zeros(N, F32), op="mean")),
    "unknown MPI op": (ValueError, lambda t: t.allreduce(np.zeros(N, np.int32), op=MPI.BAND)),
    "unknown algorithm": (ValueError, lambda t: t.allreduce(np.zeros(N, F32), algorithm="butterfly")),
    "list sendbuf": (TypeError, lambda t: t.allreduce([1.0] * N)),
    "strided sendbuf": (ValueError, lambda t: t.allreduce(np.zeros(2 * N, F32)[::2])),
    "strided recvbuf": (ValueError, lambda t: t.allreduce(np.zeros(N, F32), np.zeros(2 * N, F32)[::2])),
    "fortran-order 2-D sendbuf": (ValueError, lambda t: t.allreduce(np.zeros((3, N), F32, order="F"))),
    "strided in-place buffer": (ValueError, lambda t: t.allreduce(torus.IN_PLACE,
                                                                  np.zeros(2 * N, F32)[::2])),
    "recvbuf too small": (ValueError, lambda t: t.allreduce(np.zeros(N, F32), np.zeros(N - 1, F32))),
    "recvbuf too large": (ValueError, lambda t: t.allreduce(np.zeros(N, F32), np.zeros(N + 1, F32))),
    "recvbuf dtype": (TypeError, lambda t: t.allreduce(np.zeros(N, F32), np.zeros(N, np.float64))),
    "read-only recvbuf": (ValueError, lambda t: t.allreduce(np.zeros(N, F32), _readonly(np.zeros(N, F32)))),
    "read-only in-place buffer": (ValueError, lambda t: t.allreduce(torus.IN_PLACE,
                                                                    _readonly(np.zeros(N, F32)))),
    "in place without buffer": (ValueError, lambda t: t.allreduce(torus.IN_PLACE)),
    "overlapping buffers": (ValueError, lambda t: t.allreduce(*_overlapping())),
}
REDUCE_SCATTER = {
    "recvcounts too short": (ValueError, lambda t: t.reduce_scatter(np.zeros(N, F32),
                                                                    recvcounts=[4] * (SIZE - 1))),
    "recvcounts too long": (ValueError, lambda t: t.reduce_scatter(np.zeros(N, F32), recvcounts=[4] * SIZE + [0])),
    "negative recvcount": (ValueError, lambda t: t.reduce_scatter(np.zeros(N, F32),
                                                                  recvcounts=[-1] + [4] * (SIZE - 1))),
    "recvcounts sum": (ValueError, lambda t: t.reduce_scatter(np.zeros(N + 1, F32), recvcounts=[4] * SIZE)),
    "recvbuf size": (ValueError, lambda t: t.reduce_scatter(np.zeros(N, F32), np.zeros(5, F32))),
    "recvbuf dtype": (TypeError, lambda t: t.reduce_scatter(np.zeros(N, F32), np.zeros(4, np.float16))),
    "read-only recvbuf": (ValueError, lambda t: t.reduce_scatter(np.zeros(N, F32), _readonly(np.zeros(4, F32)))),
    "in-place size": (ValueError, lambda t: t.reduce_scatter(torus.IN_PLACE, np.zeros(N + 1, F32),
                                                             recvcounts=[4] * SIZE)),
    "avg on int32": (TypeError, lambda t: t.reduce_scatter(_ints(N), op="avg")),
    "unknown op": (ValueError, lambda t: t.reduce_scatter(np.zeros(N, F32), op="xor")),
    "unknown algorithm": (ValueError, lambda t: t.reduce_scatter(np.zeros(N, F32), algorithm="tree")),
    "complex dtype": (TypeError, lambda t: t.reduce_scatter(np.zeros(N, np.complex128))),
    "strided sendbuf": (ValueError, lambda t: t.reduce_scatter(np.zeros(2 * N, F32)[::2])),
}
ALLGATHER = {
    "sendbuf size vs recvcounts": (ValueError, lambda t: t.allgather(np.zeros(3, F32), recvcounts=[4] * SIZE)),
    "recvcounts length": (ValueError, lambda t: t.allgather(np.zeros(4, F32), recvcounts=[4] * (SIZE + 1))),
    "recvbuf size": (ValueError, lambda t: t.allgather(np.zeros(4, F32), np.zeros(N + 1, F32))),
    "recvbuf dtype": (TypeError, lambda t: t.allgather(np.zeros(4, F32), np.zeros(N, np.int32))),
    "read-only recvbuf": (ValueError, lambda t: t.allgather(np.zeros(4, F32), _readonly(np.zeros(N, F32)))),
    "strided recvbuf": (ValueError, lambda t: t.allgather(np.zeros(4, F32), np.zeros(2 * N, F32)[::2])),
    "in-place size vs recvcounts": (ValueError, lambda t: t.allgather(torus.IN_PLACE, np.zeros(N, F32),
                                                                      recvcounts=[5] * SIZE)),
    "unknown algorithm": (ValueError, lambda t: t.allgather(np.zeros(4, F32), algorithm="gossip")),
    "uint16 dtype": (TypeError, lambda t: t.allgather(np.zeros(4, np.uint16))),
}
if SIZE > 1:  # with one rank every count splits into equal blocks
    REDUCE_SCATTER["unequal blocks"] = (ValueError, lambda t: t.reduce_scatter(np.zeros(N + 1, F32)))
    ALLGATHER["unequal in-place blocks"] = (ValueError, lambda t: t.allgather(torus.IN_PLACE,
                                                                                np.zeros(N + 1, F32)))


def _raises(tc, what, exc, call):
    with pytest.raises(exc, match=rf"^{what}\b.* on rank {RANK}: "):
        call(tc)


@pytest.mark.parametrize("name", list(ALLREDUCE))
def test_allreduce_rejects(tc, name):
    _raises(tc, "allreduce", *ALLREDUCE[name])


@pytest.mark.parametrize("name", list(REDUCE_SCATTER))
def test_reduce_scatter_rejects(tc, name):
    _raises(tc, "reduce_scatter", *REDUCE_SCATTER[name])


@pytest.mark.parametrize("name", list(ALLGATHER))
def test_allgather_rejects(tc, name):
    _raises(tc, "allgather", *ALLGATHER[name])


@pytest.mark.parametrize("kwargs, why", [
    ({"dims": (2, SIZE)}, "do not multiply"), ({"dims": (SIZE + 1, 1)}, "do not multiply"),
    ({"dims": (0, SIZE)}, "must both be at least 1"), ({"dims": (-1, -SIZE)}, "must both be at least 1"),
    ({"dims": (1, 1, SIZE)}, "must be two numbers"), ({"segment_bytes": -1}, "")], ids=str)
def test_torus_comm_rejects_before_building_communicators(real, kwargs, why):
    with pytest.raises(ValueError, match=rf"^TorusComm on rank {RANK}: .*{why}"):
        torus.TorusComm(**kwargs)
    assert real.allreduce(np.ones(3, F32), op="sum", algorithm="ring").tolist() == [SIZE] * 3


def test_device_array_without_a_usable_gpu_is_refused_before_any_message(world):
    """An object with __cuda_array_interface__ (a stand-in) where numba.cuda finds no GPU, or is the CUDA
    simulator (which cannot view foreign device pointers): a clear TypeError. (GPU buffers themselves are
    tested in test_device.py.)"""
    from numba import cuda
    if cuda.is_available() and not cuda.to_device.__module__.startswith("numba.cuda.simulator"):
        pytest.skip("a GPU is present: the stand-in's null pointer would be taken at its word")

    class FakeDevice:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}

    tc = torus.TorusComm(check=False)
    with pytest.raises(TypeError, match=f"allreduce on rank {world.Get_rank()}: sendbuf is a GPU array, but "
                                        "numba.cuda cannot use it here"):
        tc.allreduce(FakeDevice())
    tc.Free()


@pytest.mark.parametrize("mpi_op, op", [(MPI.SUM, "sum"), (MPI.MIN, "min"), (MPI.MAX, "max"),
                                        (MPI.PROD, "prod")])
def test_mpi4py_ops_name_the_same_reductions(real, rng, mpi_op, op):
    """mpi4py's MPI.SUM etc. are taken for the names, matching MPI_Allreduce with that op."""
    x = make(rng, np.int64, op, 37)
    ref = np.empty_like(x)
    WORLD.Allreduce(x, ref, op=mpi_op)
    for algo in torus.ALGORITHMS:
        np.testing.assert_array_equal(real.allreduce(x, op=mpi_op, algorithm=algo), ref, f"{op} {algo}")
