"""torus-bench all-reduce across emulated hosts: every layout at every link rate, the cluster always torn down.

    python bench/across_hosts/cluster_sweep.py           # as root; the default sweep (about 6 minutes)
    python bench/across_hosts/cluster_sweep.py --rates 1gbit --layouts 2x2 --iters 3   # a shorter one
    python bench/across_hosts/cluster_sweep.py --iters 40 --max-bytes 256K --sim none --out /tmp/small  # small sizes
    python bench/across_hosts/cluster_sweep.py --round-robin --layouts 2x2 --rates 1gbit --sim none --out /tmp/rr
        # (ranks dealt out)

For each rate and layout (HOSTSxRANKS_PER_HOST) it brings up an emulated cluster (tests/cluster: network
namespaces on a bridge, ``tc tbf`` on every host link, TCP between hosts), runs
``torus-bench allreduce -b 64K -e 64M -f 4`` over every algorithm and ``native`` with ranks placed in blocks
(hydra ``-hosts h1:L,h2:L``; ``--round-robin``: one per host in turn, ``-hosts h1,h2``), and writes
``bench/across_hosts/results/cluster_<layout>_<rate>.json`` (torus-bench's JSON, with the cluster's hosts, ranks
per host, link rate and placement under ``environment.cluster``) and one text file,
``bench/across_hosts/results/cluster_sweep.txt``: each run's table and, per size, every algorithm's time over the best
one (``auto``'s ratio is the figure of merit of torus/select.py's multi-node rule). On the ``--sim``
layouts (default 2x2) ``torus-sim --fit`` then ``--validate`` run on the same links
(``cluster_sim_fit_<layout>_<rate>.json``, ``cluster_sim_validate_...``). The load average is recorded
with each run.

The default rates, 1 and 4 Gbit/s: at 1 Gbit/s every algorithm is bound by the link (64 MiB takes half a
second and more); 4 Gbit/s is about what these 2 cores drive through veth and TCP at all (unshaped, MPI's own
all-reduce reached about 0.6 GB/s bus bandwidth between 2 hosts), so there CPU and link compete. Each
``mpiexec`` runs under a wall-clock limit; a failing run is recorded and the sweep goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.cluster import Cluster, child_env, unavailable  # noqa: E402

ALGOS = "ring,hierarchical,torus2d,native,auto"
LAYOUTS = ("2x1", "2x2", "4x1")
RATES = ("1gbit", "4gbit")


def _layout(text: str) -> tuple[int, int]:
    hosts, ppn = (int(v) for v in text.lower().split("x"))
    return hosts, ppn


PLACEMENTS = ("out_of_place", "in_place")


def ratios(rows: list[dict]) -> list[str]:
    """Per size: every algorithm's time over the fastest algorithm's (out of place / in place), and "picked":
    the time of the algorithm auto picked, in its own row, over the fastest (auto's own row times the same
    schedule again: the two differ by the run's noise)."""
    lines = []
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    picked = "auto" in algos
    lines.append("# time / best time per size (out of place / in place); best: the fastest per placement")
    lines.append(f"#{'size':>10} " + " ".join(f"{a:>13}" for a in algos + ["picked"] * picked) + "  best")
    for size in sorted({r["size"] for r in rows}):
        mine = {r["algorithm"]: r for r in rows if r["size"] == size}
        fastest = [min(m[p]["time_us"] for m in mine.values()) for p in PLACEMENTS]
        best = ["/".join(a for a, m in mine.items() if m[p]["time_us"] == fastest[i])
                for i, p in enumerate(PLACEMENTS)]
        cells = []
        for a in algos:
            t = [mine[a][p]["time_us"] / fastest[i] for i, p in enumerate(PLACEMENTS)]
            cells.append(f"{t[0]:6.2f}/{t[1]:<6.2f}")
        if picked:
            picks = mine["auto"]["resolved"].split("/")
            picks = picks * 2 if len(picks) == 1 else picks
            t = [mine[a][p]["time_us"] / fastest[i] for i, (a, p) in enumerate(zip(picks, PLACEMENTS))]
            cells.append(f"{t[0]:6.2f}/{t[1]:<6.2f}")
        lines.append(f" {size:>10} " + " ".join(f"{c:>13}" for c in cells) + "  " + "/".join(best))
    return lines


def _run(tag: str, cmd: list[str], limit: int) -> tuple[int, str]:
    print(f"+ [{tag}] {' '.join(cmd)}", flush=True)
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=limit,
                              check=False)
        rc, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = 124, f"TIMEOUT after {limit} s\n{e.stdout or ''}"
    print(log, flush=True)
    return rc, log


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/across_hosts/cluster_sweep.py", description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default=",".join(RATES), help="comma-separated tc rates per host link")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated HOSTSxRANKS_PER_HOST")
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per size (torus-bench -n)")
    ap.add_argument("--sim", default="2x2", help="layouts where torus-sim --fit and --validate run too")
    ap.add_argument("--out", default=str(ROOT / "bench" / "across_hosts" / "results"), help="folder for the results")
    ap.add_argument("--max-bytes", default="64M", help="largest size (torus-bench -e; default 64M)")
    ap.add_argument("--limit", type=int, default=180, help="seconds each torus-bench run may take")
    ap.add_argument("--round-robin", action="store_true",
                    help="deal the ranks out one per host in turn (hydra -hosts h1,h2), not in blocks; results "
                         "named cluster_<layout>_<rate>_rr")
    args = ap.parse_args(argv)
    why = unavailable()
    if why:
        print(f"cluster sweep skipped: {why}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench, sim = (str(Path(sys.executable).parent / name) for name in ("torus-bench", "torus-sim"))
    text, failed, t_start = [], 0, time.monotonic()
    for rate in args.rates.split(","):
        for layout in args.layouts.split(","):
            hosts, ppn = _layout(layout)
            tag = f"{hosts}x{ppn}_{rate}" + ("_rr" if args.round_robin else "")
            json_path = out / f"cluster_{tag}.json"
            with Cluster(hosts, rate, "torusb", 15) as cluster:
                launch = cluster.mpiexec(ppn, round_robin=args.round_robin) + ["-n", str(hosts * ppn)]
                load = os.getloadavg()
                t0 = time.monotonic()
                rc, log = _run(tag, launch + [bench, "allreduce", "-b", "64K", "-e", args.max_bytes, "-f", "4", "-n",
                                              str(args.iters), "-w", "1", "--algo", ALGOS, "--json",
                                              str(json_path)], args.limit)
                took = time.monotonic() - t0
                placed = "round robin" if args.round_robin else "blocks"
                text += [f"## {hosts} hosts x {ppn} ranks ({placed}), links {rate}: exit status {rc}, {took:.0f} s, "
                         f"load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after", log.rstrip()]
                if rc == 0 and json_path.exists():
                    text += ratios(json.loads(json_path.read_text())["results"])
                else:
                    failed += 1
                if layout in args.sim.split(","):  # the cost model on the same links: fit, then validate
                    fit = out / f"cluster_sim_fit_{tag}.json"
                    for mode, extra in (("--fit", []), ("--validate", ["--params", str(fit)])):
                        dest = fit if mode == "--fit" else out / f"cluster_sim_validate_{tag}.json"
                        rc, log = _run(tag, launch + [sim, mode, *extra, "--json", str(dest)], args.limit)
                        text += [f"## torus-sim {mode}, {hosts} hosts x {ppn} ranks, links {rate}: exit status "
                                 f"{rc}, load average {os.getloadavg()[0]:.2f}", log.rstrip()]
                        failed += rc != 0
            text.append("")
    (out / "cluster_sweep.txt").write_text("\n".join(text) + "\n")
    print(f"# wrote {out / 'cluster_sweep.txt'}; {failed} run(s) failed; {time.monotonic() - t_start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
