"""Swing all-reduce, reduce-scatter and all-gather, bandwidth-optimal form (De Sensi et al., NSDI'24, "Swing:
Short-cutting Rings for Higher Bandwidth Allreduce", arXiv:2401.09356: the peers ``pi(r, s)`` and ``rho`` of the
1-D power-of-two case, its bandwidth-optimal reduce-scatter + all-gather, and the multidimensional form that
visits the dimensions in turn).

Vocabulary. On a line of ``n = 2**L`` ranks, step ``s`` pairs rank ``r`` with ``r + rho(s)`` when ``r`` is
even and ``r - rho(s)`` when odd (mod ``n``), ``rho(s) = sum_{i=0..s} (-2)**i`` = 1, -1, 3, -5, 11, ...:
distances that grow as the data halves, so the largest messages travel the shortest distances. On an
``X x Y`` grid the steps alternate between the row (``x``'s parity and distance) and the column until both
axes have run their ``log2`` steps. A *group* ``G(r, s)`` is the set of ranks ``r`` still reaches in steps
``s, s+1, ...``; the groups of one step partition the ranks, and ``G(r, s)`` is ``G(r, s+1)`` joined with
``G(peer, s+1)``. Reduce-scatter: at step ``s`` rank ``r`` sends the peer the data of ``G(peer, s+1)`` and
reduces what the peer sends of ``G(r, s+1)`` (``L`` steps; half, then a quarter ... of the buffer: ``(n-1)/n``
of it in all). All-gather runs the same steps in reverse order, copying. All-reduce is the two in sequence:
``2 log2 n`` steps, ``2(n-1)/n`` of the buffer sent per rank, as the ring.

Layout. A reduce-scatter's and an all-gather's blocks are the caller's (block ``w`` on world rank ``w``), so a
group's blocks may be several runs of the buffer: one message per run. The all-reduce chooses its own chunk
layout: chunk ``i`` of ``chunks(count, n)`` belongs to the rank at position ``i`` of an order in which every
group is contiguous (``_order``), so each of its steps is one message.

Any rank count (the paper handles it inside the schedule; this module folds instead, which is simpler and
exactly correct): along an axis of ``n = 2**k + e`` ranks (``0 < e < 2**k``), each odd coordinate ``c < 2e``
first hands its data to ``c - 1`` (one step: the whole buffer for reduce-scatter and all-reduce, its own block
for all-gather), the ``2**k`` remaining coordinates run Swing, and ``c - 1`` hands the result back (the whole
buffer, or the folded rank's blocks). On a grid the row folds first, then the column among the row's remaining
ranks. Cost against a power of two: two more steps per folded axis, on the critical path (all-reduce:
``α + (β+γ)M`` in and ``α + βM`` out, sim/closed_form.py); a partner ``c - 1`` receives and sends the whole
``M`` once more each on top of the core's ``2(2**k - 1)/2**k M``, and the folded ranks idle in between.

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
def _steps(cx: int, cy: int) -> tuple:
    """The axis (0: row, 1: column) and axis step of every Swing step on a ``cx x cy`` core, alternating."""
    lx, ly = cx.bit_length() - 1, cy.bit_length() - 1
    out = []
    for k in range(max(lx, ly)):
        out += [(0, k)] * (k < lx) + [(1, k)] * (k < ly)
    return tuple(out)


def _peer(kx: int, ky: int, cx: int, cy: int, step: tuple) -> tuple[int, int]:
    axis, k = step
    if axis == 0:
        return (kx + rho(k) if kx % 2 == 0 else kx - rho(k)) % cx, ky
    return kx, (ky + rho(k) if ky % 2 == 0 else ky - rho(k)) % cy


@lru_cache(maxsize=16)
def _order(cx: int, cy: int) -> tuple:
    """``(pos, lo, by_pos)`` on a ``cx x cy`` core, core ranks numbered ``kx + cx * ky``: ``pos[v]``, an
    order of the ranks in which every group is contiguous; ``lo[s][v]``, the first position of ``G(v, s)``
    (which holds ``2**(L - s)`` ranks); ``by_pos``, the ranks in that order. Built bottom-up: each group's
    label is its least member; at step ``s`` the half whose label is larger goes second (bit ``L-1-s`` of
    the position)."""
    steps = _steps(cx, cy)
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


def _without(whole: tuple, regions) -> tuple:
    """``whole`` (offset, count) minus ``regions``, as runs."""
    out, at, end = [], whole[0], whole[0] + whole[1]
    for o, c in _runs(regions):
        out.append((at, o - at))
        at = o + c
    out.append((at, end - at))
    return _runs(out)


class _Grid:
    """One rank's place on an ``X x Y`` grid (a line: ``Y == 1`` on "world") and its fold onto the
    ``cx x cy`` core. Coordinates are ``(x, y)``; world rank ``x + X * y``."""

    def __init__(self, x: int, y: int, X: int, Y: int, comms: tuple):
        self.x, self.y, self.X, self.Y, self.comms = x, y, X, Y, comms
        (self.cx, self.ex), (self.cy, self.ey) = _core(X), _core(Y)
        self.kx, self.ky = _core_index(x, self.ex), _core_index(y, self.ey)
        self.steps = _steps(self.cx, self.cy)
        # this rank's index on the core (kx + cx * ky), or -1 when it is folded into another
        self.me = -1 if self.kx is None or self.ky is None else self.kx + self.cx * self.ky

    @property
    def core(self) -> bool:
        return self.me >= 0

    def world_of(self, kx: int, ky: int) -> tuple[int, int]:
        return _coord(kx, self.ex), _coord(ky, self.ey)

    def members(self, kx: int, ky: int) -> list:
        """World ranks folded into core rank ``(kx, ky)`` (itself first)."""
        x, y = self.world_of(kx, ky)
        xs = [x] + [x + 1] * (x < 2 * self.ex)
        ys = [y] + [y + 1] * (y < 2 * self.ey)
        return [a + self.X * b for b in ys for a in xs]

    def core_step(self, s: int):
        """(comm, peer index in it, the peer's core coordinates) of this core rank's Swing step ``s``."""
        axis = self.steps[s][0]
        qx, qy = _peer(self.me % self.cx, self.me // self.cx, self.cx, self.cy, self.steps[s])
        wx, wy = self.world_of(qx, qy)
        return self.comms[axis], (wx, wy)[axis], (qx, qy)

    def fold_in(self, regions_x, regions_y, reduce: bool) -> list:
        """The fold steps before Swing: the row's folded ranks send ``regions_x(x, y)`` (what world rank
        ``(x, y)`` hands on) to ``x - 1``, then the column's send ``regions_y(x, y)`` to ``y - 1``; the
        receivers reduce them (``reduce``) or copy them."""
        return self._fold(regions_x, regions_y, False, reduce)

    def fold_out(self, regions_x, regions_y) -> list:
        """The steps after Swing that hand results back (copied): column first, then row
        (``regions_*(x, y)``: what the folded world rank ``(x, y)`` receives)."""
        return self._fold(regions_x, regions_y, True, False)

    def _fold(self, regions_x, regions_y, out: bool, reduce: bool) -> list:
        x, y = self.x, self.y
        steps = []
        if self.ex:  # the row: (x odd < 2e) <-> (x - 1)
            st = Step()
            if self.kx is None:
                st = _one_way(self.comms[0], x - 1, regions_x(x, y), send=not out, reduce=reduce)
            elif x < 2 * self.ex:
                st = _one_way(self.comms[0], x + 1, regions_x(x + 1, y), send=out, reduce=reduce)
            steps.append(st)
        if self.ey:  # the column, among the row's core coordinates
            st = Step()
            if self.kx is not None and self.ky is None:
                st = _one_way(self.comms[1], y - 1, regions_y(x, y), send=not out, reduce=reduce)
            elif self.kx is not None and y < 2 * self.ey:
                st = _one_way(self.comms[1], y + 1, regions_y(x, y + 1), send=out, reduce=reduce)
            steps.append(st)
        return steps[::-1] if out else steps


def _one_way(comm: str, peer: int, regions, send: bool, reduce: bool) -> Step:
    runs = _runs(regions)
    if send:
        return Step(sends=tuple(Send(comm, peer, o, c) for o, c in runs))
    return Step(recvs=tuple(Recv(comm, peer, o, c, reduce=reduce) for o, c in runs))


def _swing_rs(g: _Grid, group, final: bool) -> list:
    """Swing reduce-scatter among the core ranks; ``group(v, s)``: the regions ``G(v, s)``'s core ranks end
    owning (reduced over every rank; ``final``: the avg scale fused into it), as runs."""
    L = len(g.steps)
    if not g.core:
        return [Step()] * L
    me = g.me
    if L == 0:
        return [Step(scale=Scale(o, c)) for o, c in group(me, 0)] if final else []
    out = []
    for s in range(L):
        comm, peer, (qx, qy) = g.core_step(s)
        out.append(Step(sends=tuple(Send(comm, peer, o, c) for o, c in group(qx + g.cx * qy, s + 1)),
                        recvs=tuple(Recv(comm, peer, o, c, reduce=True, final=final and s == L - 1)
                                    for o, c in group(me, s + 1))))
    return out


def _swing_ag(g: _Grid, group) -> list:
    """Swing all-gather among the core ranks (the reduce-scatter's steps in reverse order, copying), given
    that every core rank holds its own regions (``group``: as for ``_swing_rs``)."""
    L = len(g.steps)
    if not g.core:
        return [Step()] * L
    me = g.me
    out = []
    for s in range(L - 1, -1, -1):
        comm, peer, (qx, qy) = g.core_step(s)
        out.append(Step(sends=tuple(Send(comm, peer, o, c) for o, c in group(me, s + 1)),
                        recvs=tuple(Recv(comm, peer, o, c, reduce=False)
                                    for o, c in group(qx + g.cx * qy, s + 1))))
    return out


def _grid(x: int, y: int, X: int, Y: int, row: str, col: str) -> _Grid:
    if X == 1 or Y == 1:  # a line: one axis on the world communicator, in rank order
        return _Grid(x + X * y, 0, X * Y, 1, ("world", "world"))
    return _Grid(x, y, X, Y, (row, col))


def _chunk_groups(g: _Grid, count: int):
    """group(v, s) of the all-reduce: chunk ``i`` on the core rank at position ``i``, so ``G(v, s)`` is the
    one run of chunks from its first position."""
    pos, lo, _ = _order(g.cx, g.cy)
    ds = displacements(chunks(count, g.cx * g.cy)[0]) + [count]
    L = len(g.steps)

    def group(v: int, s: int) -> tuple:
        first = int(lo[s][v])
        return _runs([(ds[first], ds[first + (1 << (L - s))] - ds[first])])
    return group


def _block_groups(g: _Grid, counts, displs):
    """group(v, s) of reduce-scatter and all-gather: the caller's blocks of every world rank folded into a
    core rank of ``G(v, s)``."""
    _, lo, by_pos = _order(g.cx, g.cy)
    L = len(g.steps)

    def group(v: int, s: int) -> tuple:
        first = int(lo[s][v])
        return _runs([(displs[w], counts[w]) for m in by_pos[first:first + (1 << (L - s))]
                      for w in g.members(int(m) % g.cx, int(m) // g.cx)])
    return group


def allreduce(x: int, y: int, X: int, Y: int, count: int, row: str = "row", col: str = "col") -> list:
    """Plan of rank ``(x, y)`` of an ``X x Y`` grid (world rank ``x + X*y``; a side of 1: the 1-D Swing on
    "world") for an all-reduce of ``count`` elements at offset 0: fold, ``2 log2`` steps of Swing on the
    core, unfold."""
    g = _grid(x, y, X, Y, row, col)
    whole = lambda a, b: ((0, count),)  # noqa: E731
    group = _chunk_groups(g, count)
    return (g.fold_in(whole, whole, reduce=True) + _swing_rs(g, group, final=True) + _swing_ag(g, group)
            + g.fold_out(whole, whole))


def _own_and_row(g: _Grid, counts, displs):
    """(own, folded): world rank ``(x, y)``'s block; its block and, when it is a row partner, its row-folded
    rank's (what a column-folded rank stands for after the row fold)."""
    def own(x: int, y: int) -> list:
        return [(displs[x + g.X * y], counts[x + g.X * y])]

    def folded(x: int, y: int) -> list:
        return own(x, y) + (own(x + 1, y) if x < 2 * g.ex else [])
    return own, folded


def reduce_scatter(x: int, y: int, X: int, Y: int, counts, displs, row: str = "row", col: str = "col") -> list:
    """Plan of rank ``(x, y)``: block ``w`` (``counts``/``displs`` index world ranks) ends reduced on world
    rank ``w``; the folded ranks' blocks come back in the last steps."""
    g = _grid(x, y, X, Y, row, col)
    whole = lambda a, b: ((0, sum(counts)),)  # noqa: E731
    own, folded = _own_and_row(g, counts, displs)
    return (g.fold_in(whole, whole, reduce=True) + _swing_rs(g, _block_groups(g, counts, displs), final=True)
            + g.fold_out(own, folded))


def allgather(x: int, y: int, X: int, Y: int, counts, displs, row: str = "row", col: str = "col") -> list:
    """Plan of rank ``(x, y)``: every rank ends with every block, given that world rank ``w`` holds block
    ``w``; the folded ranks hand theirs in first and get the rest back last."""
    g = _grid(x, y, X, Y, row, col)
    whole = (0, sum(counts))
    own, folded = _own_and_row(g, counts, displs)
    return (g.fold_in(own, folded, reduce=False) + _swing_ag(g, _block_groups(g, counts, displs))
            + g.fold_out(lambda a, b: _without(whole, own(a, b)), lambda a, b: _without(whole, folded(a, b))))


def folded(X: int, Y: int) -> tuple:
    """The world ranks of an ``X x Y`` grid that fold into another (not on the power-of-two core)."""
    g = _grid(0, 0, X, Y, "row", "col")
    return tuple(x + g.X * y for y in range(g.Y) for x in range(g.X)
                 if _core_index(x, g.ex) is None or _core_index(y, g.ey) is None)
