"""``torus-sim --paper``: the ring / hierarchical / 2D-torus comparison of Mikami et al. 2018 (arXiv:1811.05233,
section 3.2) at 1,088 and 2,176 ranks, 4 per node (ABCI: 4 V100 per node), simulated next to the closed forms.

The paper counts steps ``2(N-1)`` for the ring against ``2(X-1) + 2(Y-1)`` for the 2D-torus, and the data a
rank moves between nodes: the hierarchical all-reduce's leaders all-reduce the whole ``M`` across nodes, the
2D-torus's column all-reduce only ``M/X``. The grid of the 2,176-rank run is taken as 32x68 (X = 32 along the
row), 1,088 as 16x68; the text could not be checked here, so the grid is an assumption. A grid whose rows are
the nodes (4x272, 4x544) is simulated as well: only there is the column phase the whole inter-node traffic,
as the ``M/X`` statement assumes.

The closed-form time next to the simulated one prices a ring level that leaves the node anywhere at the
inter-node α/β (every step waits for the slowest link): the ring, the cross ring of the hierarchical schedule,
the 2D-torus column, and its row too when the row spans several nodes (X > 4).
"""
from __future__ import annotations

from torus.sim import closed_form
from torus.sim.model import ITEMSIZE, Cost, Layout
from torus.sim.simulate import simulate

GRIDS = ((16, 68), (4, 272), (32, 68), (4, 544))
RANKS_PER_NODE = 4
RESNET50_NBYTES = 25_557_032 * 4  # float32 gradients of ResNet-50 (torchvision/Keras parameter count)


def rows(nbytes: int = RESNET50_NBYTES, cost: Cost = Cost(), dtype: str = "float32"):
    """One dict per (grid, algorithm): simulated and closed-form steps, inter-node bytes and time (seconds);
    the plain plans (``shm_phases=False``), which the paper's closed forms describe."""
    count = nbytes // ITEMSIZE[dtype]
    M = count * ITEMSIZE[dtype]
    out = []
    for X, Y in GRIDS:
        layout = Layout(X, Y, RANKS_PER_NODE)
        N, C = layout.N, layout.nodes
        for algo in ("ring", "hierarchical", "torus2d"):
            r = simulate(algo, "allreduce", layout, count, dtype, cost, shm_phases=False)
            ae = cost.alpha if cost.inter_alpha is None else cost.inter_alpha
            be = cost.beta if cost.inter_beta is None else cost.inter_beta
            if algo == "ring" or (algo == "torus2d" and X > RANKS_PER_NODE):
                t_closed = closed_form.time(algo, "allreduce", M, ae, be, cost.gamma, N, X, Y)
            else:
                t_closed = closed_form.time(algo, "allreduce", M, cost.alpha, cost.beta, cost.gamma, N, X, Y,
                                            RANKS_PER_NODE, ae, be)
            payload = {"ring": M, "hierarchical": M, "torus2d": M / X}[algo]
            cf_inter = (closed_form.inter_node_per_rank(algo, N, X, RANKS_PER_NODE, M)
                        if algo != "torus2d" or X == RANKS_PER_NODE else None)
            out.append({"ranks": N, "grid": f"{X}x{Y}", "nodes": C, "algorithm": algo, "steps": r.steps,
                        "steps_closed": closed_form.steps(algo, "allreduce", N, X, Y, RANKS_PER_NODE),
                        "payload_closed": payload, "inter_rank_max": r.inter_rank_max,
                        "inter_rank_closed": cf_inter, "inter_node_max": r.inter_node_max, "time": r.time,
                        "time_closed": t_closed, "method": r.method})
    return out


_ALGORITHMS = ("ring", "hierarchical", "torus2d")


def _matches(r, rel: float = 1e-4) -> bool:
    """Whether the simulated steps, off-node bytes and time equal the closed form; ``rel`` allows for the
    closed form's even split where M does not divide into equal chunks (a few bytes per rank)."""
    closed = r["inter_rank_closed"]
    same_bytes = closed is None or abs(r["inter_rank_max"] - closed) <= rel * closed
    return r["steps"] == r["steps_closed"] and same_bytes and abs(r["time"] - r["time_closed"]) <= rel * r["time"]


