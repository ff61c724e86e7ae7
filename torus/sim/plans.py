"""Each rank's plan from the real schedule code, and the rotation that derives every rank's messages from a few.

``plan(algorithm, collective, rank, layout, count)`` calls ``torus.schedules.build``, the builder
``TorusComm`` uses, (allreduce over ``count`` elements; reduce-scatter and all-gather over ``count`` elements
in total, split into ``chunks(count, N)`` blocks, one per rank).

Orbits (the fast path, see torus.sim): a ring plan is rotation-equivariant (rank ``r`` does what rank 0 does,
with every peer and every chunk index shifted by ``r``), and a 2D-torus plan is equivariant under shifts along
the column (rank ``(x, y)`` does what ``(x, 0)`` does, column peers and column chunk indices shifted by ``y``).
To read chunk *indices* off a plan, the representative plan is built with a *labelled* count: one element per
chunk (allreduce: ``count = N`` for the ring, ``X*Y`` for the torus, so that region offsets are chunk numbers;
reduce-scatter/all-gather: unit blocks). The real sizes are then looked up in the real partition. Whether the
derived messages equal the real plan's is checked by ``verify`` against real plans of sampled ranks at the
real count (every rank in the tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torus.partition import chunks
from torus.runtime.compile import compile_plan
from torus.schedules import registry, ring, torus2d
from torus.schedules.build import build, effective
from torus.sim.model import Layout, SimulationError

# The built-in schedules (tests parametrize over them); torus-sim reads the registry when it runs
# (``schedules()``, ``default()``, an entry's ``orbit``), so a registered algorithm is replayed too.
ALGORITHMS = ("ring", "hierarchical", "torus2d", "swing", "swing_latency")
DEFAULT = ALGORITHMS[:4]  # torus-sim's default sweep: swing takes its latency-optimal form where it runs it
NO_ORBIT = ("swing", "swing_latency")  # no rotation derives every rank from a few: replayed in full at every size
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")


def schedules() -> tuple:
    """The registered algorithms torus-sim replays as plans (registry order; ``shm`` is simulate's own)."""
    return tuple(n for n in registry.simulated() if registry.get(n).build is not None)


def default() -> tuple:
    """torus-sim's default ``--algo`` list: the entries marked ``sim_default``, in registry order."""
    return tuple(n for n in schedules() if registry.get(n).sim_default)


def plan(algorithm: str, collective: str, rank: int, layout: Layout, count: int, itemsize: int,
         latency_bytes: int | None = None):
    """The list of Steps ``rank`` runs; ``count`` in elements (reduce-scatter and all-gather: ``chunks(count,
    N)`` blocks). Built by the same ``torus.schedules.build`` as TorusComm's, on the layout's topology, with
    its decisions (``effective``: hierarchical reduce-scatter and all-gather run the ring on uneven nodes; a
    swing all-reduce of ``count * itemsize`` bytes takes its latency-optimal form up to ``latency_bytes``,
    None: ``build.swing_latency_bytes()``; simulate passes the one its link gives, as TorusComm does)."""
    counts = count if collective == "allreduce" else tuple(chunks(count, layout.N)[0])
    topology = layout.topology(rank)
    return build(collective, effective(collective, algorithm, topology, count * itemsize, latency_bytes), topology,
                 counts)


@dataclass
class Arrays:
    """Step-aligned messages of a set of ranks: at step ``s`` rank ``i`` (world rank ``world[i]``) receives
    ``rb[s, i]`` elements from index ``rp[s, i]`` (-1: none; ``rr``: reduced) and sends ``sb[s, i]`` to
    ``sp[s, i]``, which must complete before step ``until[s, i]`` (compile_plan's deadline; ``nsteps``: the
    end). Shapes (steps, ranks); ``row(s)`` gives one step's five rows, ``deadline(s)`` its deadlines."""
    world: np.ndarray
    rp: np.ndarray
    rb: np.ndarray
    rr: np.ndarray
    sp: np.ndarray
    sb: np.ndarray
    until: np.ndarray

    @property
    def nsteps(self) -> int:
        return self.rp.shape[0]

    def row(self, s: int, cols=slice(None)):
        return self.rp[s, cols], self.rb[s, cols], self.rr[s, cols], self.sp[s, cols], self.sb[s, cols]

    def deadline(self, s: int, cols=slice(None)):
        return self.until[s, cols]


@dataclass
class RingArrays:
    """``Arrays`` of a ring phase kept as rank 0's steps: rank ``i`` at step ``s`` talks to ``peer + i`` about
    chunk ``chunk + i`` (mod size), so the (steps, ranks) tables are never stored."""
    world: np.ndarray
    real: np.ndarray  # chunk sizes of the real partition
    recv: list  # per step: (peer, chunk, reduce) or None
    send: list  # per step: (peer, chunk) or None
    until: list  # per step: the send's deadline step (the same on every rank)

    @property
    def nsteps(self) -> int:
        return len(self.recv)

    def row(self, s: int, cols=None):
        n = self.world.size
        shift = np.arange(n) if cols is None else np.asarray(cols)
        rp, rb, rr = np.full(shift.size, -1), np.zeros(shift.size, np.int64), np.zeros(shift.size, bool)
        sp, sb = rp, rb
        if self.recv[s] is not None:
            peer, chunk, reduce = self.recv[s]
            rb = self.real[(chunk + shift) % n]
            rp = np.where(rb > 0, (peer + shift) % n, -1)
            rr = np.full(shift.size, reduce)
        if self.send[s] is not None:
            peer, chunk = self.send[s]
            sb = self.real[(chunk + shift) % n]
            sp = np.where(sb > 0, (peer + shift) % n, -1)
        return rp, rb, rr, sp, sb

    def deadline(self, s: int, cols=None):
        return np.full(self.world.size if cols is None else len(cols), self.until[s])


def empty(S: int, n: int, world) -> Arrays:
    """``S`` steps of ``n`` ranks without a message (every send due at the end)."""
    neg = np.full((S, n), -1, np.int64)
    zero = np.zeros((S, n), np.int64)
    return Arrays(np.asarray(world, np.int64), neg, zero, np.zeros((S, n), bool), neg.copy(), zero.copy(),
                  np.full((S, n), S, np.int64))


def deadlines(steps, itemsize: int = 1, segment_bytes: int = 1 << 62) -> list:
    """Per step of ``steps`` the deadline compile_plan gives its sends (``len(steps)``: the end; None: no
    send). Raises SimulationError when the segments of one step's sends have different deadlines."""
    plan = compile_plan(steps, dict.fromkeys(("world", "row", "col", "local", "cross")), segment_bytes,
                        itemsize)
    out = []
    for s, step in enumerate(plan.steps):
        until = {m.until for m in step.sends}
        if len(until) > 1:
            raise SimulationError(f"torus-sim: step {s}'s sends are due at different steps {sorted(until)}; "
                                  "the orbit fast path needs one deadline per step")
        out.append(until.pop() if until else None)
    return out


def _one(msgs, what: str, rank: int, s: int):
    if len(msgs) > 1:
        raise SimulationError(f"torus-sim {what} on rank {rank}: step {s} has {len(msgs)} messages one way; "
                              "the orbit fast path needs at most one")
    return msgs[0] if msgs else None


def extract(steps, rank: int, layout: Layout, index, what: str = "plan"):
    """Per step ``(recv_peer, recv_count, reduce, send_peer, send_count)`` of one real plan; peers as
    ``index(world_rank)``; -1/0 where there is no message (a zero-count message is none: the executor skips
    it)."""
    out = []
    for s, step in enumerate(steps):
        r = _one([m for m in step.recvs if m.count], what, rank, s)
        m = _one([m for m in step.sends if m.count], what, rank, s)
        out.append((index(layout.world(rank, r.comm, r.peer)) if r else -1, r.count if r else 0,
                    bool(r and r.reduce), index(layout.world(rank, m.comm, m.peer)) if m else -1,
                    m.count if m else 0))
    return out


def ring_orbit(size: int, count: int, comm: str, labelled_steps, world) -> RingArrays:
    """Every rank's messages of a ring phase on ``size`` ranks (``world``: their world ranks, in comm order),
    from rank 0's labelled steps (offsets are chunk numbers)."""
    recv, send = [], []
    until = [len(labelled_steps) if u is None else u for u in deadlines(labelled_steps)]
    for s, step in enumerate(labelled_steps):
        r = _one([m for m in step.recvs if m.comm == comm], "ring orbit", 0, s)
        m = _one([m for m in step.sends if m.comm == comm], "ring orbit", 0, s)
        recv.append((r.peer, r.offset, r.reduce) if r else None)
        send.append((m.peer, m.offset) if m else None)
    return RingArrays(np.asarray(world, np.int64), np.asarray(chunks(count, size)[0], np.int64), recv, send,
                      until)


def orbit(algorithm: str, collective: str, layout: Layout, count: int) -> Arrays | RingArrays:
    """Every rank's step-aligned messages (world-rank indices): the registry entry's ``orbit``
    (torus/schedules/registry.py): ring or torus2d (any collective) and the hierarchical reduce-scatter/all-gather
    (the torus plans on the local x cross grid)."""
    fast = registry.get(algorithm).orbit
    if fast is None:
        raise SimulationError(f"torus-sim: {algorithm} has no orbit fast path (its peers are not a rotation "
                              "of one rank's); replay it in full (method='full' or 'auto')")
    return fast(collective, layout, count)


def ring_orbit_of(collective: str, layout: Layout, count: int) -> RingArrays:
    """The ring's orbit: rank 0's labelled plan, rotated."""
    N = layout.N
    if collective == "allreduce":
        lab = ring.allreduce("world", 0, N, N)
    else:
        lab = getattr(ring, collective)("world", 0, N, [1] * N, list(range(N)))
    return ring_orbit(N, count, "world", lab, np.arange(N))


def torus2d_orbit(collective: str, layout: Layout, count: int) -> Arrays:
    """The 2D torus' orbit: column ``x``'s representative ``(x, 0)``, shifted along the column."""
    return _grid_orbit("torus2d", collective, layout, count, layout.X, layout.Y, "row", "col")


def hierarchical_orbit(collective: str, layout: Layout, count: int) -> Arrays:
    """The hierarchical reduce-scatter's and all-gather's orbit (the torus plans on the local x cross grid)."""
    if collective == "allreduce":
        raise SimulationError("torus-sim: the hierarchical allreduce gathers several messages in one step; "
                              "torus.sim.simulate replays it per node instead")
    L = layout.ranks_per_node
    return _grid_orbit("hierarchical", collective, layout, count, L, layout.N // L, "local", "cross")


def _grid_orbit(algorithm: str, collective: str, layout: Layout, count: int, X: int, Y: int, row: str,
                col: str) -> Arrays:
    N = layout.N
    names = {row: "row", col: "col"}
    ys = np.arange(Y)
    if collective == "allreduce":
        row_counts = np.asarray(chunks(count, X)[0], np.int64)
        sub = [np.asarray(chunks(int(c), Y)[0], np.int64) for c in row_counts]
        reps = [torus2d.allreduce(x, 0, X, Y, X * Y, row, col) for x in range(X)]
    else:
        counts = np.asarray(chunks(count, N)[0], np.int64)
        seg = counts.reshape(Y, X).sum(axis=1)
        unit, label = [1] * N, list(range(N))
        reps = [getattr(torus2d, collective)(x, 0, X, Y, unit, label, row, col) for x in range(X)]
    S = len(reps[0])
    a = empty(S, N, np.arange(N))
    for x, steps in enumerate(reps):
        if len(steps) != S:
            raise SimulationError(f"torus-sim {algorithm} {collective}: ranks differ in step counts")
        cols = ys * X + x  # world ranks of column x
        for s, u in enumerate(deadlines(steps)):
            a.until[s, cols] = S if u is None else u
        for s, step in enumerate(steps):
            for msgs, peer, nb, is_recv in ((step.recvs, a.rp, a.rb, True), (step.sends, a.sp, a.sb, False)):
                m = _one(list(msgs), f"{algorithm} orbit", x, s)
                if m is None:
                    continue
                if names[m.comm] == "row":
                    dest = ys * X + m.peer
                    if collective == "allreduce":
                        n = np.full(Y, row_counts[m.offset // Y])
                    else:
                        n = counts[ys * X + m.offset % X]
                else:
                    dest = ((m.peer + ys) % Y) * X + x
                    if collective == "allreduce":
                        n = sub[x][(m.offset - x * Y + ys) % Y]
                    else:
                        n = seg[(m.offset // X + ys) % Y]
                nb[s, cols] = n
                peer[s, cols] = np.where(n > 0, dest, -1)
                if is_recv:
                    a.rr[s, cols] = m.reduce
    return a


def verify(a, algorithm: str, collective: str, layout: Layout, count: int, ranks, itemsize: int = 4,
           segment_bytes: int = 1 << 62) -> None:
    """Raise SimulationError unless the orbit arrays equal the real plans of ``ranks`` (at the real count),
    their messages and their sends' deadlines as compile_plan sets them at this ``itemsize`` and
    ``segment_bytes``."""
    index = {int(w): i for i, w in enumerate(a.world)}.__getitem__
    cols = [index(r) for r in ranks]
    derived: list = [[] for _ in ranks]
    for s in range(a.nsteps):
        rp, rb, rr, sp, sb = a.row(s, cols)
        for j in range(len(cols)):
            derived[j].append((int(rp[j]), int(rb[j]), bool(rr[j]) and rp[j] >= 0, int(sp[j]), int(sb[j])))
    for j, (r, mine) in enumerate(zip(ranks, derived)):
        steps = plan(algorithm, collective, r, layout, count, itemsize)
        real = extract(steps, r, layout, index)
        real = [(rp, rb, rr and rp >= 0, sp, sb) for rp, rb, rr, sp, sb in real]
        if real != mine:
            bad = next((s for s, (u, v) in enumerate(zip(real, mine)) if u != v), min(len(real), len(mine)))
            raise SimulationError(f"torus-sim {algorithm} {collective} on rank {r}: the rotated plan differs "
                                  f"from the real plan at step {bad}; the orbit fast path does not apply")
        for s, u in enumerate(deadlines(steps, itemsize, segment_bytes)):
            if u is not None and u != int(a.deadline(s, [cols[j]])[0]):
                raise SimulationError(f"torus-sim {algorithm} {collective} on rank {r}: the send of step {s} "
                                      f"is due at step {u}, not at the representative's; the orbit fast path "
                                      "does not apply")
