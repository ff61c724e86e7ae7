"""What snapshots at the default interval cost a training step (issue 42, "Done when"): torus-train ResNet-50
(synthetic data) across 2 emulated hosts x 1 rank, with snapshots on (``TORUS_JOB_ID`` set, the default
``TORUS_SNAPSHOT_STEPS`` / ``TORUS_SNAPSHOT_SECONDS``) and off (no job id), runs alternating on/off, off/on.

    nice -n 5 .venv/bin/python bench/snapshots/snapshot_overhead.py --pairs 3 --steps 300    # as root

Makes its own cluster (tests/cluster: namespaces ``torusso1..2``, 10.231.22.0/24, ``--rate`` per link), torn down at the
end. Each rank writes its snapshots to a folder of its own host (bench/fault_injection/fault_rank.sh), as on node-local
disks. The step time is torus-train's steady-state figure (``timed_seconds / timed_steps`` of the summary: from the end
of the first step to the end of the last, so tracing is left out); the snapshot files each host kept (the newest two)
show the steps snapshotted last. One line per run and the ratio on/off per pair go to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.cluster import Cluster, child_env, unavailable  # noqa: E402

WORK = Path("/tmp/torus-so")
WRAPPER = ROOT / "bench" / "fault_injection" / "fault_rank.sh"


def run(cluster: Cluster, args, name: str, snapshots: bool) -> dict:
    folder = WORK / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    summary = folder / "summary.json"
    cmd = cluster.mpiexec(ppn=1) + ["-n", "2", str(WRAPPER), sys.executable, "-m",
                                    "torus.integrations.keras.app.cli", "--model", "resnet50", "--synthetic",
                                    "--image-size", str(args.image_size), "--steps", str(args.steps), "--epochs",
                                    "1", "--batch-schedule", f"0:{args.batch}", "--threads", "1", "--verbose", "0",
                                    "--summary", str(summary)]
    env = child_env(FI_SNAP_ROOT=str(folder / "snap"))
    if snapshots:
        env["TORUS_JOB_ID"] = name
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
    history = json.loads(summary.read_text())["history"][0]
    files = sorted(p.name for p in (folder / "snap").glob("*/*/*.snap")) if snapshots else []
    return {"name": name, "snapshots": snapshots, "seconds": round(time.time() - t0, 1),
            "step_s": history["timed_seconds"] / history["timed_steps"], "timed_steps": history["timed_steps"],
            "files": files}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300, help="steps per run")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32, help="global batch")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "snapshots" / "results" / "snapshot_overhead.txt")
    args = ap.parse_args(argv)
    why = unavailable()
    if why:
        print(f"snapshot_overhead: cannot make a cluster here: {why}", file=sys.stderr)
        return 1
    given = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"# nice -n 5 .venv/bin/python bench/snapshots/snapshot_overhead.py {given}",
             f"# {time.strftime('%Y-%m-%d %H:%M')}, 2 emulated hosts x 1 rank at {args.rate}, ResNet-50 "
             f"{args.image_size}x{args.image_size} synthetic, global batch {args.batch}, {args.steps} steps a run, "
             "one thread per rank; snapshots at the defaults (TORUS_SNAPSHOT_STEPS / _SECONDS)"]
    ratios = []
    with Cluster(2, args.rate, name="torusso", subnet=22) as cluster:
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            got = {}
            for on in order:
                rec = run(cluster, args, f"so-{i}-{'on' if on else 'off'}", on)
                got[on] = rec
                line = (f"pair {i} {'on ' if on else 'off'}: step {rec['step_s'] * 1e3:8.1f} ms over "
                        f"{rec['timed_steps']} steps, {rec['seconds']} s in all"
                        + (f", snapshot files left: {', '.join(rec['files'])}" if on else ""))
                print(line, flush=True)
                lines.append(line)
            ratios.append(got[True]["step_s"] / got[False]["step_s"])
            lines.append(f"pair {i} on/off: {ratios[-1]:.4f}")
            print(lines[-1], flush=True)
    lines.append(f"on/off step time: median {statistics.median(ratios):.4f}, min {min(ratios):.4f}, "
                 f"max {max(ratios):.4f} over {len(ratios)} pairs")
    print(lines[-1])
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
