"""torus-sim replays what the executor does: every rank's plan run by the real Executor and step interpreter
(torus.runtime.interpreter) over a recording in-process transport (one thread per rank, messages matched by
communicator, source and tag as MPI matches them), against ``torus.sim.replay``'s view of the same plans
(``match``, ``full``): per rank the same segments sent in the same order (peer, bytes, tag), the same
receives completed in the same order, the same sends waited for at the same points (the deadlines), the same
message counts and bytes; the all-reduce's result is also checked against numpy. Single process, no MPI.

Also: compile._deadlines against its definition, by brute force on the same plans."""
from __future__ import annotations

import threading
from collections import Counter, defaultdict

import numpy as np
import pytest

from torus.runtime.compile import compile_plan
from torus.runtime.executor import Executor
from torus.schedules.plan import Recv, Send, Step
from torus.sim import replay
from torus.sim.model import Cost, Layout
from torus.sim.plans import ALGORITHMS, COLLECTIVES, plan

LAYOUTS = [Layout(1, 5, 1), Layout(5, 1, 5), Layout(2, 3, 2), Layout(3, 2, 3), Layout(2, 2, 1), Layout(3, 4, 2),
           Layout.uneven(2, 3, (4, 2)), Layout.uneven(1, 5, (2, 3)), Layout.uneven(3, 2, (1, 2, 3))]
SEGMENTS = [None, 8, 24]  # bytes: unsegmented, one float64 per segment, three
ITEMSIZE = 8


class _Request:
    def __init__(self, done=None):
        self.done = done  # None: complete already (an eager send)

    def Test(self):
        return self.done is None or self.done()

    def Wait(self):
        if not self.Test():
            self.done(block=True)


class _Transport:
    """Mailboxes per (communicator name, sender world rank, receiver world rank, tag), FIFO as in MPI."""

    def __init__(self):
        self.boxes: defaultdict = defaultdict(list)
        self.cv = threading.Condition()
        self.log: defaultdict = defaultdict(list)  # world rank -> [event]

    def comm(self, topology, name: str):
        return _Comm(self, topology, name)


class _Comm:
    def __init__(self, transport, topology, name):
        self.t, self.topo, self.name = transport, topology, name

    def _world(self, peer):
        return self.topo.world_rank(self.name, peer)

    def Isend(self, spec, peer, tag):
        data, me, dst = bytes(spec[0]), self.topo.rank, self._world(peer)
        with self.t.cv:
            self.t.boxes[(self.name, me, dst, tag)].append(data)
            self.t.log[me].append(("send", self.name, dst, len(data), tag))
            self.t.cv.notify_all()
        return _Request()

    def Irecv(self, spec, peer, tag):
        target, me, src = spec[0], self.topo.rank, self._world(peer)
        key = (self.name, src, me, tag)

        def done(block=False):
            with self.t.cv:
                while not self.t.boxes[key]:
                    if not block:
                        return False
                    if not self.t.cv.wait(timeout=20):
                        raise AssertionError(f"rank {me}: no message from {src} on {self.name} tag {tag}")
                data = self.t.boxes[key].pop(0)
                assert len(data) == target.nbytes, (len(data), target.nbytes)
                target[:] = np.frombuffer(data, np.uint8)
                self.t.log[me].append(("recv", self.name, src, len(data), tag))
                return True
        return _Request(done)


class _Recording(Executor):
    def wait_sends(self, reqs, sids, plan, what):
        self.log.append(("wait", tuple(sorted(sids))))
        super().wait_sends(reqs, sids, plan, what)


def _execute(algorithm, collective, layout, count, seg, data):
    """Run every rank's compiled plan through the Executor; returns (per-rank transport log, per-rank
    waits as [(send keys)], per-rank CompiledPlan, buffers)."""
    t = _Transport()
    N = layout.N
    plans, bufs = {}, {}
    for r in range(N):
        topo = layout.topology(r)
        ex = _Recording({n: t.comm(topo, n) for n in ("world", "row", "col", "local", "cross")}, r, seg, None)
        ex.c_loop, ex.log = False, []
        plans[r] = (ex, ex.compile(plan(algorithm, collective, r, layout, count, ITEMSIZE), ITEMSIZE))
        bufs[r] = data[r].copy()

    run_ranks(N, lambda r: plans[r][0].run(collective, plans[r][1], bufs[r], "sum", 1.0))
    return t.log, {r: ex.log for r, (ex, _) in plans.items()}, {r: cp for r, (_, cp) in plans.items()}, bufs


def run_ranks(size: int, body, timeout: float = 60.0) -> None:
    """Run ``body(rank)`` for every rank on its own thread (the in-process transport's ranks); fail with every
    rank's exception, or when a rank is still running after ``timeout`` s."""
    errors: list = []

    def guarded(r):
        try:
            body(r)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append((r, e))

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)


