"""How a count of elements splits into chunks (one per rank) and segments (the pipelining unit).

Vocabulary used everywhere in torus: a *chunk* is the part of a buffer one rank owns in a schedule (there are
exactly ``size`` chunks, some possibly empty); a *segment* is the unit one message carries, so that the next
segment's transfer overlaps this one's reduction. Counts and displacements are in elements, never bytes.
"""
from __future__ import annotations


def chunks(count: int, parts: int) -> tuple[list[int], list[int]]:
    """Split ``count`` elements into ``parts`` contiguous chunks as evenly as possible.

    Returns ``(counts, displs)``: the first ``count % parts`` chunks hold one element more. Works for any
    ``count >= 0`` including 0 and ``count < parts`` (trailing chunks are then empty).
    """
    base, extra = divmod(count, parts)
    counts = [base + (1 if i < extra else 0) for i in range(parts)]
    return counts, displacements(counts)


def displacements(counts) -> list[int]:
    """Exclusive prefix sum: where each chunk starts."""
    displs, total = [], 0
    for c in counts:
        displs.append(total)
        total += c
    return displs


def segments(offset: int, count: int, seg_count: int):
    """Yield ``(offset, count)`` pieces of at most ``seg_count`` elements covering ``[offset, offset+count)``."""
    end = offset + count
    while offset < end:
        n = min(seg_count, end - offset)
        yield offset, n
        offset += n
