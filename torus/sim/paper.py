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
    """One dict per (grid, algorithm): simulated and closed-form steps, inter-node bytes and time (seconds)."""
    count = nbytes // ITEMSIZE[dtype]
    M = count * ITEMSIZE[dtype]
    out = []
    for X, Y in GRIDS:
        layout = Layout(X, Y, RANKS_PER_NODE)
        N, C = layout.N, layout.nodes
        for algo in ("ring", "hierarchical", "torus2d"):
            r = simulate(algo, "allreduce", layout, count, dtype, cost)
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


def table(rs) -> str:
    head = (f"{'ranks':>6} {'grid':>7} {'algorithm':>12} {'steps':>6} {'closed':>6} {'inter payload':>13} "
            f"{'inter MB/rank':>13} {'closed':>8} {'inter MB/node':>13} {'time ms':>9} {'closed':>9}")
    lines = [head]
    for r in rs:
        closed = "-" if r["inter_rank_closed"] is None else f"{r['inter_rank_closed'] / 1e6:.2f}"
        payload = "M" if r["payload_closed"] == rs[0]["payload_closed"] else \
            f"M/{round(rs[0]['payload_closed'] / r['payload_closed'])}"
        lines.append(f"{r['ranks']:>6} {r['grid']:>7} {r['algorithm']:>12} {r['steps']:>6} {r['steps_closed']:>6} "
                     f"{payload:>13} {r['inter_rank_max'] / 1e6:>13.2f} {closed:>8} "
                     f"{r['inter_node_max'] / 1e6:>13.2f} {r['time'] * 1e3:>9.3f} {r['time_closed'] * 1e3:>9.3f}")
    return "\n".join(lines)
