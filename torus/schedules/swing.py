"""Swing all-reduce, reduce-scatter and all-gather, bandwidth-optimal form (De Sensi et al., NSDI'24, "Swing:
Short-cutting Rings for Higher Bandwidth Allreduce", arXiv:2401.09356: the peers ``pi(r, s)`` and ``rho`` of the
1-D power-of-two case, its bandwidth-optimal reduce-scatter + all-gather, and the multidimensional form that
visits the dimensions in turn).

Vocabulary. On a line of ``n = 2**L`` ranks, step ``s`` pairs rank ``r`` with ``r + rho(s)`` when ``r`` is even and
``r - rho(s)`` when odd (mod ``n``), ``rho(s) = sum_{i=0..s} (-2)**i`` = 1, -1, 3, -5, 11, ...: distances that grow
as the data halves, so the largest messages travel the shortest distances. On an ``X x Y`` grid the steps alternate
between the row (``x``'s parity and distance) and the column until both axes have run their ``log2`` steps; where
one axis lies within the nodes (``local``), its steps run first. A *group* ``G(r, s)`` is the set of ranks ``r``
still reaches in steps ``s, s+1, ...``; the groups of one step partition the ranks, and ``G(r, s)`` is ``G(r, s+1)``
joined with ``G(peer, s+1)``. Reduce-scatter: at step ``s`` rank ``r`` sends the peer the data of ``G(peer, s+1)``
and reduces what the peer sends of ``G(r, s+1)`` (``L`` steps; half, then a quarter ... of the buffer: ``(n-1)/n``
of it in all). All-gather runs the same steps in reverse order, copying. All-reduce is the two in sequence: ``2 log2
n`` steps, ``2(n-1)/n`` of the buffer sent per rank, as the ring.

Layout. A reduce-scatter's and an all-gather's blocks are the caller's (block ``w`` on world rank ``w``), so a
group's blocks may be several runs of the buffer: one message per run. The all-reduce chooses its own chunk
layout: chunk ``i`` of ``chunks(count, n)`` belongs to the rank at position ``i`` of an order in which every
group is contiguous (``_order``), so each of its steps is one message.

Any rank count: folded onto a power of two along each axis (docs/design.md, "Swing at any rank count").

Plans are pure and dtype-free: regions in elements of the working buffer, so one plan serves every dtype and
op (the executor's kernels) in place and out of place (compile.py); any count, 0 and fewer elements than ranks
included (empty regions are no message). Each element is reduced on one rank (its core owner, or a fold
partner) and copied to the others, so every rank's result is bitwise identical; no step receives into a
region it sends (plan.py). The comm names are "world" (a line: a grid with a side of 1) or "row"/"col";
peers are indices in those communicators (``x`` in the row, ``y`` in the column). Nothing here raises.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from torus.partition import chunks, displacements
from torus.schedules.plan import Recv, Scale, Send, Step


def rho(s: int) -> int:
    """``sum_{i=0..s} (-2)**i``: Swing's peer distance at step ``s`` (the paper's 1-D case)."""
    return (1 - (-2) ** (s + 1)) // 3


def _core(n: int) -> tuple[int, int]:
    """``(2**k, e)``: the power of two that runs Swing on an axis of ``n`` ranks and the ranks folded into it."""
    c = 1 << (n.bit_length() - 1)
    return c, n - c


def _core_index(c: int, e: int) -> int | None:
    """The index among the ``2**k`` core coordinates of axis coordinate ``c`` (None: folded into ``c - 1``)."""
    if c < 2 * e:
        return None if c % 2 else c // 2
    return c - e


def _coord(k: int, e: int) -> int:
    """The axis coordinate of core index ``k``."""
    return 2 * k if k < e else k + e


@lru_cache(maxsize=64)
def _steps(cx: int, cy: int, first: int = 0, in_turn: bool = True) -> tuple:
    """The axis (0: row, 1: column) and axis step of every Swing step on a ``cx x cy`` core: the axes in turn
    from axis ``first`` (the paper's order), or (``in_turn`` false) every step of axis ``first``, then the
    other's."""
    logs = (cx.bit_length() - 1, cy.bit_length() - 1)
    axes = (first, 1 - first)
    if not in_turn:
        return tuple((a, k) for a in axes for k in range(logs[a]))
    return tuple((a, k) for k in range(max(logs)) for a in axes if k < logs[a])


def _peer(kx: int, ky: int, cx: int, cy: int, step: tuple) -> tuple[int, int]:
    axis, k = step
    if axis == 0:
        return (kx + rho(k) if kx % 2 == 0 else kx - rho(k)) % cx, ky
    return kx, (ky + rho(k) if ky % 2 == 0 else ky - rho(k)) % cy


@lru_cache(maxsize=16)
def _order(cx: int, cy: int, first: int = 0, in_turn: bool = True) -> tuple:
    """``(pos, lo, by_pos)`` on a ``cx x cy`` core, core ranks numbered ``kx + cx * ky``: ``pos[v]``, an
    order of the ranks in which every group is contiguous; ``lo[s][v]``, the first position of ``G(v, s)``
    (which holds ``2**(L - s)`` ranks); ``by_pos``, the ranks in that order. Built bottom-up: each group's
    label is its least member; at step ``s`` the half whose label is larger goes second (bit ``L-1-s`` of
    the position)."""
    steps = _steps(cx, cy, first, in_turn)
    n = cx * cy
    v = np.arange(n)
    peer = [np.array([_peer(r % cx, r // cx, cx, cy, st)[0] + cx * _peer(r % cx, r // cx, cx, cy, st)[1]
                      for r in range(n)], np.int64) for st in steps]
    L = len(steps)
    label = [v] * (L + 1)
    for s in range(L - 1, -1, -1):
        label[s] = np.minimum(label[s + 1], label[s + 1][peer[s]])
    pos = np.zeros(n, np.int64)
    for s in range(L):
        pos += (label[s + 1] > label[s + 1][peer[s]]).astype(np.int64) << (L - 1 - s)
    lo = [pos] * (L + 1)
    for s in range(L - 1, -1, -1):
        lo[s] = np.minimum(lo[s + 1], lo[s + 1][peer[s]])
    return pos, lo, np.argsort(pos)


def _runs(regions) -> tuple:
    """``(offset, count)`` regions sorted and merged where they touch; empty ones dropped."""
    out: list = []
    for o, c in sorted(r for r in regions if r[1] > 0):
        if out and out[-1][0] + out[-1][1] == o:
            out[-1] = (out[-1][0], out[-1][1] + c)
        else:
            out.append((o, c))
    return tuple(out)


def _minus(runs, regions) -> tuple:
    """The parts of ``runs`` outside every one of ``regions``, as runs."""
    out = list(_runs(runs))
    for o, c in _runs(regions):
        out = [piece for a, n in out for piece in ((a, min(n, o - a)), (max(a, o + c), a + n - max(a, o + c)))
               if piece[1] > 0]
    return _runs(out)


class _Grid:
    """One rank's place on an ``X x Y`` grid (a line: ``Y == 1`` on "world") and its fold onto the
    ``cx x cy`` core. Coordinates are ``(x, y)``; world rank ``x + X * y``.

    Every rank takes the core steps of its *shadow* ``me`` (the core rank it folds into, or itself) until it
    folds: an axis folds just before its first step (``fold_at``), when the data has already halved once per
    step before it, and the axes run in turn from an unfolded one where there is one, so a grid with one
    folded axis folds half the buffer. Peers are indices in the row or column communicator, so a folded rank
    taking its shadow's step talks to the same coordinate of its own row or column, which folds alike.

    ``local``: the axis whose communicators lie within the nodes (None: no such axis). Its steps then all run
    first and the other axis' after them, so the halvings inside the nodes come before anything crosses a
    node's link: ``1/L`` of the buffer leaves each of a node's ``L`` ranks at the first crossing step, where
    the axes in turn send half of it from every rank at the second (the 2D torus' ``columns_first``, for the
    same reason)."""

    def __init__(self, x: int, y: int, X: int, Y: int, comms: tuple, local: int | None = None):
        self.x, self.y, self.X, self.Y, self.comms = x, y, X, Y, comms
        (self.cx, self.ex), (self.cy, self.ey) = _core(X), _core(Y)
        self.in_turn = local is None  # a grid (not a line): both axes have steps
        self.first = local if local is not None else 1 if self.ex and not self.ey and self.cy > 1 else 0
        self.steps = _steps(self.cx, self.cy, self.first, self.in_turn)
        self.fold_at = {a: next(i for i, st in enumerate(self.steps) if st[0] == a)
                        for a, e in ((0, self.ex), (1, self.ey)) if e}
        kx, ky = _core_index(x, self.ex), _core_index(y, self.ey)
        self.extra_on = tuple(a for a, k in ((0, kx), (1, ky)) if k is None)
        sx = kx if kx is not None else _core_index(x - 1, self.ex)
        sy = ky if ky is not None else _core_index(y - 1, self.ey)
        assert sx is not None and sy is not None
        self.me = sx + self.cx * sy
        # the core steps this rank takes: those before its first fold
        self.until = min((self.fold_at[a] for a in self.extra_on), default=len(self.steps))

    def order(self) -> tuple:
        return _order(self.cx, self.cy, self.first, self.in_turn)

    def world_of(self, kx: int, ky: int) -> tuple[int, int]:
        return _coord(kx, self.ex), _coord(ky, self.ey)

    def members(self, kx: int, ky: int) -> list:
        """World ranks folded into core rank ``(kx, ky)`` (itself first)."""
        x, y = self.world_of(kx, ky)
        xs = [x] + [x + 1] * (x < 2 * self.ex)
        ys = [y] + [y + 1] * (y < 2 * self.ey)
        return [a + self.X * b for b in ys for a in xs]

    def core_step(self, s: int):
        """(comm, peer index in it, the peer's core rank) of the shadow's Swing step ``s``."""
        axis = self.steps[s][0]
        qx, qy = _peer(self.me % self.cx, self.me // self.cx, self.cx, self.cy, self.steps[s])
        wx, wy = self.world_of(qx, qy)
        return self.comms[axis], (wx, wy)[axis], qx + self.cx * qy

    def late_fold(self, axis: int, regions, inward: bool) -> Step:
        """The fold of ``axis`` at its ``fold_at`` step: inward (reduce-scatter) its folded ranks send their
        shadow's current ``regions`` to ``c - 1``, which reduces them; outward (all-gather) ``c - 1`` sends
        ``regions(x, y)`` (what folded rank ``(x, y)`` lacks) and the folded rank copies them. Ranks folded
        on the other axis before this point, and every other rank, idle."""
        j = self.fold_at[axis]
        if any(self.fold_at[b] < j for b in self.extra_on if b != axis):
            return Step()
        c, e = (self.x, self.ex) if axis == 0 else (self.y, self.ey)
        if axis in self.extra_on:
            return _one_way(self.comms[axis], c - 1, regions(self.x, self.y), send=inward, reduce=inward)
        if c < 2 * e:
            other = (self.x + 1, self.y) if axis == 0 else (self.x, self.y + 1)
            return _one_way(self.comms[axis], c + 1, regions(*other), send=not inward, reduce=inward)
        return Step()

    def fold_in(self, regions_x, regions_y, reduce: bool) -> list:
        """Folds before all else (an all-gather's blocks): the row's folded ranks send ``regions_x(x, y)``
        (what world rank ``(x, y)`` hands on) to ``x - 1``, then the column's send ``regions_y(x, y)`` to
        ``y - 1``; the receivers reduce them (``reduce``) or copy them."""
        return self._fold(regions_x, regions_y, False, reduce)

    def fold_out(self, regions_x, regions_y) -> list:
        """Folds after all else (a reduce-scatter's blocks), copied: column first, then row
        (``regions_*(x, y)``: what the folded world rank ``(x, y)`` receives)."""
        return self._fold(regions_x, regions_y, True, False)

    def _fold(self, regions_x, regions_y, out: bool, reduce: bool) -> list:
        x, y = self.x, self.y
        steps = []
        if self.ex:  # the row: (x odd < 2e) <-> (x - 1)
            st = Step()
            if 0 in self.extra_on:
                st = _one_way(self.comms[0], x - 1, regions_x(x, y), send=not out, reduce=reduce)
            elif x < 2 * self.ex:
                st = _one_way(self.comms[0], x + 1, regions_x(x + 1, y), send=out, reduce=reduce)
            steps.append(st)
        if self.ey:  # the column, among the row's core coordinates
            st = Step()
            if self.extra_on == (1,):
                st = _one_way(self.comms[1], y - 1, regions_y(x, y), send=not out, reduce=reduce)
            elif not self.extra_on and y < 2 * self.ey:
                st = _one_way(self.comms[1], y + 1, regions_y(x, y + 1), send=out, reduce=reduce)
            steps.append(st)
        return steps[::-1] if out else steps


def _one_way(comm: str, peer: int, regions, send: bool, reduce: bool) -> Step:
    runs = _runs(regions)
    if send:
        return Step(sends=tuple(Send(comm, peer, o, c) for o, c in runs))
    return Step(recvs=tuple(Recv(comm, peer, o, c, reduce=reduce) for o, c in runs))


def _swing_rs(g: _Grid, group, final: bool) -> list:
    """Swing reduce-scatter on the core, each axis folding in at its ``fold_at`` step; ``group(v, s)``: the
    regions ``G(v, s)``'s core ranks end owning (reduced over every rank; ``final``: the avg scale fused into
    it), as runs."""
    L = len(g.steps)
    if L == 0:
        return [Step(scale=Scale(o, c)) for o, c in group(g.me, 0)] if final else []
    out = []
    for s in range(L):
        out += [g.late_fold(a, lambda x, y: group(g.me, s), inward=True) for a, j in g.fold_at.items() if j == s]
        if s >= g.until:
            out.append(Step())
            continue
        comm, peer, q = g.core_step(s)
        out.append(Step(sends=tuple(Send(comm, peer, o, c) for o, c in group(q, s + 1)),
                        recvs=tuple(Recv(comm, peer, o, c, reduce=True, final=final and s == L - 1)
                                    for o, c in group(g.me, s + 1))))
    return out


def _swing_ag(g: _Grid, group, held) -> list:
    """Swing all-gather on the core (the reduce-scatter's steps in reverse order, copying), each axis
    unfolding after its ``fold_at`` step, given that every core rank holds its own regions (``group``: as
    for ``_swing_rs``); ``held(x, y)``: what folded rank ``(x, y)`` holds already."""
    L = len(g.steps)
    out = []
    for s in range(L - 1, -1, -1):
        if s < g.until:
            comm, peer, q = g.core_step(s)
            out.append(Step(sends=tuple(Send(comm, peer, o, c) for o, c in group(g.me, s + 1)),
                            recvs=tuple(Recv(comm, peer, o, c, reduce=False) for o, c in group(q, s + 1))))
        else:
            out.append(Step())
        out += [g.late_fold(a, lambda x, y: _minus(group(g.me, s), held(x, y)), inward=False)
                for a, j in g.fold_at.items() if j == s]
    return out


def _grid(x: int, y: int, X: int, Y: int, row: str, col: str, local: int | None = None) -> _Grid:
    if X == 1 or Y == 1:  # a line: one axis on the world communicator, in rank order
        return _Grid(x + X * y, 0, X * Y, 1, ("world", "world"))
    return _Grid(x, y, X, Y, (row, col), local)


def _chunk_groups(g: _Grid, count: int):
    """group(v, s) of the all-reduce: chunk ``i`` on the core rank at position ``i``, so ``G(v, s)`` is the
    one run of chunks from its first position."""
    pos, lo, _ = g.order()
    ds = displacements(chunks(count, g.cx * g.cy)[0]) + [count]
    L = len(g.steps)

    def group(v: int, s: int) -> tuple:
        first = int(lo[s][v])
        return _runs([(ds[first], ds[first + (1 << (L - s))] - ds[first])])
    return group


def _block_groups(g: _Grid, counts, displs):
    """group(v, s) of reduce-scatter and all-gather: the caller's blocks of every world rank folded into a
    core rank of ``G(v, s)``."""
    _, lo, by_pos = g.order()
    L = len(g.steps)

    def group(v: int, s: int) -> tuple:
        first = int(lo[s][v])
        return _runs([(displs[w], counts[w]) for m in by_pos[first:first + (1 << (L - s))]
                      for w in g.members(int(m) % g.cx, int(m) // g.cx)])
    return group


def allreduce(x: int, y: int, X: int, Y: int, count: int, row: str = "row", col: str = "col",
              local: int | None = None) -> list:
    """Plan of rank ``(x, y)`` of an ``X x Y`` grid (world rank ``x + X*y``; a side of 1: the 1-D Swing on
    "world") for an all-reduce of ``count`` elements at offset 0: the Swing reduce-scatter and all-gather on
    the core, folded axes folding in and out at their first step. ``local``: the axis (0: row, 1: column)
    inside the nodes, whose steps then run first (``_Grid``); None: the axes in turn."""
    g = _grid(x, y, X, Y, row, col, local)
    group = _chunk_groups(g, count)
    return _swing_rs(g, group, final=True) + _swing_ag(g, group, lambda a, b: ())


def allreduce_latency(x: int, y: int, X: int, Y: int, count: int, row: str = "row", col: str = "col",
                      local: int | None = None) -> list:
    """Plan of rank ``(x, y)`` for Swing's latency-optimal all-reduce (the paper's section 3.1 form): at every
    core step a rank and its peer exchange the whole buffer and both reduce it, ``log2 p`` steps of
    ``count`` elements each (against the bandwidth-optimal form's ``2 log2 p`` steps and ``2(p-1)/p`` of the
    buffer). The steps run in the all-gather's order (the last axis step first), so the ranks a rank has
    reached after a step are one of that step's groups: every rank reduces the same tree and the results are
    bitwise identical. Folded ranks hand their buffer to their core partner before the core steps (row, then
    column) and get the result back after them (column, then row). ``local``: as for ``allreduce``."""
    g = _grid(x, y, X, Y, row, col, local)
    L = len(g.steps)
    if L == 0:
        return [Step(scale=Scale(0, count))]
    whole = _runs([(0, count)])

    def everything(a: int, b: int) -> tuple:
        return whole
    out = g.fold_in(everything, everything, reduce=True)
    for i, s in enumerate(range(L - 1, -1, -1)):
        if g.extra_on:
            out.append(Step())
            continue
        comm, peer, _ = g.core_step(s)
        out.append(Step(sends=tuple(Send(comm, peer, o, c) for o, c in whole),
                        recvs=tuple(Recv(comm, peer, o, c, reduce=True, final=i == L - 1) for o, c in whole)))
    return out + g.fold_out(everything, everything)


def _own_and_row(g: _Grid, counts, displs):
    """(own, folded): world rank ``(x, y)``'s block; its block and, when it is a row partner, its row-folded
    rank's (what a column-folded rank stands for after the row fold)."""
    def own(x: int, y: int) -> list:
        return [(displs[x + g.X * y], counts[x + g.X * y])]

    def folded(x: int, y: int) -> list:
        return own(x, y) + (own(x + 1, y) if x < 2 * g.ex else [])
    return own, folded


def reduce_scatter(x: int, y: int, X: int, Y: int, counts, displs, row: str = "row", col: str = "col",
                   local: int | None = None) -> list:
    """Plan of rank ``(x, y)``: block ``w`` (``counts``/``displs`` index world ranks) ends reduced on world
    rank ``w``; the folded ranks' blocks come back in the last steps. ``local``: as for ``allreduce``."""
    g = _grid(x, y, X, Y, row, col, local)
    own, folded = _own_and_row(g, counts, displs)
    return _swing_rs(g, _block_groups(g, counts, displs), final=True) + g.fold_out(own, folded)


def allgather(x: int, y: int, X: int, Y: int, counts, displs, row: str = "row", col: str = "col",
              local: int | None = None) -> list:
    """Plan of rank ``(x, y)``: every rank ends with every block, given that world rank ``w`` holds block
    ``w``; the folded ranks hand theirs in first and get the rest back as their axis unfolds. ``local``: as
    for ``allreduce``."""
    g = _grid(x, y, X, Y, row, col, local)
    own, folded = _own_and_row(g, counts, displs)

    def held(a: int, b: int) -> list:
        return own(a, b) if _core_index(a, g.ex) is None else folded(a, b)
    return g.fold_in(own, folded, reduce=False) + _swing_ag(g, _block_groups(g, counts, displs), held)


def folded(X: int, Y: int) -> tuple:
    """The world ranks of an ``X x Y`` grid that fold into another (not on the power-of-two core)."""
    g = _grid(0, 0, X, Y, "row", "col")
    return tuple(x + g.X * y for y in range(g.Y) for x in range(g.X)
                 if _core_index(x, g.ex) is None or _core_index(y, g.ey) is None)
