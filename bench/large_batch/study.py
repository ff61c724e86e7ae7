#!/usr/bin/env python
"""Issue 45: does test accuracy hold as the global batch grows, and which method holds it? ResNet-20 on
Fashion-MNIST with ``torus-train``, every cell the same epoch budget, several seeds.

    .venv/bin/python bench/large_batch/study.py --epochs 10 --seeds 0,1,2 --out bench/large_batch/results/study.jsonl
    .venv/bin/python bench/large_batch/study.py --report --epochs 10 --out bench/large_batch/results/study.jsonl

Methods (``--methods``; the learning rates are flags, each a peak per 256 images scaled linearly with the
global batch by torus-train, with a linear warm-up over ``--warmup`` of the budget, then torus-train's
polynomial decay, power 2, to 0):

- ``sgd``: SGD with momentum 0.9, the linear scaling rule and gradual warm-up (Goyal et al. 2017,
  arXiv:1706.02677, sections 2.1-2.2; they decay in steps, torus-train decays polynomially).
- ``lars``: LARS, trust coefficient 0.001, warm-up and polynomial decay (You, Gitman, Ginsburg 2017,
  arXiv:1708.03888, sections 3-5).
- ``lars-bsc``: LARS with batch-size control (Mikami et al. 2018, arXiv:1811.05233, section 3.1): the
  batch starts at a quarter of the target and doubles twice, at a third and at two thirds of the epochs
  (``batch_schedule``); the rate follows the batch, so it reaches ``lars``'s peak with the target batch.
- ``nesterov-sweep`` (and ``adam-sweep``): Nesterov momentum (Adam) at the largest batch only, the peak rate
  swept over a log grid (Nado et al. 2021, arXiv:2102.06356: well-tuned standard optimizers match LARS and
  LAMB at large batches). The sweep is scored on the test split, which flatters it: there is no held-out
  split here. ``lars-sweep``: ``lars`` at the largest batch at ×¼ and ×½ of its linear rule's peak.

Each finished cell is appended to ``--out`` as one JSON line (the cell, torus-train's summary and its
command); a cell already there is skipped, so an interrupted study resumes where it stopped. ``--report``
(also run at the end) prints a table of mean and spread over seeds per method, global batch and rank count
(a sweep's best rate; every rate it tried in a second table), writes it to ``<out>.md`` and plots test
accuracy against the global batch, one line per method, ``--ranks`` ranks, to ``<out>.png``. Every run is
``mpiexec -n --ranks torus-train ...``; ``--dry-run`` prints them.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
SWEEP = {"nesterov-sweep": ("nesterov", (0.25, 0.5, 1.0, 2.0, 4.0)),  # times the sgd rate's linear scaling
         "adam-sweep": ("adam", (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)),  # absolute peaks at the largest batch
         "lars-sweep": ("lars", (0.25, 0.5))}  # times lars' rate: its linear rule diverged at 8192
WARMUP = 0.1  # a tenth of the budget (Goyal et al. warm up 5 of 90 epochs)
METHODS = ("sgd", "lars", "lars-bsc", "nesterov-sweep", "adam-sweep", "lars-sweep")


def batch_schedule(target: int, epochs: int, ranks: int) -> str:
    """``0:B/4,E/3:B/2,2E/3:B`` for target ``B`` over ``E`` epochs (fewer doublings where ``E < 3`` or a
    smaller batch would not divide into the ranks)."""
    doublings = min(2, epochs - 1)
    while doublings and (target >> doublings) % ranks:
        doublings -= 1
    segments = doublings + 1
    return ",".join(f"{round(i * epochs / segments)}:{target >> (doublings - i)}" for i in range(segments))


def cells(args) -> list[dict]:
    """Every run of the study, in the order they run: seed, then batch, then method."""
    out = []
    for seed in args.seeds:
        for batch in args.batches:
            for method in args.methods:
                base = {"method": method, "global_batch": batch, "seed": seed, "epochs": args.epochs,
                        "train_images": args.train_images, "ranks": args.ranks}
                if args.warmup != WARMUP:  # a cell of its own (cells at the default carry no key, as before)
                    base["warmup"] = args.warmup
                if method in SWEEP:
                    if batch != max(args.batches):
                        continue
                    optimizer, grid = SWEEP[method]
                    for factor in args.grid or grid:
                        lr, base_batch = {"nesterov": (args.sgd_lr * factor, 256), "adam": (factor, batch),
                                          "lars": (args.lars_lr * factor, 256)}[optimizer]
                        out.append(base | {"optimizer": optimizer, "lr": lr, "base_batch": base_batch,
                                           "batch_schedule": f"0:{batch}",
                                           "trust": args.trust if optimizer == "lars" else None})
                    continue
                if method == "sgd":
                    out.append(base | {"optimizer": "sgd", "lr": args.sgd_lr, "base_batch": 256,
                                       "batch_schedule": f"0:{batch}", "trust": None})
                elif method == "lars":
                    out.append(base | {"optimizer": "lars", "lr": args.lars_lr, "base_batch": 256,
                                       "batch_schedule": f"0:{batch}", "trust": args.trust})
                else:  # lars-bsc: the rate is lars' peak where the batch reaches the target, less before
                    out.append(base | {"optimizer": "lars", "lr": args.lars_lr * batch / 256, "base_batch": batch,
                                       "batch_schedule": batch_schedule(batch, args.epochs, args.ranks),
                                       "trust": args.trust})
    return out


def key(cell: dict) -> str:
    return json.dumps({k: cell[k] for k in sorted(cell)}, sort_keys=True)


def command(cell: dict, args, summary: Path) -> list[str]:
    warmup = max(cell.get("warmup", WARMUP) * cell["epochs"], 1e-3)
    cmd = [str(BIN / "mpiexec"), "-n", str(cell["ranks"]), str(BIN / "torus-train"), "--data", args.data,
           "--model", "resnet20", "--epochs", str(cell["epochs"]), "--batch-schedule", cell["batch_schedule"],
           "--optimizer", cell["optimizer"], "--lr", f"{cell['lr']:g}", "--base-batch", str(cell["base_batch"]),
           "--warmup-epochs", f"{warmup:g}", "--momentum", "0.9", "--weight-decay", f"{args.weight_decay:g}",
           "--label-smoothing", "0", "--seed", str(cell["seed"]), "--verbose", "0", "--summary", str(summary)]
    if cell["trust"] is not None:
        cmd += ["--trust", f"{cell['trust']:g}"]
    if cell["train_images"]:
        cmd += ["--train-images", str(cell["train_images"])]
    return cmd


def run_cells(args) -> None:
    done = set()
    if args.out.exists():
        done = {key(json.loads(line)["cell"]) for line in args.out.read_text().splitlines() if line.strip()}
    todo = [c for c in cells(args) if key(c) not in done]
    print(f"{len(todo)} cells to run, {len(done)} already in {args.out}", flush=True)
    for i, cell in enumerate(todo, 1):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = command(cell, args, Path(tmp) / "summary.json")
            if args.dry_run:
                print(" ".join(cmd))
                continue
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            record = {"cell": cell, "command": " ".join(cmd[:-2]), "wall_s": round(time.perf_counter() - t0, 1),
                      "returncode": proc.returncode}
            if proc.returncode == 0:
                summary = json.loads((Path(tmp) / "summary.json").read_text())
                record["summary"] = summary
                result = f"test top-1 {summary['val_top1']:.4f}"
            else:  # kept (a diverged or failed run is a result), its output's tail with it
                record["error"] = (proc.stdout + proc.stderr)[-2000:]
                result = f"FAILED (exit {proc.returncode})"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[{i}/{len(todo)}] {cell['method']} batch {cell['global_batch']} seed {cell['seed']} lr "
              f"{cell['lr']:g}: {result} in {record['wall_s']:.0f} s", flush=True)


def _label(method: tuple) -> str:
    """A table's name for a (method, warm-up or None) key."""
    name, warmup = method
    return name if warmup is None else f"{name} (warm-up {warmup:g})"


