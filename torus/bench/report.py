"""What torus-bench writes: the nccl-tests table, the ratio-to-native summary, JSON, CSV and a busbw plot.

Rows are the dicts ``torus.bench.sweep.sweep`` yields; every function here runs on one rank (rank 0).
"""
from __future__ import annotations

import csv
import json
import os
import platform
import socket
import time

import mpi4py
import numpy as np
from mpi4py import MPI

import torus
from torus import kernels, knobs
from torus.bench.sweep import PLACEMENTS, format_size

_ENV_PREFIXES = ("TORUS_", "MALLOC_", "OMP_", "MPIR_CVAR_", "MPICH_", "UCX_", "FI_", "OMPI_MCA_")
_STATS = ("time_us", "min_us", "max_us", "p25_us", "p75_us", "algbw", "busbw", "wrong")


def environment(tc, argv) -> dict:
    """Where and how the figures were made; collective over ``tc`` (it gathers every rank's host)."""
    hosts = tc.comm.allgather(socket.gethostname())
    return {
        "command": " ".join(argv),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ranks": tc.size, "dims": f"{tc.dims[0]}x{tc.dims[1]}",
        "nodes": tc.nodes, "ranks_per_node": tc.local_size, "segment_bytes": tc.segment_bytes,
        "check_arguments": tc.check, "shm_phases": tc.shm_phases,
        "hosts": sorted(set(hosts)), "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
        "kernel_threads": kernels.get_num_threads(),
        "mpi_library": "; ".join(" ".join(line.split()) for line in MPI.Get_library_version().splitlines()
                              if line.strip()),
        "mpi_version": "{}.{}".format(*MPI.Get_version()), "mpi4py": mpi4py.__version__,
        "numpy": np.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "torus": torus.__version__,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
        "cluster": cluster(),
    }


def cluster() -> dict | None:
    """The emulated cluster the job runs on, from the variables tests/cluster's ``mpiexec`` line sets
    (``TORUS_CLUSTER_HOSTS``, ``_PPN``, ``_RATE``, ``_PLACEMENT``): ``{"hosts", "ranks_per_host",
    "link_rate", "placement"}`` (the ``tc`` rate of each host's link, or "unshaped"; "blocks" or
    "round_robin"); None outside one. On a real cluster set them yourself
    to label the figures."""
    if not knobs.is_set("TORUS_CLUSTER_HOSTS"):
        return None
    return {"hosts": knobs.read("TORUS_CLUSTER_HOSTS"),
            "ranks_per_host": knobs.read("TORUS_CLUSTER_PPN") or None,
            "link_rate": knobs.read("TORUS_CLUSTER_RATE"),
            "placement": knobs.read("TORUS_CLUSTER_PLACEMENT")}


# ---------------------------------------------------------------------------------------------- table

def _library(env: dict) -> str:
    """The MPI library's first line (MPICH: 'MPICH Version: 5.0.2'), at most 60 characters."""
    return env["mpi_library"].split(";")[0][:60]


def _num(x: float, width: int) -> str:
    """One decimal when it fits in ``width``, none otherwise."""
    text = f"{x:.1f}"
    return f"{text if len(text) <= width else f'{x:.0f}':>{width}}"


# Column widths; every cell is preceded by one space ('#' takes the first one in header lines).
_KEYS = ((11, "size", "(B)"), (12, "count", "(elements)"), (9, "type", ""), (6, "redop", ""), (16, "algo", ""))
_CELLS = ((8, "time", "(us)"), (7, "iqr", "(us)"), (7, "algbw", "(GB/s)"), (7, "busbw", "(GB/s)"),
          (6, "#wrong", ""))


def header(env: dict, args: dict) -> list[str]:
    """The lines printed before the first row."""
    check = "on" if env["check_arguments"] else "off (TORUS_CHECK=0)"
    lead = sum(w + 1 for w, _, _ in _KEYS)
    group = sum(w + 1 for w, _, _ in _CELLS)
    return [
        f"# torus-bench {args['collective']}: {env['ranks']} ranks, dims {env['dims']}, {env['nodes']} node(s) "
        f"x {env['ranks_per_node']} ranks, {args['dtype']}, op {args['op']}, {args['iters']} iterations after "
        f"{args['warmup']} warm-up, segments {format_size(env['segment_bytes'])}B, argument check {check}",
        f"# {_library(env)}; mpi4py {env['mpi4py']}; torus {env['torus']}; host {env['hosts'][0]}"
        + ("" if not env.get("cluster") else f"; emulated cluster: {env['cluster']['hosts']} hosts x "
           f"{env['cluster']['ranks_per_host']} ranks ({env['cluster'].get('placement', 'blocks')}), links "
           f"{env['cluster']['link_rate']}"),
        "# size: bytes really moved (rounded down to whole elements"
        + (", and for reduce-scatter/all-gather to a multiple of dtype size x ranks)" if
           args["collective"] != "allreduce" else ")")
        + "; count: elements in size",
        "# time: median over iterations of the slowest rank; iqr: spread (75th - 25th percentile); "
        "busbw: nccl-tests' PERFORMANCE.md",
        "#" + " " * (lead - 1) + f"{'out-of-place':^{group}}{'in-place':^{group}}",
        "#" + " ".join(f"{name:>{w}}" for w, name, _ in _KEYS) + (" " + " ".join(
            f"{name:>{w}}" for w, name, _ in _CELLS)) * 2,
        "#" + " ".join(f"{unit:>{w}}" for w, _, unit in _KEYS) + (" " + " ".join(
            f"{unit:>{w}}" for w, _, unit in _CELLS)) * 2,
    ]


