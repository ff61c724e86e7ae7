"""swing.py's plans against the paper's definitions (De Sensi et al., NSDI'24, arXiv:2401.09356): the peer distances
``rho``, the peers, ``2 log2 p`` steps of halving data with one message each (all-reduce), the axes in turn on a
grid, and the folds' step counts. That every element ends reduced exactly once is test_partition.py's replay;
that the executor runs them, the MPI suites (oracle cases swing*); the simulator, test_sim*.py."""
from __future__ import annotations

import numpy as np
import pytest

from torus.schedules import swing
from torus.schedules.build import build
from torus.topology import Topology


def test_rho_is_the_alternating_sum():
    assert [swing.rho(s) for s in range(8)] == [sum((-2) ** i for i in range(s + 1)) for s in range(8)]
    assert [swing.rho(s) for s in range(5)] == [1, -1, 3, -5, 11]


def _sends(plan):
    return [(m.comm, m.peer, m.offset, m.count) for st in plan for m in st.sends]


@pytest.mark.parametrize("p", [2, 4, 8, 16, 64, 256])
def test_power_of_two_line_peers_and_halving(p):
    """Rank r's peer at step s is r + rho(s) (even r) or r - rho(s) (odd), mod p; the reduce-scatter half
    sends p/2, p/4, ... chunks, the all-gather the same in reverse; one message per step."""
    L = p.bit_length() - 1
    count = 3 * p
    for r in range(p):
        plan = swing.allreduce(r, 0, p, 1, count)
        assert len(plan) == 2 * L
        assert all(len(st.sends) == 1 and len(st.recvs) == 1 for st in plan)
        peers = [st.sends[0].peer for st in plan]
        want = [(r + swing.rho(s)) % p if r % 2 == 0 else (r - swing.rho(s)) % p for s in range(L)]
        assert peers == want + want[::-1]
        assert [st.recvs[0].peer for st in plan] == peers
        sizes = [st.sends[0].count for st in plan]
        assert sizes == [count >> (s + 1) for s in range(L)] + [count >> (s + 1) for s in range(L)][::-1]
        assert [st.recvs[0].final for st in plan] == [False] * (L - 1) + [True] + [False] * L


@pytest.mark.parametrize("cx,cy", [(1, 1024), (32, 32), (4, 64), (2, 2)])
def test_groups_are_contiguous_in_the_chunk_order(cx, cy):
    """The groups of every step partition the core and each is one run of positions: what lets the
    all-reduce send one message per step."""
    pos, lo, by_pos = swing._order(cx, cy)
    n = cx * cy
    assert sorted(pos.tolist()) == list(range(n)) and (pos[by_pos] == np.arange(n)).all()
    L = len(swing._steps(cx, cy))
    for s in range(L + 1):
        size = 1 << (L - s)
        assert (lo[s] % size == 0).all()
        assert ((pos >= lo[s]) & (pos < lo[s] + size)).all()


def test_grid_visits_the_axes_in_turn():
    """4 x 16: row, column, row, column, then the column's two remaining steps; the all-gather reverses."""
    plan = swing.allreduce(1, 2, 4, 16, 4 * 16 * 5)
    comms = [st.sends[0].comm for st in plan]
    half = ["row", "col", "row", "col", "col", "col"]
    assert comms == half + half[::-1]
    assert plan[0].sends[0].peer == 0 and plan[1].sends[0].peer == 3  # x=1 odd: x - 1; y=2 even: y + 1


@pytest.mark.parametrize("X,Y,folds", [(3, 1, 1), (6, 1, 1), (7, 1, 1), (3, 2, 1), (2, 3, 1), (3, 5, 2),
                                       (12, 1, 1), (4, 6, 1), (6, 4, 1)])
def test_folded_step_counts(X, Y, folds):
    """A folded axis adds a step in the reduce-scatter and one in the all-gather."""
    L = len(swing._grid(0, 0, X, Y, "row", "col").steps)
    for r in range(X * Y):
        x, y = r % X, r // X
        assert len(swing.allreduce(x, y, X, Y, 40)) == 2 * L + 2 * folds
        blocks = swing.reduce_scatter(x, y, X, Y, [3] * X * Y, list(range(0, 3 * X * Y, 3)))
        assert len(blocks) == L + 2 * folds


@pytest.mark.parametrize("X,Y,moved", [(6, 1, 1.0), (5, 1, 1.0), (4, 6, 0.5), (6, 4, 0.5), (2, 3, 0.5),
                                       (3, 2, 0.5)])