def _sim_view(compiled, layout):
    """The replay's per-rank sequences from ``replay.match`` of the executor's own compiled plans."""
    steps, sends, recvs, mism = replay.match(compiled, layout)
    assert mism == 0
    log, waits = {}, {}
    for r, (per_step, retire) in steps.items():
        ev, wt = [], []
        for s, (out, inc, inner) in enumerate(per_step):
            if retire[s]:
                wt.append(sorted(retire[s]))
            if inner:  # waited once the step's messages are posted (a step reducing into what it sends)
                wt.append(sorted(inner))
            ev += [("send", key[0], key[2], sends[key][k][1] * ITEMSIZE, s) for key, k in out]
            ev += [("recv", key[0], key[1], recvs[key][k][1] * ITEMSIZE, s) for key, k in inc]
        if retire[-1]:
            wt.append(sorted(retire[-1]))
        log[r], waits[r] = ev, wt
    return log, waits


def _sid_keys(compiled, layout):
    """{rank: {sid: (channel, k)}}: the executor's send ids as the replay's keys (the k-th segment of its
    channel, counted in posting order)."""
    out = {}
    for r, cp in compiled.items():
        seen: Counter = Counter()
        mine = {}
        for _, m in cp.sends:
            key = (m.name, r, layout.world(r, m.name, m.peer))
            mine[m.sid] = (key, seen[key])
            seen[key] += 1
        out[r] = mine
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.X}x{lay.Y}/{lay.node_sizes or lay.ranks_per_node}")
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_replay_matches_executor(layout, algorithm, collective):
    _check_replay(layout, algorithm, collective)


# Swing's power-of-two cores without folding (a line of 8; 4x2 and 4x4 grids, the axes in turn), over nodes.
SWING_LAYOUTS = [Layout(8, 1, 4), Layout(4, 2, 2), Layout(4, 4, 4)]


@pytest.mark.parametrize("layout", SWING_LAYOUTS, ids=lambda lay: f"{lay.X}x{lay.Y}/{lay.ranks_per_node}")
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_swing_replay_matches_executor(layout, collective):
    _check_replay(layout, "swing", collective)


def _check_replay(layout, algorithm, collective):
    """The executor's messages, waits and counts equal the replay's for one layout at several counts and
    segment sizes; the all-reduce's result equals numpy's sum."""
    N = layout.N
    rng = np.random.default_rng(N * 31 + layout.nodes)
    for count in (0, 1, max(N - 1, 2), 7 * N + 3):
        data = {r: rng.standard_normal(count) for r in range(N)}
        for seg in SEGMENTS:
            cost = Cost(segment_bytes=seg)
            log, waits, compiled, bufs = _execute(algorithm, collective, layout, count, seg or replay.UNSEGMENTED,
                                                  data)
            sim_log, sim_waits = _sim_view(replay.compile_all(
                {r: plan(algorithm, collective, r, layout, count, ITEMSIZE) for r in range(N)}, cost, ITEMSIZE), layout)
            keys = _sid_keys(compiled, layout)
            _, st, _ = replay.full({r: plan(algorithm, collective, r, layout, count, ITEMSIZE) for r in range(N)},
                                   layout, cost, ITEMSIZE)
            for r in range(N):
                what = f"{algorithm} {collective} {layout} count {count} segment {seg} rank {r}"
                # the executor tags by step index: compare the tag with the replay's step
                assert log[r] == sim_log[r], what
                assert [sorted(keys[r][g] for g in sids) for _, sids in waits[r] if sids] == sim_waits[r], what
                sent = [e for e in log[r] if e[0] == "send"]
                assert st["msgs"][r] == len(sent), what
                assert st["sent"][r] == sum(e[3] for e in sent), what
                assert st["inter"][r] == sum(e[3] for e in sent if layout.node(e[2]) != layout.node(r)), what
            if collective == "allreduce":
                want = sum(data[r] for r in range(N)) if count else np.zeros(0)
                for r in range(N):
                    np.testing.assert_allclose(bufs[r], want, rtol=1e-12, atol=1e-12)


def _brute_deadline(cp, si, m):
    for t in range(si, len(cp.steps)):
        st = cp.steps[t]  # its own step where that reduces into it (the reduction waits for the send)
        spans = [(x.lo, x.hi) for x in st.recvs if x.hi > x.lo and (t > si or x.tmp_lo >= 0)]
        if st.scale is not None and st.scale[1] > st.scale[0]:
            spans.append(st.scale)
        if any(a < m.hi and m.lo < b for a, b in spans):
            return t
    return len(cp.steps)


