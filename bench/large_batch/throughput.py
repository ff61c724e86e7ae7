#!/usr/bin/env python
"""ResNet-20's training speed on Fashion-MNIST with ``torus-train`` at 1 and 2 ranks, runs alternating
(1, 2, 1, 2, ...) so that a change in the machine's load hits both rank counts alike.

    .venv/bin/python bench/large_batch/throughput.py --pairs 3 --out bench/large_batch/results/throughput.jsonl

Each run is ``mpiexec -n R torus-train --data fashion-mnist --model resnet20 --epochs 1 --train-images N
--batch-schedule 0:B``; its figure is torus-train's own ``images_per_s``: global images per second from the
end of the epoch's first step to the end of its last (start-up, tracing and the test-set pass left out).
Each line of ``--out`` is one run with the CPU model, the load average before and after and the command; the
table at the end gives each rank count's median.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', platform.processor()).strip()}, {os.cpu_count()} CPUs"


def run(ranks: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        cmd = [str(BIN / "mpiexec"), "-n", str(ranks), str(BIN / "torus-train"), "--data", args.data,
               "--model", "resnet20", "--epochs", "1", "--train-images", str(args.train_images),
               "--batch-schedule", f"0:{args.batch}", "--optimizer", "sgd", "--lr", "0.1", "--verbose", "0",
               "--summary", str(summary)]
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
        s = json.loads(summary.read_text())
    h = s["history"][0]
    return {"ranks": ranks, "global_batch": args.batch, "images_per_s": s["images_per_s"],
            "timed_steps": h["timed_steps"], "timed_seconds": h["timed_seconds"],
            "threads_per_rank": s["threads_per_rank"], "wall_s": round(time.perf_counter() - t0, 1),
            "val_top1": s["val_top1"], "load_before": load, "load_after": os.getloadavg()[0],
            "cpu": cpu_model(), "command": " ".join(cmd[:-2])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3, help="rounds of (1 rank, 2 ranks)")
    ap.add_argument("--batch", type=int, default=128, help="global batch")
    ap.add_argument("--train-images", type=int, default=6144, help="training images per run")
    ap.add_argument("--data", default="fashion-mnist")
    ap.add_argument("--out", type=Path, help="append one JSON line per run here")
    args = ap.parse_args()
    rows = []
    for pair in range(args.pairs):
        for ranks in (1, 2):
            row = run(ranks, args) | {"pair": pair}
            rows.append(row)
            print(f"pair {pair} ranks {ranks}: {row['images_per_s']:.1f} images/s ({row['timed_steps']} steps, "
                  f"load {row['load_before']:.2f} -> {row['load_after']:.2f})", flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(f"\n{rows[0]['cpu']}; global batch {args.batch}; median of {args.pairs} runs")
    for ranks in (1, 2):
        rates = [r["images_per_s"] for r in rows if r["ranks"] == ranks]
        print(f"{ranks} rank(s): {statistics.median(rates):.1f} images/s (runs: "
              f"{', '.join(f'{x:.1f}' for x in rates)})")


if __name__ == "__main__":
    main()
