"""Closed forms for the symmetric cases, the yardstick for the simulator (tests) and for ``--paper``.

``M`` bytes in all (all-reduce: the buffer; reduce-scatter: the input; all-gather: the output), ``N = X*Y`` ranks,
``L`` ranks per node and ``C = N/L`` nodes; sizes divisible by every partition in use, single-port ranks.

Steps and bytes:
- ring (Patarasuk & Yuan 2009, JPDC 69(2), section 3; Thakur et al. 2005, IJHPCA 19(1), section 4.4):
  all-reduce ``2(N-1)`` steps, ``2(N-1)/N·M`` sent and ``(N-1)/N·M`` reduced per rank; reduce-scatter and
  all-gather ``N-1`` steps, ``(N-1)/N·M`` sent.
- 2D-torus (Mikami et al. 2018, arXiv:1811.05233, section 3.2): all-reduce ``2(X-1) + 2(Y-1)`` steps, bytes as
  the ring; the column phase moves ``M/X`` per rank and is the only phase that leaves the node when ``X = L``.
- hierarchical (ibid., section 3.2): the leaders' ring moves the whole ``M`` across nodes (``2(C-1)/C·M`` per
  leader) after a node-local reduce-scatter and gather to the leader; ``2(L-1) + 2 + 2(C-1)`` steps.
- swing (De Sensi et al., NSDI'24, section 3; torus/schedules/swing.py): on a power-of-two core of ``P``
  ranks (``2**k`` per axis, the rest folded in), ``log2 P`` steps per reduce-scatter or all-gather, halving
  the data each step; a folded axis adds a step before and one after. Summed over ranks, the all-reduce and
  the all-gather send what the ring sends (the folds add ``2M`` per folded rank and the core saves as much);
  the reduce-scatter sends the folded ranks' blocks once more (handed back). The folds' partners send most.
- swing_latency (ibid., section 3.1): ``log2 P`` core steps of the whole ``M`` (sent and reduced), per folded
  axis a step in and one out (``swing_latency_bytes``); its reduce-scatter and all-gather are swing's.

Time (α-β-γ, one level unless stated): ring all-reduce ``2(N-1)(α + β·M/N) + (N-1)·γ·M/N``; 2D-torus all-reduce
``2(X-1)(α + β·M/X) + (X-1)γM/X + 2(Y-1)(α + β·M/N) + (Y-1)γM/N`` (row and column levels may use different α/β);
hierarchical all-reduce with intra (αi, βi) and inter (αe, βe) levels: ``(L-1)(αi + (βi+γ)M/L) + 2(αi + (L-1)βi·M/L)
+ 2(C-1)(αe + βe·M/C) + (C-1)γM/C + (L-1)(αi + βi·M/L)`` (the gather and the scatter each push ``L-1`` chunks
through the leader's one port). swing_latency: per core step ``α + (β+γ)M`` at its axis' level, per folded axis ``2α
+ (2β+γ)M``. Swing all-reduce: per core step ``s`` (of ``log2 P``) ``α + (β+γ)M/2**(s+1)`` and ``α + βM/2**(s+1)``
at the level of that step's axis, and a folded axis ``α + (β+γ)M/2**j`` in and ``α + βM/2**j`` out at its first step
``j`` (the axes alternate from an unfolded one where there is one: ``j = 1`` for a grid with one folded axis, ``j =
0`` on a line; where the rows are the nodes, ``X = L``, every row step runs first, as TorusComm runs it, and a
folded row folds at ``j = 0``).
"""
from __future__ import annotations


def _swing_axes(X: int, Y: int) -> list:
    """Per axis of the Swing grid (a line when a side is 1): (log2 of its core, folded or not)."""
    sizes = [X * Y] if X == 1 or Y == 1 else [X, Y]
    return [(n.bit_length() - 1, n & (n - 1) != 0) for n in sizes]


