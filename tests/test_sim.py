"""torus-sim against closed forms (steps, bytes, time), the orbit fast path against the full replay, and the
replay's own checks (unmatched messages, deadlock). Single process; about 15 s on an idle 2-core machine."""
from __future__ import annotations

import json

import numpy as np
import pytest

from torus.partition import chunks
from torus.schedules import swing
from torus.schedules.plan import Recv, Send, Step
from torus.sim import closed_form, replay
from torus.sim.cli import main
from torus.sim.model import ITEMSIZE, Cost, Layout, SimulationError
from torus.sim.plans import ALGORITHMS, COLLECTIVES, DEFAULT, NO_ORBIT, plan
from torus.sim.simulate import simulate

GRIDS = [(1, 5), (5, 1), (2, 2), (2, 3), (3, 2), (4, 6)]
COST1 = Cost(alpha=2e-6, beta=3e-10, gamma=7e-11)
COST2 = Cost(alpha=1e-6, beta=1e-10, gamma=5e-11, inter_alpha=7e-6, inter_beta=9e-10)


def _counts(N: int):
    """Edge counts: 0, 1, below N, not divisible by N, divisible."""
    return [0, 1, N - 1 if N > 1 else 2, 7 * N + 3, 12 * N]


@pytest.mark.parametrize("X,Y", GRIDS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_counts_match_closed_form(X, Y, algorithm, collective, monkeypatch):
    """Steps and mean bytes sent/reduced per rank equal the closed forms for every count; steps only once
    every chunk is non-empty (an empty chunk is no message). ``swing`` in its bandwidth-optimal form here."""
    monkeypatch.setenv("TORUS_SWING_LATENCY_BYTES", "-1")
    L = X if algorithm == "hierarchical" else 1  # hierarchical: the rows are the nodes
    layout = Layout(X, Y, L)
    N = layout.N
    for count in _counts(N):
        r = simulate(algorithm, collective, layout, count, "float64", COST1, "full", shm_phases=False)
        M = count * 8
        back = sum(chunks(count, N)[0][w] * 8 for w in swing.folded(X, Y)) if "swing" in algorithm else 0
        sent, reduced = closed_form.sent_per_rank(collective, N, M, back), (N - 1) / N * M
        if algorithm == "swing_latency" and collective == "allreduce":
            sent, reduced = closed_form.swing_latency_bytes(N, X, Y, M)
        if algorithm == "hierarchical" and collective == "allreduce":
            c0 = chunks(count, L)[0][0] * 8
            C = N // L
            sent = (C * (2 * (L - 1) * M + 2 * (M - c0 if L > 1 else 0)) + 2 * (C - 1) * M) / N
            reduced = (C * (L - 1) * M + (C - 1) * M) / N
        assert r.sent_mean == pytest.approx(sent, abs=1e-9)
        assert r.reduced_mean == pytest.approx(0.0 if collective == "allgather" else reduced, abs=1e-9)
        assert r.tag_mismatches == 0
        if count >= N:
            assert r.steps == closed_form.steps(algorithm, collective, N, X, Y, L)
        if count == 0:
            assert (r.steps, r.msgs_max, r.time) == (0, 0, 0.0)


@pytest.mark.parametrize("X,Y", GRIDS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("cost", [COST1, COST2], ids=["one-level", "two-level"])
def test_time_matches_closed_form(X, Y, algorithm, collective, cost, monkeypatch):
    """Divisible counts: the predicted time is the closed-form α-β-γ formula (two levels: rows are nodes; a
    ring that leaves the node anywhere runs at its slowest link, since every step waits for it). ``swing``
    in its bandwidth-optimal form here."""
    monkeypatch.setenv("TORUS_SWING_LATENCY_BYTES", "-1")
    layout = Layout(X, Y, X)
    N = layout.N
    count = 12 * N * N
    if "swing" in algorithm and collective != "allreduce":
        pytest.skip("swing: a closed form for the all-reduce only (closed_form.time)")
    r = simulate(algorithm, collective, layout, count, "float32", cost, "full", shm_phases=False)
    if algorithm == "ring" and cost.inter_alpha is not None and layout.nodes > 1:
        expect = closed_form.time(algorithm, collective, count * 4, cost.inter_alpha, cost.inter_beta,
                                  cost.gamma, N)
    else:
        expect = closed_form.time(algorithm, collective, count * 4, cost.alpha, cost.beta, cost.gamma, N, X, Y,
                                  X, cost.inter_alpha, cost.inter_beta)
    assert r.time == pytest.approx(expect, rel=1e-12)
    symmetric = "swing" not in algorithm or not swing.folded(X, Y)  # the folds' partners send more
    if symmetric and (algorithm != "hierarchical" or collective != "allreduce"):  # every rank sends alike
        assert r.sent_max == pytest.approx(r.sent_mean, rel=1e-12)


def test_inter_node_bytes_paper_forms():
    """Mikami et al. sec. 3.2: the leaders move the whole M between nodes, the 2D-torus columns M/X."""
    layout = Layout(4, 6, 4)
    count = 4 * 6 * 100
    M = count * 4
    h = simulate("hierarchical", "allreduce", layout, count, "float32", COST2, "full", shm_phases=False)
    t = simulate("torus2d", "allreduce", layout, count, "float32", COST2, "full", shm_phases=False)
    assert h.inter_rank_max == pytest.approx(closed_form.inter_node_per_rank("hierarchical", 24, 4, 4, M))
    assert t.inter_rank_max == pytest.approx(closed_form.inter_node_per_rank("torus2d", 24, 4, 4, M))
    assert t.inter_rank_max == pytest.approx(h.inter_rank_max / 4)


def test_symmetric_ranks_finish_together():
    """Ring and 2D-torus plans are rotation-symmetric: with a divisible count every rank ends at the same
    time and depth (the premise of the orbit fast path)."""
    layout = Layout(4, 6)
    for algorithm in ("ring", "torus2d"):
        plans = {r: plan(algorithm, "allreduce", r, layout, 24 * 5, 4) for r in range(24)}
        end, _, _ = replay.full(plans, layout, COST1, 4)
        assert len(set(end.values())) == 1


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("X,Y,L", [(4, 6, 2), (8, 8, 4), (1, 24, 4), (24, 1, 3)])
@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a not in NO_ORBIT])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_orbit_equals_full_replay(X, Y, L, algorithm, collective, shared):
    """The fast path (representatives + rotation, vectorized clocks) gives exactly the full replay's
    numbers, with uneven chunks, two levels and segmentation, with and without shared node links."""
    layout = Layout(X, Y, L)
    cost = Cost(1e-6, 1e-10, 3e-10, 5e-6, 4e-10, segment_bytes=256, shared_links=shared)
    for count in (layout.N - 1, 37 * layout.N + 5):
        full = simulate(algorithm, collective, layout, count, "float32", cost, "full", shm_phases=False).as_dict()
        fast = simulate(algorithm, collective, layout, count, "float32", cost, "orbit", shm_phases=False).as_dict()
        assert fast.pop("method") == "orbit" and full.pop("method") == "full"
        for k, v in full.items():
            assert fast[k] == (pytest.approx(v, rel=1e-12) if isinstance(v, float) else v), k