@pytest.mark.parametrize("X,Y,L", [(2, 3, 2), (3, 4, 2), (1, 7, 1)])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_deadlines_brute_force(X, Y, L, algorithm, collective):
    """Each send's deadline is the first later step writing any element it reads (or the end; or its own
    step where that reduces into it), and each step retires exactly the sends due there before it starts,
    and its own after posting them (``inner``)."""
    layout = Layout(X, Y, L)
    N = layout.N
    comms = dict.fromkeys(("world", "row", "col", "local", "cross"))
    for count in (1, N + 1, 5 * N + 2):
        for seg in (8, 24, 1 << 30):
            for r in range(N):
                cp = compile_plan(plan(algorithm, collective, r, layout, count, ITEMSIZE), comms, seg, ITEMSIZE)
                due = defaultdict(list)
                for si, m in cp.sends:
                    assert m.until == _brute_deadline(cp, si, m)
                    due[m.until].append(m.sid)
                inner = [sorted(m.sid for m in st.sends if m.until == t) for t, st in enumerate(cp.steps)]
                assert [sorted(st.inner) for st in cp.steps] == inner
                assert [sorted(s.retire) for s in cp.steps] == [sorted(set(due[t]) - set(inner[t]))
                                                                for t in range(len(cp.steps))]
                assert sorted(cp.tail) == sorted(due[len(cp.steps)])



@pytest.mark.parametrize("overlap", [False, True])
def test_send_waited_at_its_deadline(overlap):
    """Rank 0 sends 1000 elements to rank 1 at step 0 and receives one from rank 2 at step 1. Into another
    region the receive need not wait for the send (it is due at the end): rank 2's element arrives after
    ``α + 8β`` and rank 0 ends when its send completes, ``α + 8000β``. Into the sent region the send is due
    before step 1: the receive is posted at ``α + 8000β`` and ends ``α + 8β`` later."""
    cost = Cost(alpha=1e-6, beta=1e-9)
    plans = {0: [Step(sends=(Send("world", 1, 0, 1000),)), Step(recvs=(Recv("world", 2, 0 if overlap else 1000,
                                                                              1, False),))],
             1: [Step(recvs=(Recv("world", 0, 0, 1000, False),)), Step()],
             2: [Step(), Step(sends=(Send("world", 0, 0, 1),))]}
    end, _, _ = replay.full(plans, Layout(3, 1), cost, ITEMSIZE)
    big, small = cost.alpha + 8000 * cost.beta, cost.alpha + 8 * cost.beta
    assert end[0][0] == pytest.approx(big + small if overlap else big, rel=1e-12)
    assert end[1][0] == pytest.approx(big, rel=1e-12)
    assert end[2][0] == pytest.approx(big + small if overlap else small, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_uneven_layout_against_brute_force(seed):
    """Layout.uneven's world ranks and nodes, from torus.topology, equal their definitions computed here:
    nodes are runs of consecutive ranks of the given sizes; "local" lists a node's ranks in order, "cross"
    the ranks at the same position of their node, in rank order."""
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(1, 5, rng.integers(1, 6))]
    N = sum(sizes)
    X = int(rng.choice([d for d in range(1, N + 1) if N % d == 0]))
    layout = Layout.uneven(X, N // X, sizes)
    node = [n for n, size in enumerate(sizes) for _ in range(size)]
    pos = [i for size in sizes for i in range(size)]
    assert list(layout.node(np.arange(N))) == node and layout.nodes == len(sizes)
    for r in range(N):
        members = {"world": list(range(N)), "row": [q for q in range(N) if q // X == r // X],
                   "col": [q for q in range(N) if q % X == r % X],
                   "local": [q for q in range(N) if node[q] == node[r]],
                   "cross": [q for q in range(N) if pos[q] == pos[r]]}
        for comm, ranks in members.items():
            assert [layout.world(r, comm, p) for p in range(len(ranks))] == ranks, (sizes, r, comm)


def test_uneven_layout_rejects_bad_nodes():
    with pytest.raises(ValueError, match="do not cover"):
        Layout.uneven(2, 3, (4, 3))


def test_simulate_uneven_nodes():
    """Uneven nodes through simulate: no tag mismatches for any plan; the ring sends off the node exactly
    from the ranks whose right neighbour is on another node; the orbit fast path equals the full replay."""
    from torus.sim.simulate import simulate
    layout = Layout.uneven(3, 4, (5, 3, 4))
    cost = Cost(1e-6, 1e-10, 3e-11, 4e-6, 5e-10, segment_bytes=64)
    node = layout.node(np.arange(12))
    for algorithm in ALGORITHMS:
        for collective in COLLECTIVES:
            r = simulate(algorithm, collective, layout, 12 * 9 + 5, "float32", cost, "full")
            assert r.tag_mismatches == 0
    ring = simulate("ring", "allreduce", layout, 12 * 9 + 5, "float32", cost, "full")
    crossing = node != np.roll(node, -1)
    assert ring.inter_node_max == pytest.approx(ring.sent_max * max(np.bincount(node, crossing)))
    for algorithm in ("ring", "torus2d"):
        full = simulate(algorithm, "allreduce", layout, 12 * 9 + 5, "float32", cost, "full").as_dict()
        fast = simulate(algorithm, "allreduce", layout, 12 * 9 + 5, "float32", cost, "orbit").as_dict()
        assert fast.pop("method") == "orbit" and full.pop("method") == "full"
        for k, v in full.items():
            assert fast[k] == (pytest.approx(v, rel=1e-12) if isinstance(v, float) else v), k
