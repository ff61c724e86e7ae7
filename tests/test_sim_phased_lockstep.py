"""The phased replay's fast path (sim/phased.py): a plan stage of many ranks as one numpy pass per step, with
deadlines worked out without compiling, prices every call as the per-rank replay does."""
from __future__ import annotations

import pytest

from torus.sim import phased
from torus.sim import plans as P
from torus.sim.model import Cost, Layout
from torus.sim.simulate import simulate

LAYOUTS = [Layout(4, 3, 2), Layout(4, 4, 4), Layout(6, 4, 2), Layout.round_robin(4, 4, 4),
           Layout.round_robin(6, 2, 3), Layout.uneven(2, 5, (3, 4, 3))]
COSTS = [Cost(alpha=2e-6, beta=1e-10, gamma=3e-11, inter_alpha=5e-6, inter_beta=1e-9, shared_links=True,
              segment_bytes=1 << 12, copy_beta=5e-11, flag_alpha=1e-6, call_alpha=2e-6),
         Cost(alpha=1e-6, beta=2e-10, gamma=0.0, inter_alpha=1e-5, inter_beta=4e-9, shared_links=False)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.X}x{lay.Y}/{lay.nodes}")
@pytest.mark.parametrize("algorithm", ["hierarchical", "torus2d"])
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
@pytest.mark.parametrize("count", [5, 1000, 20_011])
@pytest.mark.parametrize("cost", COSTS, ids=["segmented", "whole"])
def test_lockstep_stages_price_as_the_per_rank_replay(monkeypatch, layout, algorithm, collective, count, cost):
    monkeypatch.setattr(phased, "LOCKSTEP_MIN_RANKS", 1 << 30)
    full = simulate(algorithm, collective, layout, count, "float32", cost)
    monkeypatch.setattr(phased, "LOCKSTEP_MIN_RANKS", 1)
    used = []
    lockstep = phased._lockstep
    monkeypatch.setattr(phased, "_lockstep", lambda *a: used.append(lockstep(*a)) or used[-1])
    fast = simulate(algorithm, collective, layout, count, "float32", cost)
    assert fast.method == full.method
    if fast.method == "phased":  # every plan stage here is rings: none falls back to the per-rank replay
        assert used and all(u is not None for u in used)
    assert fast.time == pytest.approx(full.time, rel=1e-12, abs=1e-15)
    assert (fast.steps, fast.msgs_max, fast.sent_max, fast.reduced_max, fast.inter_node_max) == \
        (full.steps, full.msgs_max, full.sent_max, full.reduced_max, full.inter_node_max)


@pytest.mark.parametrize("algorithm", P.ALGORITHMS)
@pytest.mark.parametrize("collective", P.COLLECTIVES)
@pytest.mark.parametrize("count", [0, 7, 1000, 4099])
def test_deadlines_without_compiling_equal_compile_plans(algorithm, collective, count):
    layout = Layout(4, 3, 2)
    checked = 0
    for rank in range(layout.N):
        steps = P.plan(algorithm, collective, rank, layout, count, 4)
        got = phased._deadlines(steps)
        if got is None:  # regions that overlap in part: compiled instead
            continue
        for segment_bytes in (16, 1 << 62):
            want = P.deadlines(steps, 4, segment_bytes)
            assert [g if w is not None else None for g, w in zip(got, want)] == want, (rank, segment_bytes)
        checked += 1
    if algorithm == "ring" and count >= 1000:  # a ring of whole chunks: never compiled
        assert checked == layout.N


@pytest.mark.parametrize("algorithm", ["torus2d", "hierarchical"])
@pytest.mark.parametrize("collective", P.COLLECTIVES)
@pytest.mark.parametrize("count", [12, 1000, 4099])
def test_deadlines_of_every_ring_phase_need_no_compiling(algorithm, collective, count):
    """The phased calls' plan stages are single ring phases (torus2d.Phase), whose chunks never overlap in
    part: the fast path always applies to them."""
    from torus.partition import chunks
    from torus.schedules.build import grid_phases
    if algorithm == "hierarchical" and collective == "allreduce":
        pytest.skip("the leader form's cross ring is ring.allreduce, covered by the ring plans")
    layout = Layout(4, 3, 2)
    counts = count if collective == "allreduce" else tuple(chunks(count, layout.N)[0])
    for rank in range(layout.N):
        for phase in grid_phases(collective, algorithm, layout.topology(rank), counts):
            steps = phase.steps()
            got = phased._deadlines(steps)
            assert got is not None
            for segment_bytes in (16, 1 << 62):
                want = P.deadlines(steps, 4, segment_bytes)
                assert [g if w is not None else None for g, w in zip(got, want)] == want, (rank, phase)