def steps(algorithm: str, collective: str, N: int, X: int = 1, Y: int = 1, L: int = 1) -> int:
    """Messages in sequence on the critical path: the registry entry's ``steps`` (torus/schedules/registry.py)."""
    return _entry(algorithm, "steps")(collective, N, X, Y, L)


def ring_steps(collective: str, N: int, X: int, Y: int, L: int) -> int:
    return (2 if collective == "allreduce" else 1) * (N - 1)


def torus2d_steps(collective: str, N: int, X: int, Y: int, L: int) -> int:
    return (2 if collective == "allreduce" else 1) * ((X - 1) + (Y - 1))


def hierarchical_steps(collective: str, N: int, X: int, Y: int, L: int) -> int:
    if collective == "allreduce":
        return 2 * (L - 1) + 2 * (L > 1) + 2 * (N // L - 1)
    return torus2d_steps(collective, N, L, N // L, L)  # the 2D torus on the local x cross grid


def swing_steps(collective: str, N: int, X: int, Y: int, L: int, rounds: int | None = None) -> int:
    axes = _swing_axes(X, Y)
    core = sum(k for k, _ in axes)
    rounds = (2 if collective == "allreduce" else 1) if rounds is None else rounds
    return rounds * core + 2 * sum(f for _, f in axes)


def swing_latency_steps(collective: str, N: int, X: int, Y: int, L: int) -> int:
    return swing_steps(collective, N, X, Y, L, rounds=1)  # the whole buffer once per core step


def _entry(algorithm: str, form: str):
    from torus.schedules import registry  # not at import: the registry loads this module's forms
    f = getattr(registry.get(algorithm), form)
    if f is None:
        raise ValueError(f"{algorithm}: no closed form for its {form}")
    return f


def sent_per_rank(collective: str, N: int, M: float, folded_bytes: float = 0.0) -> float:
    """Bytes each rank sends in the ring and 2D-torus schedules (the same for both), and on average in
    Swing's, whose reduce-scatter also hands back ``folded_bytes`` (the folded ranks' blocks) once."""
    return (2 if collective == "allreduce" else 1) * (N - 1) / N * M + \
        (folded_bytes / N if collective == "reduce_scatter" else 0.0)


def swing_latency_bytes(N: int, X: int, Y: int, M: float) -> tuple[float, float]:
    """(bytes sent, bytes reduced) per rank on average in the latency-optimal Swing all-reduce of ``M``
    bytes: ``P`` core ranks send and reduce ``M`` at each of ``log2 P`` steps, and each of the ``N - P``
    folded ranks sends ``M`` to its partner (reduced there) and receives ``M`` back."""
    axes = _swing_axes(X, Y)
    P = 1 << sum(k for k, _ in axes)
    k = sum(k for k, _ in axes)
    return (P * k * M + 2 * (N - P) * M) / N, (P * k * M + (N - P) * M) / N


def inter_node_per_rank(algorithm: str, N: int, X: int, L: int, M: float) -> float:
    """All-reduce bytes the busiest rank sends to other nodes: hierarchical ``2(C-1)/C·M`` (a leader);
    2D-torus with rows inside nodes (``X = L``) ``2(Y-1)/Y·M/X``; ring ``2(N-1)/N·M`` (each node's last rank)."""
    C, Y = N // L, N // X
    if algorithm == "hierarchical":
        return 2 * (C - 1) / C * M
    if algorithm == "torus2d":
        if X != L:
            raise ValueError("closed form for rows that are exactly the nodes (X = ranks per node)")
        return 2 * (Y - 1) / Y * M / X
    return 2 * (N - 1) / N * M


def time(algorithm: str, collective: str, M: float, alpha: float, beta: float, gamma: float, N: int,
         X: int = 1, Y: int = 1, L: int = 1, inter_alpha: float | None = None,
         inter_beta: float | None = None) -> float:
    """Seconds for the symmetric case: the registry entry's ``time``. ``inter_*`` price the column (torus2d with
    ``X = L``) or the cross (hierarchical) level; ring uses one level."""
    ae = alpha if inter_alpha is None else inter_alpha
    be = beta if inter_beta is None else inter_beta
    return _entry(algorithm, "time")(collective, M, alpha, beta, gamma, N, X, Y, L, ae, be)


def _ring(p, m, a, b, gamma, reduce=True, gather=True):  # one ring pass over m bytes on p ranks
    return ((p - 1) * (a + (b + gamma) * m / p) if reduce else 0.0) + \
           ((p - 1) * (a + b * m / p) if gather else 0.0)


def _halves(collective: str) -> tuple[bool, bool]:
    """(reduce, gather): which halves of an all-reduce ``collective`` runs."""
    return collective in ("allreduce", "reduce_scatter"), collective in ("allreduce", "allgather")


def ring_time(collective, M, alpha, beta, gamma, N, X, Y, L, ae, be) -> float:
    return _ring(N, M, alpha, beta, gamma, *_halves(collective))


def torus2d_time(collective, M, alpha, beta, gamma, N, X, Y, L, ae, be) -> float:
    rs, ag = _halves(collective)
    if collective == "allreduce":
        return _ring(X, M, alpha, beta, gamma) + _ring(Y, M / X, ae, be, gamma)
    # reduce-scatter: column phase on row segments (M/Y each) first, then the row; all-gather the reverse
    return _ring(Y, M, ae, be, gamma, rs, ag) + _ring(X, M / Y, alpha, beta, gamma, rs, ag)


def hierarchical_time(collective, M, alpha, beta, gamma, N, X, Y, L, ae, be) -> float:
    if collective != "allreduce":  # the 2D torus on the local x cross grid
        return torus2d_time(collective, M, alpha, beta, gamma, N, L, N // L, L, ae, be)
    C = N // L
    funnel = (alpha + (L - 1) * beta * M / L) if L > 1 else 0.0
    return _ring(L, M, alpha, beta, gamma, True, False) + 2 * funnel + _ring(C, M, ae, be, gamma) + \
        _ring(L, M, alpha, beta, gamma, False, True)


def _swing_levels(X: int, Y: int, alpha, beta, ae, be) -> list:
    line = X == 1 or Y == 1
    return [(ae, be) if X == 1 else (alpha, beta)] if line else [(alpha, beta), (ae, be)]


def swing_latency_time(collective, M, alpha, beta, gamma, N, X, Y, L, ae, be) -> float:
    if collective != "allreduce":  # its reduce-scatter and all-gather are swing's
        return swing_time(collective, M, alpha, beta, gamma, N, X, Y, L, ae, be)
    levels = _swing_levels(X, Y, alpha, beta, ae, be)
    return sum(k * (a + (b + gamma) * M) + f * (2 * a + (2 * b + gamma) * M)
               for (k, f), (a, b) in zip(_swing_axes(X, Y), levels))


def swing_time(collective, M, alpha, beta, gamma, N, X, Y, L, ae, be) -> float:
    if collective != "allreduce":
        raise ValueError("swing: closed form for the all-reduce only (a reduce-scatter's or all-gather's "
                         "groups of blocks may be several messages per step)")
    levels = _swing_levels(X, Y, alpha, beta, ae, be)
    axes = _swing_axes(X, Y)
    first = 1 if len(axes) == 2 and axes[0][1] and not axes[1][1] and axes[1][0] else 0
    ks = [k for k, _ in axes]
    order = [a for k in range(max(ks)) for a in ((first, 1 - first) if len(axes) == 2 else (0,)) if k < ks[a]]
    if len(axes) == 2 and L == X:  # the rows are the nodes: their steps first
        order = [0] * ks[0] + [1] * ks[1]
    t = 0.0
    for s, a in enumerate(order):
        m = M / 2 ** s  # what each rank holds before step s
        if axes[a][1] and order.index(a) == s:  # the axis folds in and, mirrored, out here
            t += 2 * levels[a][0] + (2 * levels[a][1] + gamma) * m
        t += 2 * levels[a][0] + (2 * levels[a][1] + gamma) * m / 2
    return t
