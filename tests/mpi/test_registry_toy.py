"""A toy algorithm registered in the registry alone (tests/mpi/toy_algorithm.py) runs through TorusComm, named
(``algorithm=``) and through ``TORUS_ALGO``: all-reduce, reduce-scatter and all-gather on random data with odd
counts against numpy's reduction of every rank's input."""
from __future__ import annotations

import numpy as np
import pytest
import toy_algorithm
from mpi4py import MPI

import torus

WORLD = MPI.COMM_WORLD
SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()
toy_algorithm.register()
COUNTS = [1, 7, 1001, 12_345]
_comms: dict = {}


def _comm(key: str) -> torus.TorusComm:
    if key not in _comms:  # one per use, made collectively (every rank runs the same tests in order)
        _comms[key] = torus.TorusComm(timeout=120)
    return _comms[key]


def _data(count: int, dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, RANK, count])
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def _every(x: np.ndarray) -> np.ndarray:
    return np.stack(WORLD.allgather(x))  # (ranks, count): numpy reduces this


def _close(got, want, what):
    if got.dtype.kind == "i":
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=what)


def _odd_counts(total: int) -> list:
    """Per-rank blocks of ``total`` elements, uneven and the same on every rank."""
    rng = np.random.default_rng(total)
    cuts = np.sort(rng.integers(0, total + 1, SIZE - 1))
    return list(np.diff(np.concatenate([[0], cuts, [total]])).astype(int))


@pytest.fixture(params=["named", "TORUS_ALGO"])
def how(request, monkeypatch):
    """(TorusComm, algorithm argument): the toy named, or ``auto`` with TORUS_ALGO naming it."""
    if request.param == "named":
        return _comm("named"), toy_algorithm.NAME
    monkeypatch.setenv("TORUS_ALGO", toy_algorithm.NAME)
    return _comm("env"), "auto"


@pytest.mark.parametrize("dtype", [np.float64, np.int64], ids=str)
@pytest.mark.parametrize("count", COUNTS)
def test_allreduce(how, count, dtype):
    tc, algo = how
    x = _data(count, dtype, 1)
    out = tc.allreduce(x, op="sum", algorithm=algo)
    _close(out, _every(x).sum(axis=0), f"allreduce({algo}, {count})")
    # what ran: the shape's decision, the toy's plan rather than a built-in's
    assert tc._shapes.get("allreduce", algo, "sum", _placement(tc, x))[0] == toy_algorithm.NAME


@pytest.mark.parametrize("dtype", [np.float64, np.int64], ids=str)
@pytest.mark.parametrize("count", COUNTS)
def test_reduce_scatter(how, count, dtype):
    tc, algo = how
    counts = _odd_counts(count)
    x = _data(count, dtype, 2)
    out = tc.reduce_scatter(x, recvcounts=counts, op="sum", algorithm=algo)
    lo = sum(counts[:RANK])
    _close(out, _every(x).sum(axis=0)[lo:lo + counts[RANK]], f"reduce_scatter({algo}, {counts})")


@pytest.mark.parametrize("dtype", [np.float64, np.int64], ids=str)
@pytest.mark.parametrize("count", COUNTS)
def test_allgather(how, count, dtype):
    tc, algo = how
    counts = _odd_counts(count)
    x = _data(counts[RANK], dtype, 3)
    out = tc.allgather(x, recvcounts=counts, algorithm=algo)
    _close(out, np.concatenate(WORLD.allgather(x)), f"allgather({algo}, {counts})")


def _placement(tc, x):
    from torus import buffers
    return buffers.resolve(buffers.ALLREDUCE, tc.rank, tc.size, x, None, "sum", None)
