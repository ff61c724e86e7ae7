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

from torus.partition import chunks
from torus.schedules import ring


def allreduce(x: int, y: int, X: int, Y: int, count: int, row: str = "row", col: str = "col"):
    row_counts, row_displs = chunks(count, X)
    return (ring.reduce_scatter(row, x, X, row_counts, row_displs, final=Y == 1)
            + ring.allreduce(col, y, Y, row_counts[x], base=row_displs[x], final=Y > 1)
            + ring.allgather(row, x, X, row_counts, row_displs))


def row_segments(X: int, Y: int, counts, displs):
    """Row ``j``'s blocks (world ranks ``j*X .. j*X + X - 1``) as one segment: ``(counts, displs)``."""
    seg_counts = [sum(counts[j * X:(j + 1) * X]) for j in range(Y)]
    seg_displs = [displs[j * X] for j in range(Y)]
    return seg_counts, seg_displs


def reduce_scatter(x: int, y: int, X: int, Y: int, counts, displs, row: str = "row", col: str = "col"):
    """Block ``y*X + x`` (``counts``/``displs`` index world ranks) ends reduced on rank ``(x, y)``."""
    seg_counts, seg_displs = row_segments(X, Y, counts, displs)
    mine = slice(y * X, (y + 1) * X)
    return (ring.reduce_scatter(col, y, Y, seg_counts, seg_displs, final=X == 1)
            + ring.reduce_scatter(row, x, X, counts[mine], displs[mine], final=X > 1))


def allgather(x: int, y: int, X: int, Y: int, counts, displs, row: str = "row", col: str = "col"):
    """Every rank ends with every block, given that rank ``(x, y)`` holds block ``y*X + x``."""
    seg_counts, seg_displs = row_segments(X, Y, counts, displs)
    mine = slice(y * X, (y + 1) * X)
    return (ring.allgather(row, x, X, counts[mine], displs[mine])
            + ring.allgather(col, y, Y, seg_counts, seg_displs))