def test_one_folded_axis_folds_after_the_other_axis_first_step(X, Y, moved):
    """On a line the folded ranks hand in the whole buffer; on a grid with one folded axis the axes run
    from the other one, so the fold comes after one halving; the folded ranks take their shadow's steps
    before the fold (the same communicator, peer index and regions) and idle until they unfold."""
    count = 8 * X * Y
    for r in swing.folded(X, Y):
        g = swing._grid(r % X, r // X, X, Y, "row", "col")
        plan = swing.allreduce(r % X, r // X, X, Y, count)
        shadow_rank = next(w for w in range(X * Y) if w not in swing.folded(X, Y)
                           and swing._grid(w % X, w // X, X, Y, "row", "col").me == g.me)
        shadow = swing.allreduce(shadow_rank % X, shadow_rank // X, X, Y, count)
        fold = plan[g.until]
        assert not fold.recvs and sum(m.count for m in fold.sends) == moved * count
        assert plan[:g.until] == shadow[:g.until]
        busy = [i for i, st in enumerate(plan) if st.sends or st.recvs]
        assert len(busy) == 2 * g.until + 2
        assert plan[len(plan) - g.until:] == shadow[len(plan) - g.until:]


@pytest.mark.parametrize("local,first", [(0, "row"), (1, "col")])
def test_the_axis_inside_the_nodes_runs_first(local, first):
    """4 x 16 with ``local``: every step of that axis, then the other's; the all-gather reverses."""
    plan = swing.allreduce(1, 2, 4, 16, 4 * 16 * 5, local=local)
    comms = [st.sends[0].comm for st in plan]
    half = ["row"] * 2 + ["col"] * 4 if first == "row" else ["col"] * 4 + ["row"] * 2
    assert comms == half + half[::-1]


@pytest.mark.parametrize("nodes,L,round_robin", [(4, 4, True), (4, 4, False), (8, 2, True), (2, 8, False),
                                                 (16, 4, True)])
def test_swing_across_nodes_sends_what_the_2d_torus_sends_through_a_node_link(nodes, L, round_robin):
    """Built on a Topology of ``nodes`` nodes of ``L`` ranks (blocks or round robin: TorusComm's grid, one
    axis inside the nodes), a rank's Swing all-reduce sends ``2 (C-1)/C * M/L`` across the nodes (M: the
    buffer, C: the nodes; the halvings inside the node come first), as the 2D torus' column phase does;
    with the axes in turn it sends more as soon as the node holds more than 2 ranks."""
    size, count = nodes * L, nodes * L * 64
    node_of = tuple(r % nodes if round_robin else r // L for r in range(size))
    dims = (nodes, L) if round_robin else (L, nodes)
    cross = {"row", "col"} - {Topology(0, size, dims, node_of).node_axis}
    for r in range(size):
        t = Topology(r, size, dims, node_of)
        sent = {a: sum(m.count for st in build("allreduce", a, t, count) for m in st.sends if m.comm in cross)
                for a in ("swing", "torus2d")}
        assert sent["swing"] == sent["torus2d"] == 2 * (nodes - 1) * count // (nodes * L), r
        x, y = t.coords
        in_turn = sum(m.count for st in swing.allreduce(x, y, *dims, count) for m in st.sends if m.comm in cross)
        assert in_turn > sent["swing"] if L > 2 and nodes > 1 else in_turn >= sent["swing"]


def test_build_runs_swing_on_the_topologys_grid():
    t = Topology(5, 8, (2, 4), tuple(range(8)))
    assert build("allreduce", "swing", t, 100) == swing.allreduce(1, 2, 2, 4, 100)
    line = Topology(5, 8, (1, 8), tuple(range(8)))
    assert build("allreduce", "swing", line, 100) == swing.allreduce(5, 0, 8, 1, 100)
    assert {m.comm for st in build("reduce_scatter", "swing", line, [2] * 8) for m in st.sends} == {"world"}


def test_swing_takes_its_latency_form_up_to_the_limit(monkeypatch):
    """``effective``: a swing all-reduce of at most ``latency_bytes`` runs swing_latency (its plan is
    allreduce_latency's), larger ones and every reduce-scatter / all-gather the bandwidth-optimal form; the
    limit is 96 us on the link (12,000 B at 1 Gbit/s, 48,000 at 4), 8 KiB without a link, the knob when set."""
    from torus.schedules.build import effective, swing_latency_bytes
    monkeypatch.delenv("TORUS_SWING_LATENCY_BYTES", raising=False)
    assert (swing_latency_bytes(), swing_latency_bytes(1.0), swing_latency_bytes(4.0)) == (8192, 12000, 48000)
    t = Topology(0, 6, (2, 3), tuple(range(6)))
    for limit in (8192, 48000):
        assert effective("allreduce", "swing", t, limit, limit) == "swing_latency"
        assert effective("allreduce", "swing", t, limit + 1, limit) == "swing"
    assert effective("allreduce", "swing", t, 8192) == "swing_latency"
    assert effective("allreduce", "swing", t, 8193) == "swing"
    assert effective("reduce_scatter", "swing", t, 4, 1 << 20) == "swing"
    assert effective("allgather", "swing_latency", t, 4) == "swing"
    assert build("allreduce", "swing_latency", t, 10) == swing.allreduce_latency(0, 0, 2, 3, 10)
    monkeypatch.setenv("TORUS_SWING_LATENCY_BYTES", "100")
    assert (swing_latency_bytes(), swing_latency_bytes(4.0)) == (100, 100)
    monkeypatch.setenv("TORUS_SWING_LATENCY_BYTES", "-1")
    assert effective("allreduce", "swing", t, 0, swing_latency_bytes(1.0)) == "swing"


def test_simulator_takes_the_latency_form_by_its_link(monkeypatch):
    """torus-sim decides as TorusComm does from the link between nodes (1 / inter_beta): at 1 Gbit/s a swing
    all-reduce of 12,000 B is priced as swing_latency, one of 12,004 B as the bandwidth form."""
    from torus.sim.model import Cost, Layout
    from torus.sim.simulate import simulate
    monkeypatch.delenv("TORUS_SWING_LATENCY_BYTES", raising=False)
    cost = Cost(alpha=1e-6, beta=1e-10, inter_alpha=20e-6, inter_beta=8e-9)  # 1 Gbit/s between nodes
    layout = Layout(2, 2, 1)
    for count, form in ((3000, "swing_latency"), (3001, "swing")):
        got = simulate("swing", "allreduce", layout, count, cost=cost).time
        monkeypatch.setenv("TORUS_SWING_LATENCY_BYTES", "-1")
        want = simulate(form, "allreduce", layout, count, cost=cost).time
        other = simulate({"swing": "swing_latency", "swing_latency": "swing"}[form], "allreduce", layout, count,
                         cost=cost).time
        monkeypatch.delenv("TORUS_SWING_LATENCY_BYTES")
        assert got == want != other


@pytest.mark.parametrize("X,Y", [(8, 1), (1, 6), (4, 4), (2, 3), (3, 5)])
def test_latency_form_steps_and_messages(X, Y):
    """One message each way of the whole buffer per core step (log2 P of them, the axes in the all-gather's
    order), the last reduce final; folded ranks: a step in and one out per folded axis."""
    count = 11
    g = swing._grid(0, 0, X, Y, "row", "col")
    L, folds = len(g.steps), (g.ex > 0) + (g.ey > 0)
    for r in range(X * Y):
        plan = swing.allreduce_latency(r % X, r // X, X, Y, count)
        assert len(plan) == L + 2 * folds
        core = plan[folds:folds + L]
        mine = swing._grid(r % X, r // X, X, Y, "row", "col")
        if mine.extra_on:
            assert all(not st.sends and not st.recvs for st in core)
            continue
        for st in core:
            assert [(m.offset, m.count) for m in st.sends] == [(0, count)] == [(m.offset, m.count) for m in st.recvs]
            assert st.sends[0].peer == st.recvs[0].peer and st.recvs[0].reduce
        assert [st.recvs[0].final for st in core] == [False] * (L - 1) + [True]
        assert [st.sends[0].comm for st in core] == [("world", "row", "col")[0 if X == 1 or Y == 1 else 1 + a]
                                                     for a, _ in mine.steps[::-1]]


def test_torus_comm_takes_the_latency_form_by_its_link():
    """TorusComm's call shapes (torus/shapes.py) put the limit at 96 us on the link they are given (told or
    measured across nodes), 8 KiB without one."""
    from types import SimpleNamespace

    import numpy as np

    from torus.shapes import Shapes
    t = Topology(0, 4, (2, 2), (0, 1, 2, 3))  # four nodes of one rank

    def call(count):
        return SimpleNamespace(dtype=np.dtype(np.float32), count=count, counts=None, in_place=False)

    for gbits, limit in ((None, 8192), (1.0, 12000), (4.0, 48000)):
        shapes = Shapes(t, 0, lambda *a: "ring", False, gbits)
        assert shapes.get("allreduce", "swing", "sum", call(limit // 4))[0] == "swing_latency"
        assert shapes.get("allreduce", "swing", "sum", call(limit // 4 + 1))[0] == "swing"