def row_line(row: dict) -> str:
    """One table line: size, count, type, redop, algorithm, then time/iqr/algbw/busbw/#wrong twice."""
    algo = row["algorithm"] if row["algorithm"] != "auto" else f"auto:{row['resolved']}"
    keys = (row["size"], row["count"], row["dtype"], row["op"], algo)
    line = "".join(f" {k:>{w}}" for k, (w, _, _) in zip(keys, _KEYS))
    for p in PLACEMENTS:
        s = row[p]
        wrong = "N/A" if s["wrong"] is None else s["wrong"]
        line += f" {_num(s['time_us'], 8)} {_num(s['p75_us'] - s['p25_us'], 7)} {s['algbw']:7.3f} " \
                f"{s['busbw']:7.3f} {wrong:>6}"
    return line


def summary(rows: list[dict]) -> list[str]:
    """Footer: wrong elements, average busbw per algorithm, and each algorithm's median time over native's
    at each size (below 1: faster than native)."""
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    wrong = [r[p]["wrong"] for r in rows for p in PLACEMENTS]
    total = sum(w for w in wrong if w is not None)
    verdict = "N/A (check off)" if None in wrong else f"{total} {'OK' if total == 0 else 'FAILED'}"
    lines = ["#", f"# Out of bounds values : {verdict}"]
    for a in algorithms:
        bw = [r[p]["busbw"] for r in rows if r["algorithm"] == a for p in PLACEMENTS]
        lines.append(f"# Avg bus bandwidth    : {np.mean(bw):8.3f} GB/s  {a}")
    others = [a for a in algorithms if a != "native"]
    if "native" not in algorithms or not others:
        return lines + ["# (no ratio to native: run with --algo including native and another algorithm)"]
    native = {r["size"]: r for r in rows if r["algorithm"] == "native"}
    width = max(9, *(len(a) + 1 for a in others))
    lines += ["#", "# time / native time (median; below 1 = faster than native)",
              f"#{'':>11}{'out-of-place':^{width * len(others)}}  {'in-place':^{width * len(others)}}",
              f"#{'size':>11}" + "".join(f"{a:>{width}}" for a in others) + "  "
              + "".join(f"{a:>{width}}" for a in others)]
    by_key = {(r["size"], r["algorithm"]): r for r in rows}
    for size, ref in native.items():
        cells = []
        for p in PLACEMENTS:
            for a in others:
                r = by_key.get((size, a))
                t0 = ref[p]["time_us"]
                cells.append(f"{r[p]['time_us'] / t0:>{width}.2f}" if r and t0 > 0 else f"{'-':>{width}}")
            cells.append("  ")
        lines.append(f" {format_size(size):>11}" + "".join(cells[:-1]))
    return lines


# ---------------------------------------------------------------------------------------------- files

def write_json(path: str, env: dict, args: dict, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"environment": env, "arguments": args, "results": rows}, f, indent=1)
        f.write("\n")


def write_csv(path: str, env: dict, args: dict, rows: list[dict]) -> None:
    """One line per (size, algorithm, placement); the environment and arguments as leading '# key: value'
    lines (read with ``pandas.read_csv(path, comment='#')``); per-iteration times space-separated."""
    with open(path, "w", newline="") as f:
        for key, value in {**env, **{f"arg.{k}": v for k, v in args.items()}}.items():
            f.write(f"# {key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}\n")
        out = csv.writer(f)
        out.writerow(["collective", "size", "count", "dtype", "op", "algorithm", "resolved", "placement",
                      *_STATS, "times_us"])
        for r in rows:
            for p in PLACEMENTS:
                s = r[p]
                out.writerow([r["collective"], r["size"], r["count"], r["dtype"], r["op"], r["algorithm"],
                              r["resolved"], p, *("" if s[k] is None else s[k] for k in _STATS),
                              " ".join(f"{t:.3f}" for t in s["times_us"])])


def plot(path: str, env: dict, args: dict, rows: list[dict]) -> None:
    """busbw against size (log2 axis, byte labels), one line per algorithm, out-of-place and in-place."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    rows = [r for r in rows if r["size"] > 0]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), sharey=True, constrained_layout=True)
    sizes = sorted({r["size"] for r in rows})
    lo, hi = int(np.floor(np.log2(sizes[0]))), int(np.ceil(np.log2(sizes[-1])))
    step = max(1, -(-(hi - lo) // 10))
    ticks = [2 ** k for k in range(lo, hi + 1, step)]
    for ax, placement in zip(axes, PLACEMENTS):
        for algo in dict.fromkeys(r["algorithm"] for r in rows):
            mine = [r for r in rows if r["algorithm"] == algo]
            ax.plot([r["size"] for r in mine], [r[placement]["busbw"] for r in mine], marker="o",
                    markersize=3.5, linewidth=1.6, label=algo)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_size(int(round(x)))))
        ax.set_xlim(sizes[0] / 1.3, sizes[-1] * 1.3)
        ax.set_title(placement.replace("_", "-"))
        ax.set_xlabel("size (bytes)")
        ax.grid(True, which="major", alpha=0.35)
    axes[0].set_ylabel("busbw (GB/s)")
    axes[0].legend(title="algorithm", loc="upper left")
    fig.suptitle(f"torus-bench {args['collective']}: {env['ranks']} ranks (dims {env['dims']}), {args['dtype']}, "
                 f"op {args['op']}, median of {args['iters']}; {env['hosts'][0]}, "
                 f"{_library(env)}", fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(env: dict, args: dict, rows: list[dict], *, json_path=None, csv_path=None, plot_path=None):
    """Write whichever of the three files were asked for; reports each path on stdout."""
    for path, writer in ((json_path, write_json), (csv_path, write_csv), (plot_path, plot)):
        if path:
            writer(path, env, args, rows)
            print(f"# wrote {path}", flush=True)
