"""torus-sim --fit/--validate building blocks under mpiexec: ping-pong pairs up, the reduce rate is measured,
and validate's predictions are the simulator's (the shm rows too, --alloc's included). No timing is asserted
(the machine is shared); about 1 s of work."""
import numpy as np
import pytest

from oracle import one_node
from torus import TorusComm
from torus.sim import fit
from torus.sim.model import Cost, Layout
from torus.sim.simulate import simulate


def test_pingpong_and_reduce_rate(world):
    if world.Get_size() < 2:
        pytest.skip("ping-pong needs two ranks")
    pts = fit.pingpong(world, sizes=(4, 4096), reps=3)
    if world.Get_rank() < 2:
        assert [n for n, _ in pts] == [4, 4096] and all(t > 0 for _, t in pts)
    else:
        assert pts == []
    gamma, rpts = fit.reduce_rate(sizes=(1 << 12, 1 << 16), reps=2)
    assert gamma >= 0 and len(rpts) == 2


def test_exchange_and_concurrent_reduce_rate_agree_across_ranks(world):
    pts = fit.exchange(world, sizes=(4, 4096), reps=3)
    assert [n for n, _ in pts] == [4, 4096] and all(t > 0 for _, t in pts)
    assert world.allgather(pts) == [pts] * world.Get_size()  # the slowest rank's time, on every rank
    gamma, rpts = fit.reduce_rate(sizes=(1 << 12, 1 << 16), reps=2, comm=world)
    assert gamma >= 0 and world.allgather(rpts) == [rpts] * world.Get_size()


def test_validate_predictions_are_the_simulators(world):
    tc = TorusComm(check=False)
    cost = Cost(2e-6, 1e-10, 3e-10, segment_bytes=tc.segment_bytes)
    rows = fit.validate(tc, {"a": cost}, sizes=(4096,), algorithms=("ring", "torus2d"), iters=2)
    X, Y = tc.dims
    for r in rows:
        assert r["measured"] > 0
        want = simulate(r["algorithm"], "allreduce", Layout(X, Y, tc.size), 1024, "float32", cost).time
        assert r["predicted_a"] == want
        # every rank reports the same slowest-rank time
        assert np.allclose(world.allgather(r["measured"]), r["measured"])
    if tc.size > 1:
        assert fit.executor_alpha(tc, iters=2) > 0
    tc.Free()


def test_shm_constants_and_validate_row(world):
    """On one node: copy_beta, flag_alpha and call_alpha come back non-negative and equal on every rank, and
    validate's shm row is the simulator's shm replay at the transport's own slot."""
    if world.Get_size() < 2 or not one_node():
        pytest.skip("shm needs two ranks on one node")
    copy_beta, cpts = fit.copy_rate(world, sizes=(1 << 12, 1 << 18), reps=2)
    flag, call, fpts = fit.shm_flags(world, copy_beta, 1e-10, steps=(1, 9), iters=3)
    assert min(copy_beta, flag, call) >= 0 and [k for k, _ in fpts] == [1, 9]
    assert world.allgather((copy_beta, flag, call)) == [(copy_beta, flag, call)] * world.Get_size()
    tc = TorusComm(check=False)
    cost = Cost(2e-6, 1e-10, 3e-10, segment_bytes=tc.segment_bytes, copy_beta=copy_beta, flag_alpha=flag,
                call_alpha=call)
    (row,) = fit.validate(tc, {"a": cost}, sizes=(1 << 16,), algorithms=("shm",), iters=2)
    slot = Cost(**{**cost.__dict__, "segment_bytes": tc._shm.slot_bytes})
    X, Y = tc.dims
    assert row["predicted_a"] == simulate("shm", "allreduce", Layout(X, Y, tc.size), 1 << 14, "float32", slot).time
    tc.Free()


def test_window_beta_and_validate_alloc_row(world):
    """On one node: window_beta comes back non-negative and equal on every rank; validate's alloc row is measured
    on TorusComm.alloc buffers (the TorusComm stays usable for further allocs after) and is the simulator's
    run_window replay, next to the ordinary shm row."""
    if world.Get_size() < 2 or not one_node():
        pytest.skip("shm needs two ranks on one node")
    window_beta, pts = fit.window_copy_rate(world, sizes=(1 << 12, 1 << 18), reps=2)
    assert window_beta >= 0 and [n for n, _ in pts] == [1 << 12, 1 << 18]
    assert world.allgather(window_beta) == [window_beta] * world.Get_size()
    tc = TorusComm(check=False)
    cost = Cost(2e-6, 1e-10, 3e-10, copy_beta=1e-10, flag_alpha=1e-6, call_alpha=1e-5, window_beta=window_beta)
    plain, alloc = fit.validate(tc, {"a": cost}, sizes=(1 << 16,), algorithms=("shm",), iters=2, alloc=True)
    assert (plain["alloc"], alloc["alloc"], alloc["algorithm"]) == (False, True, "shm") and alloc["measured"] > 0
    X, Y = tc.dims
    want = simulate("shm", "allreduce", Layout(X, Y, tc.size), 1 << 14, "float32", cost, alloc=True).time
    assert alloc["predicted_a"] == want != plain["predicted_a"]
    assert np.allclose(world.allgather(alloc["measured"]), alloc["measured"])
    tc.free_alloc(tc.alloc(1 << 14, np.float32))
    tc.Free()
