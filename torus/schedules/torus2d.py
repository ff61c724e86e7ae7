"""2D-torus all-reduce, reduce-scatter and all-gather (Mikami et al. 2018, "Massively Distributed SGD:
ImageNet/ResNet-50 Training in a Flash", arXiv:1811.05233, section 3.2 and figure 3).

``N = X * Y`` ranks form a periodic grid; rank ``r`` sits at column ``x = r % X`` of row ``y = r // X``.
All-reduce: (1) reduce-scatter along the row (X ranks), so each rank holds the row-sum of 1/X of the
buffer; (2) all-reduce of that 1/X along the column (Y ranks; the X column rings run at once); (3) all-gather
along the row. Steps on the critical path: ``2(X-1) + 2(Y-1)`` against a ring's ``2(N-1)``; bytes each rank
sends: ``2(N-1)/N * M``, the same as the ring (Mikami et al., eq. in section 3.2). Remainders (a count not
divisible by X or Y) are exact: chunks differ by at most one element and nothing is padded.

Reduce-scatter and all-gather use the same grid: block ``r`` of a reduce-scatter is reduced along the column
over the row segment (the X blocks of row ``y``) and then along the row; all-gather runs the reverse. Both take
``(X-1) + (Y-1)`` steps and send ``(N-1)/N * M`` bytes per rank.

The comm names default to the row/column communicators; the hierarchical schedule reuses these plans with
the node-local and cross-node communicators in their place.
"""
from __future__ import annotations

from dataclasses import dataclass

from torus.partition import chunks
from torus.schedules import ring


@dataclass(frozen=True)
class Phase:
    """One ring phase of a 2D-torus call: ``collective`` ("reduce_scatter", "allreduce" or "allgather") over
    the ``comm`` communicator, this rank at position ``index`` of ``size``, on blocks ``counts`` at offsets
    ``displs`` (in position order, contiguous; an all-reduce: its one region, ``counts == (count,)``);
    ``final`` as in ring.py. ``steps()`` lowers it to the ring's plan; phases.py lowers the phase within the
    nodes to the shared-memory transport instead."""
    collective: str
    comm: str
    index: int
    size: int
    counts: tuple
    displs: tuple
    final: bool = False

    @property
    def span(self) -> tuple:
        """``(lo, hi)``: the elements of every block."""
        return (self.displs[0], self.displs[-1] + self.counts[-1]) if self.counts else (0, 0)

    @property
    def own(self) -> tuple:
        """``(lo, hi)``: this rank's block (an all-reduce: the whole region)."""
        if self.collective == "allreduce":
            return self.span
        lo = self.displs[self.index]
        return (lo, lo + self.counts[self.index])

    @property
    def inp(self) -> tuple:
        """What the phase reads: this rank's block for an all-gather, every block otherwise."""
        return self.own if self.collective == "allgather" else self.span

    @property
    def out(self) -> tuple:
        """What it leaves complete on this rank: its block after a reduce-scatter, every block otherwise."""
        return self.own if self.collective == "reduce_scatter" else self.span

    def steps(self) -> list:
        if self.collective == "allreduce":
            return ring.allreduce(self.comm, self.index, self.size, self.counts[0], base=self.displs[0],
                                  final=self.final)
        if self.collective == "reduce_scatter":
            return ring.reduce_scatter(self.comm, self.index, self.size, self.counts, self.displs,
                                       final=self.final)
        return ring.allgather(self.comm, self.index, self.size, self.counts, self.displs)


def lower(phases) -> list:
    """The plan of ``phases``: their steps in order."""
    return [st for p in phases for st in p.steps()]


def allreduce_phases(x: int, y: int, X: int, Y: int, count: int, row: str = "row", col: str = "col") -> tuple:
    """Reduce-scatter along the row, all-reduce of this rank's chunk along the column, all-gather along the
    row."""
    cs, ds = (tuple(v) for v in chunks(count, X))
    return (Phase("reduce_scatter", row, x, X, cs, ds, final=Y == 1),
            Phase("allreduce", col, y, Y, (cs[x],), (ds[x],), final=Y > 1),
            Phase("allgather", row, x, X, cs, ds))


def allreduce(x: int, y: int, X: int, Y: int, count: int, row: str = "row", col: str = "col"):
    return lower(allreduce_phases(x, y, X, Y, count, row, col))


def row_segments(X: int, Y: int, counts, displs):
    """Row ``j``'s blocks (world ranks ``j*X .. j*X + X - 1``) as one segment: ``(counts, displs)``."""
    seg_counts = [sum(counts[j * X:(j + 1) * X]) for j in range(Y)]
    seg_displs = [displs[j * X] for j in range(Y)]
    return seg_counts, seg_displs


def block_phases(collective: str, x: int, y: int, X: int, Y: int, counts, displs, row: str = "row",
                 col: str = "col") -> tuple:
    """Reduce-scatter: along the column over the row segments, then along the row over row ``y``'s blocks;
    all-gather: the same phases in reverse order."""
    sc, sd = (tuple(v) for v in row_segments(X, Y, counts, displs))
    mine = slice(y * X, (y + 1) * X)
    rc, rd = tuple(counts[mine]), tuple(displs[mine])
    if collective == "reduce_scatter":
        return (Phase("reduce_scatter", col, y, Y, sc, sd, final=X == 1),
                Phase("reduce_scatter", row, x, X, rc, rd, final=X > 1))
    return (Phase("allgather", row, x, X, rc, rd), Phase("allgather", col, y, Y, sc, sd))


def reduce_scatter(x: int, y: int, X: int, Y: int, counts, displs, row: str = "row", col: str = "col"):
    """Block ``y*X + x`` (``counts``/``displs`` index world ranks) ends reduced on rank ``(x, y)``."""
    return lower(block_phases("reduce_scatter", x, y, X, Y, counts, displs, row, col))


def allgather(x: int, y: int, X: int, Y: int, counts, displs, row: str = "row", col: str = "col"):
    """Every rank ends with every block, given that rank ``(x, y)`` holds block ``y*X + x``."""
    return lower(block_phases("allgather", x, y, X, Y, counts, displs, row, col))
