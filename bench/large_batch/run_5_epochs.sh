#!/bin/bash
# The large-batch study at 5 epochs, the cells that test the claim first (README.md, "Runs"). Resumable: a cell
# already in the results is skipped. Run it from a copy of the tree (the study takes hours, and a checkout being
# edited would change the code under it), e.g.
#   mkdir /tmp/lb-tree && tar --exclude=.venv --exclude=.git -cf - . | tar -xf - -C /tmp/lb-tree
#   ln -s $PWD/.venv /tmp/lb-tree/.venv && cd /tmp/lb-tree && PYTHONPATH=$PWD bench/large_batch/run_5_epochs.sh OUT
# OUT: where the lines go (default bench/large_batch/results/study.jsonl of this tree).
set -u
cd "$(dirname "$0")/../.."
out=${1:-bench/large_batch/results/study.jsonl}
run() { nice -n 10 .venv/bin/python bench/large_batch/study.py --epochs 5 --out "$out" "$@"; }
run --batches 128 --methods sgd --seeds 0
run --batches 8192 --methods sgd,lars-bsc,lars --seeds 0
run --batches 2048 --methods sgd,lars,lars-bsc --seeds 0
run --batches 512 --methods sgd,lars,lars-bsc --seeds 0
run --batches 8192 --methods lars-bsc --seeds 1
run --batches 8192 --methods lars-sweep --seeds 0
run --batches 8192 --methods nesterov-sweep --grid 0.25 --seeds 0
run --batches 8192 --methods nesterov-sweep --grid 0.0625,0.125 --seeds 0
run --batches 2048 --methods sgd,lars-bsc --seeds 1
run --batches 8192 --methods nesterov-sweep --grid 0.03125 --seeds 0
run --batches 2048 --methods lars-bsc --seeds 0 --ranks 1
run --batches 512 --methods lars-bsc --seeds 0
run --batches 8192 --methods nesterov-sweep --grid 0.015625 --seeds 0
run --batches 8192 --methods lars --warmup 0.417 --seeds 0  # the warm-up in steps of lars-bsc at 8192 (14.6)
run --batches 128 --methods sgd --seeds 1
run --batches 8192 --methods sgd,lars --seeds 1
run --batches 128 --methods lars,lars-bsc --seeds 0
run --batches 512 --methods sgd --seeds 0 --ranks 1
run --batches 8192 --methods nesterov-sweep --grid 0.03125 --seeds 1
run --batches 2048 --methods lars --seeds 1
run --batches 8192 --methods lars-bsc --seeds 0 --ranks 1
