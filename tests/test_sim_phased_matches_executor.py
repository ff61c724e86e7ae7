"""torus-sim replays phased calls as the executor runs them (torus/sim/phased.py against
torus/runtime/executor.py's ``phases`` and ``run_phases``): every rank's phases run by the real Executor, its
plans over the recording in-process transport of test_sim_replay_matches_executor and its node-level
shared-memory phases over an in-process transport with the contract of ``SharedMemory.run`` (threads of one
communicator meet at a barrier). Per rank the same messages in the same order (peer, bytes, tag) and the same
shared-memory calls (collective, sizes, blocks) at the same place between them as the simulator's stages;
its message statistics equal the log; every result against numpy. Also the phased prediction against its
closed form (shared-memory phases plus the ring between nodes), and round-robin layouts against brute force.
Single process, no MPI."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.test_sim_replay_matches_executor import _Recording, _sim_view, _Transport, run_ranks
from torus.partition import chunks, displacements
from torus.schedules import phases as phase_lists
from torus.schedules.build import effective
from torus.sim import phased, replay, shm
from torus.sim.model import Cost, Layout
from torus.sim.plans import ALGORITHMS, COLLECTIVES
from torus.sim.simulate import simulate

ITEMSIZE = 8
LAYOUTS = [Layout(2, 2, 2), Layout(3, 2, 3), Layout(2, 3, 2), Layout(4, 2, 4), Layout.round_robin(2, 2, 2),
           Layout.round_robin(2, 3, 2), Layout.round_robin(3, 2, 3), Layout.uneven(1, 5, (3, 2)),
           Layout.uneven(2, 3, (4, 2)), Layout.uneven(1, 4, (1, 3))]


class _Group:
    """One shared-memory communicator's meeting point: every member posts its input, all read them all."""

    def __init__(self, size: int):
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)


class _FakeShm:
    """``SharedMemory.run``'s contract on threads (runtime/shm.py): all-reduce, reduce-scatter of ``counts``
    blocks, all-gather of ``counts`` blocks, summed in the communicator's rank order."""

    def __init__(self, group: _Group, index: int, log: list):
        self.group, self.index, self.log = group, index, log

    def run(self, what, collective, src, out, counts, op, scale, check):
        assert op == "sum"
        self.log.append(("shm", collective, src.size, out.size, None if counts is None else tuple(counts)))
        g = self.group
        g.slots[self.index] = src.copy()
        g.barrier.wait()
        got = list(g.slots)
        g.barrier.wait()
        if collective == "allgather":
            out[:] = np.concatenate(got)
            return
        total = got[0].copy()
        for x in got[1:]:
            total += x
        if collective == "reduce_scatter":
            lo = displacements(counts)[self.index]
            total = total[lo:lo + counts[self.index]]
        out[:] = total * scale


def _execute(algorithm, collective, layout, counts, seg, data):
    """Every rank's phased call through the Executor; returns (per-rank log, buffers)."""
    t, N = _Transport(), layout.N
    groups: dict = {}
    runs, bufs = {}, {}
    for r in range(N):
        topo = layout.topology(r)
        shm_by_name = {}
        for name in ("local", "row", "col"):
            members = topo.members(name)
            group = groups.setdefault(members, _Group(len(members)))
            shm_by_name[name] = _FakeShm(group, members.index(r), t.log[r])
        ex = _Recording({n: t.comm(topo, n) for n in ("world", "row", "col", "local", "cross")}, r, seg, None,
                        shm_by_name)
        ex.c_loop, ex.log = False, []
        nbytes = (counts if isinstance(counts, int) else sum(counts)) * ITEMSIZE
        algo = effective(collective, algorithm, topo, nbytes)
        runs[r] = (ex, ex.phases(collective, algo, topo, counts, ITEMSIZE, True))
        bufs[r] = data[r].copy()
    run_ranks(N, lambda r: runs[r][0].run_phases(collective, runs[r][1], bufs[r], "sum", 1.0, None, False))
    return t.log, bufs


def _sim_log(per_rank, layout, cost):
    """Per rank, the simulator's stages as the log: each plan stage's messages (``_sim_view`` of the ranks
    in it), each shared-memory phase as the call it makes."""
    out: dict = {r: [] for r in per_rank}
    for stage in phased.stages(per_rank):
        plans = {r: ph.steps for r, ph in stage.items() if isinstance(ph, phase_lists.Plan) and ph.steps}
        if plans:
            log, _ = _sim_view(replay.compile_all(plans, cost, ITEMSIZE), layout)
            for r, events in log.items():
                out[r] += events
        for r, ph in stage.items():
            if isinstance(ph, phase_lists.Shm):
                out[r].append(("shm", ph.collective, ph.inp[1] - ph.inp[0], ph.out[1] - ph.out[0], ph.counts))
    return out


def _want(collective, data, N, count):
    if collective == "allgather":  # rank r's block of the output is its own
        blocks, displs = chunks(count, N)[0], displacements(chunks(count, N)[0])
        return np.concatenate([data[r][displs[r]:displs[r] + blocks[r]] for r in range(N)])
    return sum(data[r] for r in range(N))


