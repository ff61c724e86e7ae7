"""``simulate``: one collective, one algorithm, one grid and size -> counts and predicted time (see torus.sim)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from torus.partition import chunks
from torus.schedules import registry
from torus.schedules.build import swing_latency_bytes
from torus.schedules.plan import Step
from torus.sim import phased, replay, shm
from torus.sim import plans as P
from torus.sim.model import ITEMSIZE, Cost, Layout, SimulationError

ALGORITHMS = (*P.ALGORITHMS, "shm")  # the built-ins it models; ``algorithms()`` reads the registry when asked
FULL_MAX_RANKS = 64  # method="auto" replays every rank's real plan up to this many ranks
SAMPLES = 6  # ranks whose real plans are checked against the orbit at larger sizes


def algorithms() -> tuple:
    """Every algorithm torus-sim models: the registered ones marked ``simulated`` (the schedules, and the
    shared-memory transport ``shm``, one node), in registry order (torus/schedules/registry.py)."""
    return registry.simulated()


@dataclass
class Result:
    """Per collective call. Bytes per rank: sent, reduced, sent to another node (max and mean over ranks);
    ``inter_node_max``: bytes leaving the busiest node; ``steps``: messages in sequence on the critical path;
    ``time``: seconds until the last rank finishes; ``tag_mismatches``: message pairs posted at different step
    indices (the executor, which tags by step, would hang on them); ``method``: "full", "orbit", "phased",
    "shm" or "alloc"; ``network``: how the nodes are wired (sim/network.py)."""
    algorithm: str
    collective: str
    ranks: int
    dims: str
    ranks_per_node: int
    count: int
    nbytes: int
    steps: int
    msgs_max: float
    msgs_mean: float
    sent_max: float
    sent_mean: float
    reduced_max: float
    reduced_mean: float
    inter_rank_max: float
    inter_node_max: float
    time: float
    tag_mismatches: int
    method: str
    network: str = "star"

    def as_dict(self) -> dict:
        return asdict(self)


def _result(algorithm, collective, layout, count, itemsize, time, depth, st, mismatches, method) -> Result:
    node = layout.node(np.arange(layout.N))
    per_node = np.bincount(node, weights=st["inter"], minlength=layout.nodes)
    return Result(algorithm, collective, layout.N, f"{layout.X}x{layout.Y}", layout.ranks_per_node, count,
                  count * itemsize, int(depth), float(st["msgs"].max()), float(st["msgs"].mean()),
                  float(st["sent"].max()), float(st["sent"].mean()), float(st["reduced"].max()),
                  float(st["reduced"].mean()), float(st["inter"].max()), float(per_node.max()), float(time),
                  int(mismatches), method, layout.network.name)


def _samples(n: int) -> list[int]:
    rng = np.random.default_rng(n)
    return sorted({0, 1 % n, n // 2, n - 1, *rng.integers(0, n, SAMPLES - 4).tolist()})


def simulate(algorithm: str, collective: str, layout: Layout, count: int, dtype: str = "float32",
             cost: Cost = Cost(), method: str = "auto", alloc: bool = False, shm_phases: bool = True) -> Result:
    """Replay ``collective`` by ``algorithm`` on ``layout`` for ``count`` elements of ``dtype``.

    ``count``: elements of the all-reduce buffer, or of the whole reduce-scatter input / all-gather output.
    ``method``: "full" replays every rank's real plan; "orbit" derives all ranks from representatives
    (checked against real plans of sampled ranks); "auto" picks full up to FULL_MAX_RANKS ranks. ``shm``
    (one node only) replays the shared-memory transport's steps instead (sim/shm.py; method "shm"); swing has
    no orbit and "auto" replays it in full at every size.
    ``alloc``: an in-place all-reduce of a ``TorusComm.alloc`` buffer; shm then replays ``run_window``
    (method "alloc"), the other algorithms run such a buffer as any other (priced as without).
    ``shm_phases``: across nodes, replay what TorusComm runs with its ``shm_phases`` on (its default): the
    node-level phases over shared memory (sim/phased.py, method "phased"); off, the plain plan.
    Raises ValueError for unknown names or ``alloc`` with another collective than allreduce,
    SimulationError for a plan that cannot run or shm across nodes.
    """
    if algorithm not in algorithms() or collective not in P.COLLECTIVES or dtype not in ITEMSIZE:
        raise ValueError(f"torus-sim: unknown algorithm/collective/dtype {algorithm}/{collective}/{dtype}")
    if alloc and collective != "allreduce":
        raise ValueError(f"torus-sim: alloc buffers serve in-place all-reduces, not {collective}")
    itemsize = ITEMSIZE[dtype]
    # where swing takes its latency-optimal form: as TorusComm decides it from the link between nodes
    latency_bytes = swing_latency_bytes(cost.link_gbits() if layout.nodes > 1 else None)
    if algorithm == "shm":
        return _shm(collective, layout, count, itemsize, cost, alloc)
    if shm_phases and layout.nodes > 1:
        counts = count if collective == "allreduce" else tuple(chunks(count, layout.N)[0])
        per_rank = phased.build(algorithm, collective, layout, counts, itemsize, latency_bytes)
        if per_rank is not None:
            end, st, mism = phased.replay_phases(per_rank, layout, cost, itemsize)
            return _result(algorithm, collective, layout, count, itemsize, max(t for t, _ in end.values()),
                           max(d for _, d in end.values()), st, mism, "phased")
    if method == "auto":
        fast = registry.get(algorithm).orbit is not None
        method = "full" if layout.N <= FULL_MAX_RANKS or not fast or layout.node_of else "orbit"
    if method == "full":
        plans = {r: P.plan(algorithm, collective, r, layout, count, itemsize, latency_bytes) for r in range(layout.N)}
        end, st, mism = replay.full(plans, layout, cost, itemsize)
        time = max(t for t, _ in end.values())
        depth = max(d for _, d in end.values())
        return _result(algorithm, collective, layout, count, itemsize, time, depth, st, mism, "full")
    if method != "orbit":
        raise ValueError(f"torus-sim: unknown method {method!r}")
    if registry.get(algorithm).orbit is None:
        raise SimulationError(f"torus-sim: {algorithm} has no orbit fast path (its peers are not a rotation "
                              "of one rank's); replay it in full (method='full' or 'auto')")
    if layout.node_of is not None:
        raise SimulationError("torus-sim: the orbit fast paths need nodes of consecutive ranks; replay other "
                              "placements in full (method='full' or 'auto')")
    if algorithm == "hierarchical" and layout.node_sizes is not None:
        raise SimulationError("torus-sim: the hierarchical orbit needs nodes of equal size; replay uneven "
                              "nodes in full (method='full')")
    # Not an orbit of one plan: the leaders' ring between two node-local replays (below).
    if algorithm == "hierarchical" and collective == "allreduce":
        return _hierarchical_allreduce(layout, count, itemsize, cost)
    a = P.orbit(algorithm, collective, layout, count)
    P.verify(a, algorithm, collective, layout, count, _samples(layout.N), itemsize, replay.segment_bytes(cost))
    T, D, st = replay.lockstep(a, layout, cost, itemsize)
    return _result(algorithm, collective, layout, count, itemsize, T.max(), D.max(), st, 0, "orbit")


def _hierarchical_allreduce(layout: Layout, count: int, itemsize: int, cost: Cost) -> Result:
    """Nodes run identical node-local phases (the local chunks do not depend on the node), so one node is
    replayed in full before and after the leaders' cross-node ring, which runs as an orbit over all leaders.
    The node whose leader finishes the ring last finishes last (the replay is monotone in start times).
    A send still outstanding at the end of a phase is waited for there (a little later than the executor,
    which waits at its deadline step, where that lies in the next phase)."""
    L, C = layout.ranks_per_node, layout.nodes
    node0 = {lr: P.plan("hierarchical", "allreduce", lr, layout, count, itemsize) for lr in range(L)}
    compiled = replay.compile_all(node0, cost, itemsize)
    crosses = [s for s, st in enumerate(node0[0]) if any(m.comm == "cross" for m in st.sends + st.recvs)]
    a, b = (crosses[0], crosses[-1] + 1) if crosses else (len(node0[0]), len(node0[0]))
    local = {lr: [Step(tuple(m for m in st.sends if m.comm != "cross"), tuple(m for m in st.recvs if m.comm != "cross"),
                       st.scale) for st in p] for lr, p in node0.items()}
    mism = replay.match(replay.compile_all(local, cost, itemsize), layout)[3]
    pre, st_pre, _ = replay.full(compiled, layout, cost, itemsize, window={lr: (0, a) for lr in node0})
    t_c, d_c = np.full(C, pre[0][0]), np.full(C, pre[0][1], np.int64)
    cross = {k: np.zeros(C) for k in st_pre}
    if crosses:
        labelled = P.plan("hierarchical", "allreduce", 0, layout, C, itemsize)
        steps = [st for st in labelled if any(m.comm == "cross" for m in st.sends + st.recvs)]
        arr = P.ring_orbit(C, count, "cross", steps, np.arange(C) * L)
        for n in _samples(C):
            real = P.plan("hierarchical", "allreduce", n * L, layout, count, itemsize)[a:b]
            got = P.extract(real, n * L, layout, lambda w: w // L, "hierarchical cross")
            want = [(int(rp[0]), int(rb[0]), bool(rr[0]), int(sp[0]), int(sb[0]))
                    for rp, rb, rr, sp, sb in (arr.row(s, [n]) for s in range(arr.nsteps))]
            due = P.deadlines(real, itemsize, replay.segment_bytes(cost))
            if [(p, c, r and p >= 0, q, d) for p, c, r, q, d in got] != \
                    [(p, c, r and p >= 0, q, d) for p, c, r, q, d in want] or \
                    any(u is not None and u != arr.until[s] for s, u in enumerate(due)):
                raise SimulationError(f"torus-sim hierarchical allreduce on rank {n * L}: the rotated cross "
                                      "ring differs from the real plan")
        t_c, d_c, cross = replay.lockstep(arr, layout, cost, itemsize, t_c, d_c)
    start = {lr: pre[lr] for lr in range(L)}
    start[0] = (float(t_c.max()), int(d_c.max()))
    post, st_post, _ = replay.full(compiled, layout, cost, itemsize, start,
                                   {lr: (b if lr == 0 else a, len(p)) for lr, p in node0.items()})
    st = {}
    for k in st_pre:
        per = np.tile(st_pre[k] + st_post[k], C)
        per[::L] += cross[k]
        st[k] = per
    time = max(t for t, _ in post.values())
    depth = max(d for _, d in post.values())
    return _result("hierarchical", "allreduce", layout, count, itemsize, time, depth, st, mism, "orbit")


def _shm(collective: str, layout: Layout, count: int, itemsize: int, cost: Cost, alloc: bool) -> Result:
    """The shared-memory transport: no messages; ``steps`` counts the flags waited on in sequence, ``msgs``
    the flags each rank publishes, ``sent`` the bytes it copies (into the window; ``alloc``: from the peers'
    buffers into its own), ``reduced`` the bytes it reduces (sim/shm.py)."""
    if alloc:
        time, steps, copied, reduced, flags = shm.replay_window(layout, count, itemsize, cost)
    else:
        time, steps, copied, reduced, flags = shm.replay(collective, layout, count, itemsize, cost)
    st = {"msgs": flags, "sent": copied, "reduced": reduced, "inter": np.zeros(layout.N)}
    return _result("shm", collective, layout, count, itemsize, time, steps, st, 0, "alloc" if alloc else "shm")