def _order(key: tuple) -> tuple:
    """Sort key of a table key whose first item is (method, warm-up or None): by name, the default warm-up
    first, then the rest of the key."""
    (name, warmup), *rest = key
    return (name, warmup is not None, warmup or 0.0, *rest)


def report(args) -> None:
    """The table (stdout and ``<out>.md``) from every line of ``--out``; the plot (``--plot``, by default
    ``<out>.png``) from the lines of one budget (``--epochs``, ``--train-images``, ``--ranks``)."""
    records = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
    groups: dict = {}
    for r in records:
        c = r["cell"]
        acc = r["summary"]["val_top1"] if r.get("summary") else float("nan")
        # a non-default warm-up is a row of its own, but still its method's (a sweep stays a sweep)
        method = (c["method"], c.get("warmup"))
        peak = c["lr"] * c["global_batch"] / c["base_batch"]  # at the (final) global batch
        budget = (c["epochs"], c["train_images"], c["ranks"])
        groups.setdefault((method, c["global_batch"], peak, budget), []).append(acc)
    best: dict = {}  # (method, batch, budget) -> (mean, spread, n, lr): a sweep keeps its best rate
    for (method, batch, lr, budget), accs in groups.items():
        mean = statistics.fmean(accs)
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        k = (method, batch, budget)
        if k not in best or mean > best[k][0] or math.isnan(best[k][0]):
            best[k] = (mean, spread, len(accs), lr)
    lines = ["| method | global batch | epochs | train images | ranks | test top-1 (mean ± sd) | seeds | peak rate |",
             "|---|---|---|---|---|---|---|---|"]
    rows = sorted(best.items(), key=lambda kv: _order(kv[0]))
    for (method, batch, (epochs, images, ranks)), (mean, spread, n, lr) in rows:
        lines.append(f"| {_label(method)} | {batch} | {epochs} | {images or 'all'} | {ranks} | {mean:.4f} ± "
                     f"{spread:.4f} | {n} | {lr:.4g} |")
    swept = [((m, b, bud, lr), statistics.fmean(accs), len(accs)) for (m, b, lr, bud), accs in groups.items()
             if m[0] in SWEEP]
    if swept:  # every rate a sweep tried, not only its best
        head = "| sweep | global batch | epochs | train images | ranks | peak rate | test top-1 (mean) | seeds |"
        lines += ["", head, "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {_label(m)} | {b} | {e} | {i or 'all'} | {r} | {lr:.4g} | {acc:.4f} | {n} |"
                  for (m, b, (e, i, r), lr), acc, n in sorted(swept, key=lambda x: _order(x[0]))]
    table = "\n".join(lines)
    print(table)
    args.out.with_suffix(".md").write_text(table + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    budget = (args.epochs, args.train_images, args.ranks)  # the plot shows this budget's cells only
    for method in METHODS:
        points = sorted((b, m, s) for (meth, b, bud), (m, s, _, _) in best.items()
                        if meth == (method, None) and bud == budget)
        if points:
            xs, ys, es = zip(*points)
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=method)
    small = min((b for (m, b, bud) in best if m == ("sgd", None) and bud == budget), default=None)
    if small is not None:  # the target: within 1 point of the small-batch baseline
        base = best[(("sgd", None), small, budget)][0]
        ax.axhline(base - 0.01, color="grey", linestyle=":", label=f"1 point below sgd at {small}")
    ax.set_xscale("log", base=2)
    shown = sorted({b for (_, b, bud) in best if bud == budget})
    ax.set_xticks(shown, [str(b) for b in shown])
    ax.set_xlabel("global batch")
    ax.set_ylabel("test top-1 (Fashion-MNIST, 10,000 images)")
    ax.set_title(f"ResNet-20, {args.epochs} epochs" + (f" of {args.train_images} images" if args.train_images
                                                        else "") + f", {args.ranks} ranks")
    ax.legend()
    fig.tight_layout()
    plot = args.plot or args.out.with_suffix(".png")
    fig.savefig(plot, dpi=120)
    print(f"table: {args.out.with_suffix('.md')}, plot: {plot}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/large_batch/results/study.jsonl"))
    ap.add_argument("--batches", default="128,512,2048,8192", help="global batches (16384 optional)")
    ap.add_argument("--methods", default="sgd,lars,lars-bsc,nesterov-sweep", help=f"from {', '.join(METHODS)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=10, help="the budget of every run (README.md: its cost)")
    ap.add_argument("--train-images", type=int, help="train on this many images (smoke tests; default all)")
    ap.add_argument("--warmup", type=float, default=WARMUP, help="warm-up as a fraction of the epochs")
    ap.add_argument("--sgd-lr", type=float, default=0.1, help="SGD's peak rate per 256 images (Goyal et al.)")
    ap.add_argument("--lars-lr", type=float, default=1.0, help="LARS' peak rate per 256 images")
    ap.add_argument("--trust", type=float, default=0.001, help="LARS trust coefficient (You et al.)")
    ap.add_argument("--weight-decay", type=float, default=1e-4, help="He et al. 2016's, for every method")
    ap.add_argument("--grid", help="a sweep's factors (or Adam's peaks) instead of its default grid, e.g. "
                    "0.0625,0.125")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--data", default="fashion-mnist")
    ap.add_argument("--dry-run", action="store_true", help="print the commands of the cells still to run")
    ap.add_argument("--report", action="store_true", help="only the table and the plot from --out")
    ap.add_argument("--plot", type=Path, help="where the plot goes (default: --out with .png); it shows the cells "
                    "of --epochs, --train-images and --ranks only")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.methods = args.methods.split(",")
    args.grid = [float(g) for g in args.grid.split(",")] if args.grid else None
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown method(s) {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}")
    if not args.report:
        run_cells(args)
    if not args.dry_run and args.out.exists():
        report(args)


if __name__ == "__main__":
    main()
