"""bench/large_batch/study.py: the cells it runs and the table it reports (issue 45), without training.

The cells are checked against the papers' rules written out here (a quarter of the target batch, doubling at the
thirds; LARS' peak per 256 images; a sweep's grid at the largest batch only), the table against means and
standard deviations computed here from random accuracies.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parents[1] / "bench" / "large_batch" / "study.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("large_batch_study", STUDY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def args(**kw) -> argparse.Namespace:
    base = dict(batches=[128, 8192], seeds=[0], methods=["sgd"], epochs=5, train_images=None, ranks=2,
                sgd_lr=0.1, lars_lr=1.0, trust=0.001, warmup=0.1, weight_decay=1e-4, data="fashion-mnist",
                grid=None, plot=None)
    return argparse.Namespace(**(base | kw))


@pytest.mark.parametrize("target,epochs,ranks,expected", [
    (8192, 5, 2, "0:2048,2:4096,3:8192"),  # thirds of 5 epochs round to 2 and 3
    (2048, 6, 2, "0:512,2:1024,4:2048"),
    (512, 2, 2, "0:256,1:512"),  # 2 epochs: one doubling
    (6, 9, 3, "0:3,4:6"),  # 6 >> 2 = 1 does not divide into 3 ranks: one doubling
    (10, 9, 4, "0:10"),  # neither 2 nor 5 divides into 4 ranks: no doubling
    (128, 1, 2, "0:128"),
])
def test_batch_size_control_starts_at_a_quarter_and_doubles_at_the_thirds(study, target, epochs, ranks, expected):
    assert study.batch_schedule(target, epochs, ranks) == expected


def test_the_sweeps_run_at_the_largest_batch_only_at_their_grid(study):
    cells = study.cells(args(methods=["lars-sweep", "nesterov-sweep", "lars-bsc"], lars_lr=1.0, sgd_lr=0.1))
    lars = [c for c in cells if c["method"] == "lars-sweep"]
    assert [(c["global_batch"], c["lr"], c["base_batch"], c["trust"]) for c in lars] == [
        (8192, 0.25, 256, 0.001), (8192, 0.5, 256, 0.001)]
    nesterov = [c for c in cells if c["method"] == "nesterov-sweep"]
    assert [c["lr"] * 8192 / c["base_batch"] for c in nesterov] == pytest.approx([0.8, 1.6, 3.2, 6.4, 12.8])
    bsc = [c for c in cells if c["method"] == "lars-bsc"]
    # the rate follows the batch: LARS' peak (1.0 per 256 images) once the batch reaches the target
    assert [(c["global_batch"], c["lr"] * c["global_batch"] / c["base_batch"]) for c in bsc] == [(128, 0.5),
                                                                                               (8192, 32.0)]


def test_grid_replaces_a_sweeps_factors_for_one_run(study):
    cells = study.cells(args(methods=["nesterov-sweep", "sgd"], grid=[0.03125]))
    assert [(c["method"], c["global_batch"], c["lr"]) for c in cells] == [
        ("sgd", 128, 0.1), ("nesterov-sweep", 8192, 0.1 * 0.03125), ("sgd", 8192, 0.1)]


def test_a_warmup_other_than_the_default_is_a_cell_of_its_own_with_its_warmup_epochs(study, tmp_path):
    default, longer = study.cells(args(methods=["lars"]))[1], study.cells(args(methods=["lars"], warmup=0.4))[1]
    assert "warmup" not in default and longer["warmup"] == 0.4 and study.key(default) != study.key(longer)
    cmd = study.command(longer, args(), tmp_path / "summary.json")
    assert cmd[cmd.index("--warmup-epochs") + 1] == "2"  # 0.4 of 5 epochs


def record(method, batch, seed, acc, ranks=2, lr=0.1, base=256, epochs=5, warmup=None):
    cell = dict(method=method, global_batch=batch, seed=seed, epochs=epochs, train_images=None, ranks=ranks,
                optimizer="sgd", lr=lr, base_batch=base, batch_schedule=f"0:{batch}", trust=None)
    if warmup is not None:
        cell["warmup"] = warmup
    return {"cell": cell, "returncode": 0, "summary": {"val_top1": acc}}


def test_the_table_is_mean_and_sd_over_seeds_per_rank_count_and_a_sweep_keeps_its_best_rate(study, tmp_path):
    rng = random.Random(7)
    two = [rng.uniform(0.8, 0.95) for _ in range(3)]
    one = rng.uniform(0.8, 0.95)
    sweep = {0.025: rng.uniform(0.1, 0.5), 0.05: rng.uniform(0.6, 0.9), 0.1: rng.uniform(0.1, 0.5)}
    lines = [record("sgd", 512, s, a) for s, a in enumerate(two)] + [record("sgd", 512, 0, one, ranks=1)]
    lines += [record("nesterov-sweep", 8192, 0, a, lr=lr) for lr, a in sweep.items()]
    out = tmp_path / "study.jsonl"
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    study.report(args(out=out))
    table = out.with_suffix(".md").read_text()
    assert f"| sgd | 512 | 5 | all | 2 | {statistics.fmean(two):.4f} ± {statistics.stdev(two):.4f} | 3 | 0.2 |" in table
    assert f"| sgd | 512 | 5 | all | 1 | {one:.4f} ± 0.0000 | 1 | 0.2 |" in table
    best = max(sweep, key=sweep.get)
    assert f"| nesterov-sweep | 8192 | 5 | all | 2 | {sweep[best]:.4f} ± 0.0000 | 1 | {best * 32:.4g} |" in table
    for lr, acc in sweep.items():  # every rate tried, in the second table
        assert f"| nesterov-sweep | 8192 | 5 | all | 2 | {lr * 32:.4g} | {acc:.4f} | 1 |" in table
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_sweep_at_another_warmup_or_budget_is_still_a_sweep_with_rows_of_its_own(study, tmp_path):
    rng = random.Random(11)
    five, fifteen, warm = (rng.uniform(0.1, 0.9) for _ in range(3))
    lines = [record("nesterov-sweep", 8192, 0, five, lr=0.003125), record("nesterov-sweep", 8192, 0, fifteen,
                                                                          lr=0.003125, epochs=15),
             record("nesterov-sweep", 8192, 0, warm, lr=0.003125, warmup=0.4)]
    out = tmp_path / "study.jsonl"
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    study.report(args(out=out))
    sweeps = out.with_suffix(".md").read_text().split("| sweep |")[1]
    assert f"| nesterov-sweep | 8192 | 5 | all | 2 | 0.1 | {five:.4f} | 1 |" in sweeps
    assert f"| nesterov-sweep | 8192 | 15 | all | 2 | 0.1 | {fifteen:.4f} | 1 |" in sweeps
    assert f"| nesterov-sweep (warm-up 0.4) | 8192 | 5 | all | 2 | 0.1 | {warm:.4f} | 1 |" in sweeps


def test_plot_puts_one_budgets_plot_beside_the_default_one(study, tmp_path):
    lines = [record("sgd", 128, 0, 0.9), record("sgd", 128, 0, 0.92, epochs=15)]
    out = tmp_path / "study.jsonl"
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    study.report(args(out=out, epochs=15, plot=tmp_path / "fifteen.png"))
    assert (tmp_path / "fifteen.png").stat().st_size > 0 and not out.with_suffix(".png").exists()
    assert "| sgd | 128 | 15 | all | 2 | 0.9200 ± 0.0000 | 1 | 0.05 |" in out.with_suffix(".md").read_text()
