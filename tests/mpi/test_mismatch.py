"""Ranks that call a collective with different arguments: with ``check`` on, every rank raises MismatchError
naming its own operation and rank, the field that differs and which ranks hold which value, before any data
moves; the communicator stays usable (the next correct collective matches MPI_Allreduce).

The last rank is the odd one out in every case. Budget: 10 cases of a few small calls, under 2 s per K.
"""
from __future__ import annotations

import numpy as np
import pytest

import torus
from oracle import SIZE, WORLD, sentinel

RANK, LAST = WORLD.Get_rank(), SIZE - 1
ODD = RANK == LAST
# How the message lists the ranks that agree with rank 0 and the odd one: "rank 0 has" / "ranks 0-4 have".
MOST = "rank 0 has" if LAST == 1 else f"ranks 0-{LAST - 1} have"

pytestmark = pytest.mark.skipif(SIZE < 2, reason="a disagreement needs two ranks")


@pytest.fixture(scope="module")
def tc():
    comm = torus.TorusComm(timeout=60)
    yield comm
    comm.Free()


def allreduce(tc, count=5, dtype=np.float64, op="sum", algorithm="ring"):
    """An out-of-place all-reduce into a sentinel recvbuf that must stay untouched when the check fails."""
    recvbuf = sentinel(count, dtype)
    try:
        tc.allreduce(np.ones(count, dtype), recvbuf, op=op, algorithm=algorithm)
    finally:
        assert np.isnan(recvbuf).all(), f"rank {RANK}: data moved before the check"


def reduce_scatter(tc, recvcounts):
    tc.reduce_scatter(np.ones(sum(recvcounts)), recvcounts=recvcounts, algorithm="ring")


def allgather(tc, count):
    tc.allgather(np.ones(count), algorithm="ring")


BLOCKS = list(range(1, SIZE + 1))
# id: (this rank's call, the operation it names, the differing field, rank 0's value, the odd rank's value).
CASES = {
    "count": (lambda tc: allreduce(tc, count=6 if ODD else 5), "allreduce(ring)", "count", "5", "6"),
    "dtype": (lambda tc: allreduce(tc, dtype=np.float32 if ODD else np.float64), "allreduce(ring)", "dtype",
              "float64", "float32"),
    "op": (lambda tc: allreduce(tc, op="max" if ODD else "sum"), "allreduce(ring)", "op", "sum", "max"),
    "algorithm": (lambda tc: allreduce(tc, algorithm="torus2d" if ODD else "ring"),
                  "allreduce(torus2d)" if ODD else "allreduce(ring)", "algorithm", "ring", "torus2d"),
    "allreduce-vs-allgather": (lambda tc: allgather(tc, 1) if ODD else allreduce(tc, count=SIZE),
                               "allgather(ring)" if ODD else "allreduce(ring)", "collective", "allreduce",
                               "allgather"),
    "allreduce-vs-reduce_scatter": (lambda tc: reduce_scatter(tc, [1] * SIZE) if ODD else allreduce(tc, SIZE),
                                    "reduce_scatter(ring)" if ODD else "allreduce(ring)", "collective",
                                    "allreduce", "reduce_scatter"),
    "recvcounts": (lambda tc: reduce_scatter(tc, BLOCKS[::-1] if ODD else BLOCKS), "reduce_scatter(ring)",
                   "recvcounts", str(BLOCKS), str(BLOCKS[::-1])),
    "allgather-count": (lambda tc: allgather(tc, 4 if ODD else 3), "allgather(ring)", "count",
                        str(3 * SIZE), str(4 * SIZE)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_names_the_disagreement(tc, world, case):
    call, operation, field, common, odd = CASES[case]
    with pytest.raises(torus.MismatchError) as info:
        call(tc)
    msg = str(info.value)
    assert msg.startswith(f"{operation} on rank {RANK}: ranks disagree on "), msg
    assert f"{field} ({MOST} {common}" in msg and f"rank {LAST} has {odd}" in msg, msg
    # Still usable: the next correct call on the same communicator agrees with MPI.
    x = np.random.default_rng([7, RANK]).standard_normal(10)
    ref = np.empty_like(x)
    world.Allreduce(x, ref)
    np.testing.assert_allclose(tc.allreduce(x, algorithm="ring"), ref, rtol=1e-12)


@pytest.mark.parametrize("field, kwargs", [
    ("segment_bytes", {"segment_bytes": 1024 if ODD else 4096}),
    ("grid", {"dims": (SIZE, 1) if ODD else (1, SIZE)}),
])
def test_communicator_settings_disagree(field, kwargs):
    """TorusComm arguments that must be equal on every rank (segment size, grid) are checked on each call."""
    tc = torus.TorusComm(timeout=60, **kwargs)
    try:
        with pytest.raises(torus.MismatchError, match=f"on rank {RANK}: ranks disagree on {field} "):
            allreduce(tc)
    finally:
        tc.Free()



BAD_ARGUMENTS = {
    # id: (the odd rank's bad call, the error it raises itself)
    "dtype": (lambda tc: tc.allreduce(np.ones(5, np.uint8), algorithm="ring"), TypeError),
    "recvbuf size": (lambda tc: tc.allreduce(np.ones(5), np.empty(4), algorithm="ring"), ValueError),
    "recvcounts": (lambda tc: tc.reduce_scatter(np.ones(SIZE), recvcounts=[1] * (SIZE + 1), algorithm="ring"),
                   ValueError),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_a_rank_with_bad_arguments_ends_the_call_everywhere(tc, world, case):
    """The odd rank raises its own error; the others raise MismatchError naming it at once (not after the
    stall timeout, 60 s here); all of them go on with the next correct call."""
    bad_call, own_error = BAD_ARGUMENTS[case]
    if ODD:
        with pytest.raises(own_error, match=f"on rank {RANK}: "):
            bad_call(tc)
    else:
        with pytest.raises(torus.MismatchError) as info:
            allreduce(tc)
        assert str(info.value).startswith(
            f"allreduce(ring) on rank {RANK}: rank {LAST} rejected its own arguments to this call"), info.value
    x = np.random.default_rng([9, RANK]).standard_normal(10)
    ref = np.empty_like(x)
    world.Allreduce(x, ref)
    np.testing.assert_allclose(tc.allreduce(x, algorithm="ring"), ref, rtol=1e-12)