def test_paper_scale_2176():
    """2,176 ranks as 32x68 (Mikami et al.): steps 2(X-1)+2(Y-1) = 196 against the ring's 2(N-1) = 4350, and
    the symmetric time formula, through the orbit path."""
    layout = Layout(32, 68, 4)
    count = 2176 * 64
    for algorithm in ("torus2d", "ring"):
        r = simulate(algorithm, "allreduce", layout, count, "float32", COST1)
        assert r.method == "orbit"
        assert r.steps == closed_form.steps(algorithm, "allreduce", 2176, 32, 68)
        assert r.time == pytest.approx(closed_form.time(algorithm, "allreduce", count * 4, COST1.alpha,
                                                        COST1.beta, COST1.gamma, 2176, 32, 68), rel=1e-9)


def test_swing_at_1088_ranks_matches_its_closed_form(monkeypatch):
    """1,088 ranks as 16x68: Swing replayed in full (no orbit), 2 log2(16*64) + 2 steps (the 68 columns fold onto
    64) and the closed-form time with the fold at the second step (the unfolded row axis first). The bandwidth
    form: COST1's fast link would give this size the latency-optimal one."""
    monkeypatch.setenv("TORUS_SWING_LATENCY_BYTES", "-1")
    layout = Layout(16, 68, 4)
    count = 1088 * 64
    r = simulate("swing", "allreduce", layout, count, "float32", COST1)
    assert r.method == "full" and r.tag_mismatches == 0
    assert r.steps == closed_form.steps("swing", "allreduce", 1088, 16, 68) == 2 * 10 + 2
    assert r.time == pytest.approx(closed_form.time("swing", "allreduce", count * 4, COST1.alpha, COST1.beta,
                                                    COST1.gamma, 1088, 16, 68), rel=1e-9)
    with pytest.raises(SimulationError, match="no orbit"):
        simulate("swing", "allreduce", layout, count, "float32", COST1, "orbit")


def test_unmatched_and_deadlock_raise():
    layout = Layout(2, 1)
    short = {0: [Step(sends=(Send("world", 1, 0, 4),))], 1: [Step(recvs=(Recv("world", 0, 0, 3, True),))]}
    with pytest.raises(SimulationError, match="do not match"):
        replay.full(short, layout, COST1, 4)
    # each rank waits for the other's message of step 0, which is only sent in step 1
    cycle = {r: [Step(recvs=(Recv("world", 1 - r, 0, 4, True),)), Step(sends=(Send("world", 1 - r, 0, 4),))]
             for r in (0, 1)}
    with pytest.raises(SimulationError, match="deadlock"):
        replay.full(cycle, layout, COST1, 4)


