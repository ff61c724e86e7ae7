#!/bin/bash
# The large-batch study at 15 epochs: does the gap at 8192 close with three times the steps (README.md, "Still
# to run")? Resumable like run_5_epochs.sh, and run the same way, from a copy of the tree:
#   cd /tmp/lb-tree && PYTHONPATH=$PWD bench/large_batch/run_15_epochs.sh OUT
# OUT: where the lines go (default bench/large_batch/results/study.jsonl of this tree).
set -u
cd "$(dirname "$0")/../.."
out=${1:-bench/large_batch/results/study.jsonl}
run() { nice -n 10 .venv/bin/python bench/large_batch/study.py --epochs 15 --out "$out" "$@"; }
run --batches 8192 --methods lars-bsc --seeds 0
run --batches 8192 --methods nesterov-sweep --grid 0.03125 --seeds 0
run --batches 128 --methods sgd --seeds 0
run --batches 8192 --methods sgd --seeds 0  # does SGD still fall 3 points short with the steps?
run --batches 8192 --methods lars-bsc --seeds 1