def conclusion(grid_rows) -> str:
    """One line: which algorithm is fastest on this grid, by how much, and why (fewer steps, or fewer bytes
    sent off the node), from the simulated figures."""
    ranked = sorted(grid_rows, key=lambda r: r["time"])
    best, second = ranked[0], ranked[1]
    speedups = ", ".join(f"{r['time'] / best['time']:.2f}x faster than {r['algorithm']}" for r in ranked[1:])
    why = []
    if second["steps"] >= 1.2 * best["steps"]:
        why.append(f"{best['steps']} steps against {second['steps']} (each step pays the latency alpha)")
    if second["inter_rank_max"] >= 1.2 * best["inter_rank_max"]:
        why.append(f"{second['inter_rank_max'] / best['inter_rank_max']:.0f}x fewer bytes off the node per rank "
                   f"({best['inter_rank_max'] / 1e6:.0f} MB against {second['inter_rank_max'] / 1e6:.0f} MB)")
    if not why:
        why.append(f"as many steps ({best['steps']} against {second['steps']}) and off-node bytes as "
                   f"{second['algorithm']}; the difference is in which links the bytes cross")
    return f"{best['algorithm']} wins ({speedups}): " + "; ".join(why)


def _si(x: float, unit: str) -> str:
    """``5e-06, "s"`` -> ``"5 us"``."""
    for scale, prefix in ((1, ""), (1e-3, "m"), (1e-6, "u")):
        if abs(x) >= scale * (1 - 1e-9):
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x / 1e-9:.3g} n{unit}"


def header(cost: Cost, nbytes: int = RESNET50_NBYTES) -> list[str]:
    """What the table shows and under which costs, as '#' lines."""
    inter_a = cost.alpha if cost.inter_alpha is None else cost.inter_alpha
    inter_b = cost.beta if cost.inter_beta is None else cost.inter_beta

    def level(a, b):
        return f"alpha {_si(a, 's')} per message, beta {b:g} s/B ({1 / b / 1e9:.3g} GB/s)" if b else \
            f"alpha {_si(a, 's')} per message, beta 0"
    return [
        (f"# torus-sim --paper: Mikami et al. 2018 (arXiv:1811.05233) section 3.2, all-reduce of ResNet-50's "
         f"float32 gradients (M = {nbytes / 2**20:.1f} MiB), {RANKS_PER_NODE} ranks per node"),
        f"# cost within a node: {level(cost.alpha, cost.beta)}, gamma {cost.gamma:g} s per byte reduced",
        f"# cost between nodes: {level(inter_a, inter_b)}",
        ("# per algorithm: steps = messages in sequence on a rank; off-node = MB the busiest rank sends to other "
         "nodes; ms = predicted time"),
        ("# every figure is the simulated replay of torus' own schedule; * marks one that differs from the "
         "paper's closed form"),
    ]


def table(rs) -> str:
    """One row per grid with each algorithm's steps, off-node MB and time, then a line saying who wins."""
    cell = 8 + 1 + 9 + 1 + 8
    lines = ["#" + " " * 21 + "".join(f"{a:^{cell + 3}}" for a in _ALGORITHMS),
             f"#{'ranks':>5} {'grid':>7} {'nodes':>6}" + f"   {'steps':>8} {'off-node':>9} {'ms':>8}" * 3]
    grids = list(dict.fromkeys((r["ranks"], r["grid"]) for r in rs))
    for ranks, grid in grids:
        mine = {r["algorithm"]: r for r in rs if (r["ranks"], r["grid"]) == (ranks, grid)}
        line = f" {ranks:>5} {grid:>7} {mine[_ALGORITHMS[0]]['nodes']:>6}"
        for a in _ALGORITHMS:
            r = mine[a]
            mark = " " if _matches(r) else "*"
            line += f"   {r['steps']:>8} {r['inter_rank_max'] / 1e6:>9.1f} {r['time'] * 1e3:>7.2f}{mark}"
        lines += [line, "      -> " + conclusion(list(mine.values()))]
    return "\n".join(lines)
