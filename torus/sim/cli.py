"""torus-sim: replay torus' own schedules at any scale under an α-β-γ cost model.

    torus-sim --ranks 2176 --dims 32x68 --nbytes 100M --alpha 1e-6 --beta 1e-10 --gamma 1e-11 \\
              --ranks-per-node 4 --inter-alpha 5e-6 --inter-beta 4e-10
    torus-sim --sweep -b 1K -e 1G -f 4 --ranks 64,1088,2176 --json sim.json --plot sim.png
    torus-sim --paper
    torus-sim --step bench/overlap/results/overlap_timeline_2x1_1gbit.json --ranks 2 --params fit.json   # a step
    torus-sim --step profile.json --paper --compute-step 0.1 --algo torus2d --alpha 1e-6 ...    # at the paper's grids
    torus-sim --algo shm,ring --ranks 4 --ranks-per-node 4 --nbytes 64M --copy-beta 1e-10 --flag-alpha 5e-7
    torus-sim --algo shm --alloc --ranks 4 --ranks-per-node 4 --nbytes 64M --window-beta 2e-10 --flag-alpha 5e-7
    mpiexec -n 4 torus-sim --fit --json fit4.json           # measure α, β, γ on this machine, at 4 ranks
    mpiexec -n 4 torus-sim --validate --params fit4.json    # predicted vs measured TorusComm times

Sizes are bytes of the whole buffer (binary K/M/G, as torus-bench); times in seconds unless labelled.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys

from torus import cli
from torus.bench.sweep import format_size, parse_size, size_steps
from torus.sim import plans
from torus.sim.model import ITEMSIZE, Cost, Layout, SimulationError
from torus.sim.network import Network
from torus.sim.plans import COLLECTIVES
from torus.sim.simulate import algorithms, simulate
from torus.topology import node_dims


def _list(kind, choices=None):
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        try:
            values = [kind(t) for t in items]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        bad = [v for v in values if choices is not None and v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list"
                                             + (f" of {', '.join(choices)}" if choices else ""))
        return values
    return parse


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dims(text: str) -> tuple[int, int]:
    try:
        x, y = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected XxY, e.g. 32x68") from None
    return x, y


def layout_for(args, n: int) -> Layout:
    """The Layout of ``n`` ranks for ``--ranks-per-node``, ``--placement`` and ``--dims`` (default: the grid
    TorusComm picks, torus.topology.node_dims, where it has one, else ``default_dims``)."""
    L = args.ranks_per_node
    if n % L:
        raise ValueError(f"torus-sim: {n} ranks are not a whole number of nodes of {L}")
    node_of = [r // L for r in range(n)] if args.placement == "block" else [r % (n // L) for r in range(n)]
    dims = args.dims or node_dims(node_of) or default_dims(n)
    if dims[0] * dims[1] != n:
        raise ValueError(f"torus-sim: dims {dims[0]}x{dims[1]} do not multiply to {n} ranks")
    layout = Layout.placed(dims[0], dims[1], node_of)
    if args.network == "star":
        return layout
    # a torus of nodes laid out as the rank grid where whole nodes tile its rows: a row neighbour one hop away
    grid = (dims[0] // L, dims[1]) if args.placement == "block" and dims[0] % L == 0 else None
    return dataclasses.replace(layout, network=Network.parse(args.network, layout.nodes, grid))


def default_dims(n: int) -> tuple[int, int]:
    """``(X, Y)``, ``X <= Y`` as square as possible (MPI.Compute_dims' choice, the shorter side along rows)."""
    x = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return x, n // x


def parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(prog="torus-sim", description=__doc__)
    names, schedules = algorithms(), plans.default()  # the registry's, now: a registered algorithm is a choice
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true", help="every size from -b to -e by -f, at every --ranks")
    mode.add_argument("--paper", action="store_true",
                      help="the comparison of Mikami et al. 2018 section 3.2 (1,088 and 2,176 ranks), with who wins")
    mode.add_argument("--fit", action="store_true", help="measure alpha, beta, gamma on this machine (under "
                      "mpiexec -n K, the rank count you will --validate or predict)")
    mode.add_argument("--validate", action="store_true", help="measured against predicted times (under mpiexec)")
    ap.add_argument("--step", default=None, metavar="FILE",
                    help="a training step with the gradient all-reduce behind backprop (sim/step.py): FILE is a step "
                         "profile (sim/profile.py) or a TORUS_TIMELINE trace; per --algo (default: the profile's) "
                         "and --ranks (or, with --paper, the paper's grids) the step with and without overlap")
    ap.add_argument("--compute-step", type=float, default=None, metavar="SECONDS",
                    help="--step: scale the profile's times so that its compute alone takes SECONDS")
    ap.add_argument("--allreduce-seconds", type=float, default=None, metavar="SECONDS",
                    help="--step: scale every predicted all-reduce so that the fused one of the profile's bytes "
                         "takes SECONDS at each layout (a measured all-reduce alone, to check a measured run)")
    ap.add_argument("--slowdown", type=float, default=1.0, metavar="F",
                    help="--step: an all-reduce runs F times slower while backprop still computes (default 1: "
                         "no contention)")
    ap.add_argument("--save-profile", default=None, metavar="FILE",
                    help="--step: write the profile used (after --compute-step) as JSON")
    ap.add_argument("--ranks", type=_list(int), default="16", metavar="N[,N...]", help="rank counts")
    ap.add_argument("--dims", type=_dims, default=None, metavar="XxY",
                    help="grid, X*Y = --ranks (default: as square as possible)")
    ap.add_argument("--nbytes", type=_list(_size), default="100M", metavar="SIZE[,SIZE...]",
                    help="buffer sizes in bytes (K, M, G: binary); --validate: the sizes measured (default "
                         "4K,64K,1M,16M)")
    ap.add_argument("-b", "--minbytes", type=_size, default="1K", metavar="SIZE", help="--sweep: smallest size")
    ap.add_argument("-e", "--maxbytes", type=_size, default="1G", metavar="SIZE", help="--sweep: largest size")
    ap.add_argument("-f", "--stepfactor", type=int, default=4, metavar="F", help="--sweep: size factor per step")
    ap.add_argument("--dtype", choices=tuple(ITEMSIZE), default="float32", help="element type")
    ap.add_argument("--algo", type=_list(str, names), default=None, metavar="LIST",
                    help=f"comma-separated, from {', '.join(names)} (default: {', '.join(schedules)}; "
                         "with --step the profile's own; shm: the shared-memory transport, every rank on one "
                         "node: --ranks-per-node = --ranks)")
    ap.add_argument("--collective", type=_list(str, COLLECTIVES), default="allreduce", metavar="LIST",
                    help=f"comma-separated, from {', '.join(COLLECTIVES)}")
    ap.add_argument("--alpha", type=float, default=1e-6, help="seconds per message within a node")
    ap.add_argument("--beta", type=float, default=1e-10, help="seconds per byte within a node")
    ap.add_argument("--gamma", type=float, default=0.0, help="seconds per byte reduced")
    ap.add_argument("--ranks-per-node", type=int, default=1, metavar="L",
                    help="ranks per node (hierarchical's local size; the two cost levels)")
    ap.add_argument("--placement", choices=("block", "round-robin"), default="block",
                    help="ranks on nodes: consecutive ranks per node (block, hydra's -hosts h1:L,h2:L) or dealt "
                         "out one by one (round-robin, -hosts h1,h2); without --dims the grid then follows "
                         "the nodes as TorusComm's default grid does")
    ap.add_argument("--shm-phases", action=argparse.BooleanOptionalAction, default=True,
                    help="across nodes, replay what TorusComm runs by default: hierarchical's and torus2d's "
                         "node-level phases over shared memory (priced by --copy-beta, --flag-alpha, "
                         "--call-alpha); --no-shm-phases: the plain plans, as the closed forms")
    ap.add_argument("--shm-slot-bytes", type=_size, default=None, metavar="SIZE",
                    help="the node-level shared-memory phases' slot (default: the transport's, 256K)")
    ap.add_argument("--inter-alpha", type=float, default=None, help="seconds per message between nodes "
                    "(default: --alpha)")
    ap.add_argument("--inter-beta", type=float, default=None, help="seconds per byte between nodes "
                    "(default: --beta)")
    ap.add_argument("--shared-links", action=argparse.BooleanOptionalAction, default=True,
                    help="ranks of a node crossing to other nodes at the same step share its link, as on a real "
                         "network (default); --no-shared-links: each message gets the whole link, as the paper's "
                         "closed forms assume")
    ap.add_argument("--network", default="star", metavar="NET",
                    help="how the nodes are wired, the links shared by the flows crossing them (sim/network.py): "
                         "star (default: one non-blocking switch), torus[:PxQ] (nodes on a torus, "
                         "dimension-order routing; default: the nodes laid out as the rank grid), "
                         "fattree:LEAF[:OVERSUB] (leaf switches of LEAF nodes, uplinks tapered OVERSUB:1)")
    ap.add_argument("--copy-beta", type=float, default=None,
                    help="shm: seconds per byte of a memory copy (default: --beta)")
    ap.add_argument("--flag-alpha", type=float, default=None,
                    help="shm: seconds until a flag one rank stores is seen by the others (default: --alpha)")
    ap.add_argument("--call-alpha", type=float, default=0.0, help="shm: seconds per call around its step loop")
    ap.add_argument("--window-beta", type=float, default=None,
                    help="shm --alloc: seconds per byte copied between two buffers neither in cache (a peer's "
                         "reduced chunk from its buffer into ours; default: --copy-beta)")
    ap.add_argument("--alloc", action="store_true",
                    help="shm: the in-place all-reduce of a TorusComm.alloc buffer (no copy in, no segments: "
                         "torus-bench --alloc's in-place column); other algorithms run such a buffer as any "
                         "other; with --validate: adds that row, measured on alloc buffers")
    ap.add_argument("--segment-bytes", type=_size, default=None, metavar="SIZE",
                    help="pipelining unit in bytes (default: none, whole chunks)")
    ap.add_argument("--params", default=None, metavar="FILE",
                    help="JSON with alpha/beta/gamma (from --fit); flags given on the command line override it")
    ap.add_argument("--method", choices=("auto", "full", "orbit"), default="auto",
                    help="replay every rank (full), one rank per symmetry class (orbit), or pick (auto)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="--sweep: write a PNG of time against size "
                    "(needs matplotlib)")
    return ap


def _check(ap, args) -> None:
    """Argument errors that argparse cannot see, before any replay (exit status 2, one line)."""
    for flag in ("json", "plot", "save_profile"):
        problem = cli.writable_file("--" + flag.replace("_", "-"), getattr(args, flag))
        if problem:
            ap.error(problem)
    if args.step is not None:
        if args.sweep or args.fit or args.validate or args.alloc:
            ap.error("--step prices a training step: not with --sweep, --fit, --validate or --alloc")
        if not os.path.isfile(args.step):
            ap.error(f"--step {args.step}: no such file")
        for flag in ("compute_step", "allreduce_seconds"):
            value = getattr(args, flag)
            if value is not None and not (math.isfinite(value) and value > 0):
                ap.error(f"--{flag.replace('_', '-')} {value}: expected seconds > 0")
        if not (math.isfinite(args.slowdown) and args.slowdown >= 1):
            ap.error(f"--slowdown {args.slowdown}: expected a factor >= 1")
    elif args.compute_step is not None or args.allreduce_seconds is not None or args.save_profile or \
            args.slowdown != 1.0:
        ap.error("--compute-step, --allreduce-seconds, --slowdown and --save-profile go with --step")
    if args.network != "star":
        if not args.shared_links:
            ap.error(f"--network {args.network} prices shared links: not with --no-shared-links")
        if args.paper or args.fit or args.validate:
            ap.error("--network goes with a replay or --sweep (--paper prices the closed forms' whole links, "
                     "--fit and --validate the network they run on)")
        try:
            Network.parse(args.network)
        except ValueError as e:
            ap.error(str(e).removeprefix("torus-sim: "))
    if args.params and not os.path.isfile(args.params):
        ap.error(f"--params {args.params}: no such file")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib (pip install matplotlib)")
    if args.dims is not None and len(args.ranks) > 1:
        ap.error("--dims needs a single --ranks")
    if args.dims is not None and args.dims[0] * args.dims[1] != args.ranks[0]:
        ap.error(f"--dims {args.dims[0]}x{args.dims[1]} does not multiply to --ranks {args.ranks[0]}")
    if args.ranks_per_node < 1 or min(args.ranks) < 1:
        ap.error("--ranks and --ranks-per-node must be at least 1")
    if args.alloc and (args.paper or args.fit):
        ap.error("--alloc prices the shm transport's all-reduce of alloc buffers in a replay or --validate, "
                 "not with --paper or --fit (--fit on one node measures --window-beta anyway)")
    if args.alloc and args.collective != ["allreduce"]:
        ap.error("--alloc is for allreduce (alloc buffers serve in-place all-reduces)")
    if args.alloc and not args.validate and "shm" not in args.algo:
        ap.error("--alloc prices the shm transport's in-place all-reduce of TorusComm.alloc buffers: it needs "
                 "--algo shm")
    if args.sweep:
        try:
            size_steps(args.minbytes, args.maxbytes, args.stepfactor)
        except ValueError as e:
            ap.error(str(e))


def cost_from(args, argv) -> Cost:
    """Cost from --params (a --fit JSON), overridden by flags given on the command line."""
    values = {}
    if args.params:
        with open(args.params) as f:
            values = {k: v for k, v in json.load(f).items() if k in Cost.__dataclass_fields__}
    for name in Cost.__dataclass_fields__:
        flag = "--" + name.replace("_", "-")
        given = (flag, "--no-" + flag[2:])
        if name not in values or any(a in given or a.startswith(flag + "=") for a in argv):
            values[name] = getattr(args, name)
    return Cost(**values)


def _row_text(r) -> str:
    return (f"{r.algorithm:>12} {r.collective:>14} {r.ranks:>6} {r.dims:>8} {format_size(r.nbytes):>7} "
            f"{r.steps:>6} {r.msgs_max:>6.0f} {r.sent_max / 1e6:>10.3f} {r.sent_mean / 1e6:>10.3f} "
            f"{r.reduced_max / 1e6:>10.3f} {r.inter_rank_max / 1e6:>10.3f} {r.inter_node_max / 1e6:>10.3f} "
            f"{r.time * 1e3:>11.4f} {r.method:>6}")


HEADER = (f"{'algorithm':>12} {'collective':>14} {'ranks':>6} {'dims':>8} {'size':>7} {'steps':>6} {'msgs':>6} "
          f"{'sentMBmax':>10} {'sentMBavg':>10} {'redMBmax':>10} {'interMB/r':>10} {'interMB/n':>10} "
          f"{'time ms':>11} {'method':>6}")


def plot(results, path: str, cost: Cost) -> None:
    """Time against size, one line per (algorithm, ranks), log-log; the cost parameters in the title."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[tuple, list] = {}
    for r in results:
        lines.setdefault((r.collective, r.algorithm, r.ranks, r.dims), []).append((r.nbytes, r.time))
    for (coll, algo, n, dims), pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker=".",
                label=f"{algo} {coll} N={n} ({dims})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("predicted time (ms)")
    levels = "" if cost.inter_alpha is None and cost.inter_beta is None else \
        f", inter α={cost.inter_alpha:g} β={cost.inter_beta:g}, {results[0].ranks_per_node}/node"
    ax.set_title(f"torus-sim: α-β-γ replay of the real schedules\nα={cost.alpha:g} s, β={cost.beta:g} s/B, "
                 f"γ={cost.gamma:g} s/B{levels}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _step(args, cost: Cost, out: dict) -> int:
    """``--step``: the step model (sim/step.py) per layout and algorithm; prints a table, fills ``out``."""
    from torus.sim import paper, profile, step
    try:
        prof = profile.load(args.step)
        if args.compute_step is not None:
            prof = prof.scaled(args.compute_step)
        if args.paper:
            layouts = [Layout(x, y, paper.RANKS_PER_NODE) for x, y in paper.GRIDS]
        else:
            layouts = [layout_for(args, n) for n in args.ranks]
        print(f"# torus-sim --step: {len(prof.buckets)} buckets, {sum(b.nbytes for b in prof.buckets) / 1e6:.1f} MB "
              f"({', '.join(f'{b.nbytes / 1e6:.1f}' for b in prof.buckets)}); compute alone {prof.compute:.4f} s "
              f"(backprop {prof.backprop:.4f} s + apply {prof.apply:.4f} s); {prof.source}")
        levels = ("alpha", "beta", "gamma", "inter_alpha", "inter_beta")
        print(f"# cost: {', '.join(f'{k} {getattr(cost, k):g}' for k in levels if getattr(cost, k) is not None)}"
              + (f"; all-reduces scaled to a fused one of {args.allreduce_seconds:g} s" if args.allreduce_seconds
                 else "") + (f"; slowdown {args.slowdown:g} during backprop" if args.slowdown != 1 else ""))
        print("# on = max(backprop, last bucket reduced) + apply + metric (one FIFO thread); off = backprop + fused "
              "all-reduce + apply + metric; exposed = step - compute alone; eff = compute alone / step")
        print(f"{'algorithm':>12} {'ranks':>6} {'grid':>8} {'nodes':>6} {'comm s':>8} {'on s':>8} {'off s':>8} "
              f"{'exposed':>8} {'overlap':>8} {'eff on':>7} {'eff off':>7}")
        rows = []
        for layout in layouts:
            price = step.sim_price(layout, cost, args.method)
            for algo in args.algo or [None]:
                p = step.calibrated(price, prof, algo, args.allreduce_seconds) if args.allreduce_seconds else price
                r = step.model(prof, p, algo, args.slowdown)
                rows.append({"ranks": layout.N, "grid": f"{layout.X}x{layout.Y}", "nodes": layout.nodes,
                             **r.as_dict()})
                print(f"{r.algorithm:>12} {layout.N:>6} {f'{layout.X}x{layout.Y}':>8} "
                      f"{layout.nodes:>6} {r.comm:>8.4f} {r.step:>8.4f} {r.off:>8.4f} {r.exposed:>8.4f} "
                      f"{r.overlap:>8.1%} {r.compute / r.step:>7.1%} {r.compute / r.off:>7.1%}", flush=True)
    except (ValueError, SimulationError) as e:
        print(f"torus-sim --step: {e}", file=sys.stderr)
        return 2
    if len(rows) == 1:
        print("# bucket: ready -> all-reduce start-finish, s: " + "; ".join(
            f"{k}: {b.ready:.4f} -> {s:.4f}-{f:.4f}"
            for k, (b, s, f) in enumerate(zip(prof.buckets, rows[0]["starts"], rows[0]["finishes"]))))
    out["profile"] = prof.as_dict()
    out["step"] = rows
    if args.save_profile:
        with open(args.save_profile, "w") as f:
            json.dump(prof.as_dict(), f, indent=1)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    try:
        args = ap.parse_args(argv)
        if args.algo is None and args.step is None:
            args.algo = list(plans.default())
        _check(ap, args)
    except SystemExit as e:  # a usage error (one line, from rank 0) or --help
        return e.code if isinstance(e.code, int) else 2
    if args.fit or args.validate:
        from torus.sim import fit
        given = any(a == "--nbytes" or a.startswith("--nbytes=") for a in argv)
        args.nbytes_given = args.nbytes if given else None  # --validate's sizes (default fit.VALIDATE_SIZES)
        return fit.main(args, cost_from(args, argv))
    cost = cost_from(args, argv)
    out: dict[str, object] = {"command": "torus-sim " + " ".join(argv), "cost": cost.__dict__}
    if args.step is not None:
        code = _step(args, cost, out)
        if code:
            return code
    elif args.paper:
        from torus.sim import paper
        rows = paper.rows(cost=cost, dtype=args.dtype)
        print("\n".join(paper.header(cost)))
        print(paper.table(rows))
        out["paper"] = rows
    else:
        sizes = size_steps(args.minbytes, args.maxbytes, args.stepfactor) if args.sweep else args.nbytes
        results = []
        print(HEADER)
        for n in args.ranks:
            try:
                layout = layout_for(args, n)
                for coll in args.collective:
                    for algo in args.algo:
                        for nbytes in sizes:
                            r = simulate(algo, coll, layout, nbytes // ITEMSIZE[args.dtype], args.dtype, cost,
                                         args.method, args.alloc, args.shm_phases)
                            results.append(r)
                            print(_row_text(r), flush=True)
            except (ValueError, SimulationError) as e:
                print(e, file=sys.stderr)
                return 2
        out["results"] = [r.as_dict() for r in results]
        if args.plot:
            plot(results, args.plot, cost)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
