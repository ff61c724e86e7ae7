"""Property tests: random count, dtype, op, algorithm, grid, node layout, segment size and buffer mode, checked
against MPI's own collectives on every rank's input (oracle.py: ``MPI_Allreduce`` on widened copies, with its
rounding bounds; all-gather exactly against ``comm.allgather``).

Every rank must draw the same examples, or the ranks call different collectives: hypothesis runs derandomized
(its seed is a digest of the test function, the same on every rank), without its example database, and
without shrinking (whose wall-clock limit could end it at different points on different ranks). Each
example's verdict is all-gathered, so every rank passes or fails the same example together.

Budget: 25 + 15 + 15 examples of at most 1,500 elements, about 10 s per K at K=6 on 2 cores.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import torus
from oracle import DTYPES, OPS, SIZE, WORLD, assert_matches, assert_same_on_all_ranks, expected, make, one_node

SETTINGS = dict(derandomize=True, database=None, deadline=None, phases=(Phase.explicit, Phase.generate),
                suppress_health_check=list(HealthCheck))
# shm serves one node: left out where the ranks span hosts (tests/cluster runs this file across them)
ALGORITHMS = tuple(a for a in torus.ALGORITHMS if a != "shm" or one_node()) + ("auto",)
GRIDS = [(x, SIZE // x) for x in range(1, SIZE + 1) if SIZE % x == 0]
_comms: dict = {}


@st.composite
def configs(draw):
    """(TorusComm, algorithm): the grid matters to torus2d, the node layout (any ranks_per_node, so uneven
    nodes too, or the real ones) to hierarchical; 64-byte segments make every message many segments."""
    algorithm = draw(st.sampled_from(ALGORITHMS))
    kwargs = {}
    if algorithm == "torus2d":
        kwargs["dims"] = draw(st.sampled_from(GRIDS))
    elif algorithm == "hierarchical":
        kwargs["ranks_per_node"] = draw(st.integers(0, SIZE)) or None  # None: the real nodes
    kwargs["segment_bytes"] = draw(st.sampled_from([64, 1 << 20]))
    key = tuple(sorted(kwargs.items()))
    if key not in _comms:  # built once per configuration, collectively: every rank draws the same
        _comms[key] = torus.TorusComm(timeout=120, **kwargs)
    return _comms[key], algorithm


counts = st.one_of(st.integers(0, 2 * SIZE + 1), st.integers(0, 1500))
dtype_ops = st.sampled_from(DTYPES).flatmap(
    lambda dt: st.tuples(st.just(dt), st.sampled_from([o for o in OPS if not (o == "avg" and dt.kind == "i")])))
recvcounts = st.lists(st.integers(0, 40), min_size=SIZE, max_size=SIZE)


def rank_rng(seed: int):
    """Data for this example that differs between ranks (the example itself is the same on every rank)."""
    return np.random.default_rng([seed, WORLD.Get_rank()])


def on_every_rank(check) -> None:
    """Run ``check`` (which may call collectives) and fail on every rank if it failed on any."""
    try:
        check()
        error = None
    except Exception as exc:  # noqa: BLE001 - any failure is reported, with its type, on every rank
        error = f"{type(exc).__name__}: {exc}"
    failed = [f"rank {r}: {e}" for r, e in enumerate(WORLD.allgather(error)) if e]
    assert not failed, "; ".join(failed)


@settings(max_examples=25, **SETTINGS)
@given(config=configs(), count=counts, dtype_op=dtype_ops, exact=st.booleans(), in_place=st.booleans(),
       seed=st.integers(0, 2 ** 32 - 1))
def test_allreduce_property(config, count, dtype_op, exact, in_place, seed):
    (tc, algorithm), (dt, op) = config, dtype_op
    x = make(rank_rng(seed), dt, op, count, exact=exact or dt.kind == "i")

    def check():
        what = (f"allreduce({algorithm}, {op}, {dt}, count {count}, dims {tc.dims}, node size {tc.local_size}, "
                f"segment {tc.segment_bytes} B, in_place {in_place})")
        out = x.copy()
        out = tc.allreduce(MPI.IN_PLACE, out, op=op, algorithm=algorithm) if in_place else \
            tc.allreduce(x, op=op, algorithm=algorithm)
        ref, bound = expected(x, op, exact=exact or dt.kind == "i")
        assert_matches(out, ref, bound, what)
        assert_same_on_all_ranks(out, what)

    on_every_rank(check)


@settings(max_examples=15, **SETTINGS)
@given(config=configs(), blocks=recvcounts, dtype_op=dtype_ops, in_place=st.booleans(),
       seed=st.integers(0, 2 ** 32 - 1))
def test_reduce_scatter_property(config, blocks, dtype_op, in_place, seed):
    (tc, algorithm), (dt, op), rank = config, dtype_op, WORLD.Get_rank()
    x = make(rank_rng(seed), dt, op, sum(blocks))
    lo, hi = sum(blocks[:rank]), sum(blocks[:rank + 1])

    def check():
        what = f"reduce_scatter({algorithm}, {op}, {dt}, recvcounts {blocks}, in_place {in_place})"
        if in_place:
            full = x.copy()
            out = tc.reduce_scatter(MPI.IN_PLACE, full, recvcounts=blocks, op=op, algorithm=algorithm)
            outside = np.concatenate([full[:lo], full[hi:]])
            assert outside.tobytes() == np.concatenate([x[:lo], x[hi:]]).tobytes(), \
                f"{what} on rank {rank}: elements outside block {rank} changed"
        else:
            out = tc.reduce_scatter(x, recvcounts=blocks, op=op, algorithm=algorithm)
        ref, bound = expected(x, op)
        assert_matches(out, ref[lo:hi], bound if bound is None else bound[lo:hi], what)

    on_every_rank(check)


@settings(max_examples=15, **SETTINGS)
@given(config=configs(), blocks=recvcounts, dtype=st.sampled_from(DTYPES), in_place=st.booleans(),
       seed=st.integers(0, 2 ** 32 - 1))
def test_allgather_property(config, blocks, dtype, in_place, seed):
    (tc, algorithm), rank = config, WORLD.Get_rank()
    mine = make(rank_rng(seed), dtype, "max", blocks[rank], exact=False)  # "max": full range

    def check():
        what = f"allgather({algorithm}, {dtype}, recvcounts {blocks}, in_place {in_place})"
        if in_place:
            out = np.zeros(sum(blocks), dtype)
            out[sum(blocks[:rank]):sum(blocks[:rank + 1])] = mine
            tc.allgather(MPI.IN_PLACE, out, recvcounts=blocks, algorithm=algorithm)
        else:
            out = tc.allgather(mine, recvcounts=blocks, algorithm=algorithm)
        ref = np.concatenate(WORLD.allgather(mine))
        assert out.tobytes() == ref.tobytes(), f"{what} on rank {rank}: differs from MPI's allgather"

    on_every_rank(check)


def teardown_module():
    for tc in _comms.values():
        tc.Free()
    _comms.clear()