def test_cli_sweep_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    assert main(["--sweep", "-b", "1K", "-e", "16K", "-f", "4", "--ranks", "6,8", "--ranks-per-node", "2",
                 "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert len(data["results"]) == 2 * len(DEFAULT) * 3  # rank counts x the default schedules x sizes
    assert {r["nbytes"] for r in data["results"]} == {1024, 4096, 16384}
    assert png.stat().st_size > 1000
    assert "torus2d" in capsys.readouterr().out
    assert main(["--ranks", "6", "--dims", "4x2"]) == 2


def test_params_file_and_flags(tmp_path):
    from torus.sim.cli import cost_from, parser
    p = tmp_path / "fit.json"
    p.write_text(json.dumps({"alpha": 3e-6, "beta": 2e-10, "gamma": 1e-10, "measured": []}))
    argv = ["--params", str(p), "--gamma", "5e-11"]
    cost = cost_from(parser().parse_args(argv), argv)
    assert (cost.alpha, cost.beta, cost.gamma) == (3e-6, 2e-10, 5e-11)


def test_the_cli_shares_a_nodes_link_unless_told_not_to(tmp_path):
    """torus-sim prices what a network does by default (a node's link shared by the flows crossing it); the
    closed forms' whole-link model is ``--no-shared-links``, also over a --params file that says otherwise."""
    from torus.sim.cli import cost_from, parser
    assert cost_from(parser().parse_args([]), []).shared_links is True
    argv = ["--no-shared-links"]
    assert cost_from(parser().parse_args(argv), argv).shared_links is False
    p = tmp_path / "fit.json"
    p.write_text(json.dumps({"alpha": 3e-6, "shared_links": True}))
    argv = ["--params", str(p), "--no-shared-links"]
    assert cost_from(parser().parse_args(argv), argv).shared_links is False


def test_itemsizes_match_numpy():
    from torus.ops import DTYPES
    assert {str(d): d.itemsize for d in DTYPES} == ITEMSIZE
    assert np.dtype("float32").itemsize == ITEMSIZE["float32"]


def test_fit_link_ignores_a_burst_below_the_rate():
    from torus.sim.fit import fit_alpha_beta, fit_link
    # a shaped link: messages up to a 1 MiB bucket pass at 10x the rate, larger ones at the rate past it
    alpha, beta, bucket = 30e-6, 4e-9, 1 << 20
    sizes = [4 ** k for k in range(1, 13)]
    points = [(b, alpha + (b * beta / 10 if b <= bucket else bucket * beta / 10 + (b - bucket) * beta))
              for b in sizes]
    a, b = fit_link(points)
    assert a == points[0][1]
    assert b == pytest.approx((points[-1][1] - points[0][1]) / (sizes[-1] - sizes[0]), rel=1e-12)
    assert b == pytest.approx(beta, rel=0.1)  # within the bucket's share of the largest message
    assert fit_alpha_beta(points)[1] < 0.8 * beta  # what a least-squares fit across sizes made of it


def test_fit_alpha_beta_recovers_line():
    from torus.sim.fit import fit_alpha_beta
    sizes = [4 ** k for k in range(1, 12)]
    assert fit_alpha_beta([(b, 3e-6 + 2e-10 * b) for b in sizes]) == pytest.approx((3e-6, 2e-10), rel=1e-9)


@pytest.mark.parametrize("method", ["full", "orbit"])
@pytest.mark.parametrize("X,Y", [(2, 2), (3, 2), (4, 3)])
def test_shared_links_divide_the_link_among_a_nodes_crossing_ranks(X, Y, method):
    """Rows inside nodes (``ranks_per_node = X``): in the 2D torus every rank of a node crosses at the same
    steps (the column phase), so with shared links each message moves at 1/X of the link: the same time as
    unshared links X times slower. The hierarchical schedule crosses from the leaders only: no change."""
    layout = Layout(X, Y, X)
    count = 101 * layout.N + 7
    cost = Cost(1e-6, 1e-10, 3e-10, 5e-6, 4e-10)

    def time(algorithm, **kw):
        c = Cost(**{**cost.__dict__, **kw})
        return simulate(algorithm, "allreduce", layout, count, "float32", c, method).time

    assert time("torus2d", shared_links=True) == pytest.approx(time("torus2d", inter_beta=X * 4e-10), rel=1e-12)
    assert time("torus2d", shared_links=True) > time("torus2d")
    assert time("hierarchical", shared_links=True) == pytest.approx(time("hierarchical"), rel=1e-12)