def _name(lay: Layout) -> str:
    return f"{lay.X}x{lay.Y}/{lay.node_of or lay.node_sizes or lay.ranks_per_node}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=_name)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_phased_replay_matches_executor(layout, algorithm, collective):
    N = layout.N
    rng = np.random.default_rng(N * 7 + layout.nodes)
    for count in (0, 1, N + 1, 9 * N + 5):
        counts = count if collective == "allreduce" else tuple(chunks(count, N)[0])
        per_rank = phased.build(algorithm, collective, layout, counts, ITEMSIZE)
        if per_rank is None:  # no node-level phase: the plain replay of test_sim_replay_matches_executor
            assert algorithm in ("ring", "swing", "swing_latency") or not any(
                phase_lists.node_level(collective, effective(collective, algorithm, layout.topology(r), 0),
                                       layout.topology(r)) for r in range(N))
            return
        data = {r: rng.standard_normal(count) for r in range(N)}
        for seg in (None, 24):
            cost = Cost(segment_bytes=seg)
            log, bufs = _execute(algorithm, collective, layout, counts, seg or replay.UNSEGMENTED, data)
            sim = _sim_log(per_rank, layout, cost)
            _, st, mism = phased.replay_phases(per_rank, layout, cost, ITEMSIZE)
            assert mism == 0
            want = _want(collective, data, N, count)
            for r in range(N):
                what = f"{algorithm} {collective} {layout} count {count} segment {seg} rank {r}"
                assert log[r] == sim[r], what
                sent = [e for e in log[r] if e[0] == "send"]
                assert st["msgs"][r] == len(sent) and st["sent"][r] == sum(e[3] for e in sent), what
                if collective == "reduce_scatter":
                    lo, n = displacements(counts)[r], counts[r]
                    np.testing.assert_allclose(bufs[r][lo:lo + n], want[lo:lo + n], rtol=1e-12, atol=1e-12,
                                               err_msg=what)
                else:
                    np.testing.assert_allclose(bufs[r], want, rtol=1e-12, atol=1e-12, err_msg=what)
                if collective == "allreduce":  # every rank's result bitwise the same
                    np.testing.assert_array_equal(bufs[r], bufs[0], err_msg=what)


def test_phased_torus2d_allreduce_is_its_closed_form():
    """torus2d all-reduce on 2 nodes of 2 ranks (rows are nodes): a shared-memory reduce-scatter of ``M``
    bytes (shm.closed_form), the column ring all-reduce of ``M/2`` bytes between the nodes (2 steps of
    ``M/4``: ``2α + β·M/2 + γ·M/4``), a shared-memory all-gather of ``M``; the same whether nodes are blocks
    or dealt out round robin (the columns are then the nodes)."""
    M = 8 * (256 << 10)
    cost = Cost(alpha=2e-6, beta=1e-9, gamma=3e-10, inter_alpha=5e-5, inter_beta=8e-9, copy_beta=2e-10,
                flag_alpha=1e-6, call_alpha=4e-6)
    ring = 2 * cost.inter_alpha + cost.inter_beta * M / 2 + cost.gamma * M / 4
    want = shm.closed_form("reduce_scatter", M, 2, cost) + ring + shm.closed_form("allgather", M, 2, cost)
    for layout in (Layout(2, 2, 2), Layout.round_robin(2, 2, 2)):
        r = simulate("torus2d", "allreduce", layout, M // 4, "float32", cost)
        assert r.method == "phased" and r.tag_mismatches == 0
        assert r.time == pytest.approx(want, rel=1e-9)
        assert r.inter_node_max == pytest.approx(M / 2 * 2)  # each of the node's 2 ranks sends M/4 twice


def test_phased_off_replays_the_plain_plan():
    cost = Cost(alpha=2e-6, beta=1e-9, inter_alpha=5e-5, inter_beta=8e-9)
    layout = Layout(2, 2, 2)
    plain = simulate("torus2d", "allreduce", layout, 1 << 16, "float32", cost, shm_phases=False)
    assert plain.method == "full"
    one_per_node = simulate("torus2d", "allreduce", Layout(2, 2, 1), 1 << 16, "float32", cost)
    assert one_per_node.method == "full"  # nothing to share within a node


@pytest.mark.parametrize("X,Y,C", [(2, 3, 2), (3, 2, 3), (2, 4, 4), (4, 3, 2)])
def test_round_robin_layout_against_brute_force(X, Y, C):
    """Layout.round_robin: rank r on node r % C; "local" lists a node's ranks in rank order, "cross" the
    ranks of the same position on their node; block placement gives the block Layout back."""
    layout, N = Layout.round_robin(X, Y, C), X * Y
    assert list(layout.node(np.arange(N))) == [r % C for r in range(N)] and layout.nodes == C
    for r in range(N):
        local = [q for q in range(N) if q % C == r % C]
        cross = [q for q in range(N) if q // C == r // C]
        assert [layout.world(r, "local", p) for p in range(len(local))] == local
        assert [layout.world(r, "cross", p) for p in range(len(cross))] == cross
    assert Layout.placed(X, Y, [r // (N // C) for r in range(N)]) == Layout(X, Y, N // C)
    with pytest.raises(ValueError, match="does not cover"):
        Layout(X, Y, 1, None, (0,) * (N - 1) + (2,))
