#!/bin/bash
# torus-sim on TorusComm's own grid at 4 ranks per node (no --dims: 4 x N/4, the rows are the nodes) at 1,088,
# 2,176 and 4,096 ranks, the costs of bench/swing/sim_swing_scale.sh, a node's link shared (the default): ring,
# torus2d and swing with its node axis first (this tree), then swing with the axes in turn (OLD_TREE, a
# worktree of c2dab40: see bench/swing/swing_node_first.sh).
#   OLD_TREE=/tmp/wt-old bench/swing/sim_swing_node_first.sh > bench/swing/results/sim_swing_node_first.txt
set -euo pipefail
cd "$(dirname "$0")/../.."
export TORUS_SWING_LATENCY_BYTES=8192  # as bench/swing/sim_swing_scale.sh
cost="--alpha 1e-6 --beta 2e-11 --gamma 3.3e-12 --ranks-per-node 4 --inter-alpha 5e-6 --inter-beta 8e-11"
for ranks in 1088 2176 4096; do
    echo "\$ torus-sim --ranks $ranks --algo ring,torus2d,swing --nbytes 64K,4M,100M $cost"
    .venv/bin/torus-sim --ranks $ranks --algo ring,torus2d,swing --nbytes 64K,4M,100M $cost
    echo "\$ (swing with the axes in turn: $OLD_TREE) torus-sim --ranks $ranks --algo swing --nbytes 64K,4M,100M $cost"
    .venv/bin/python bench/harness/tree.py "$OLD_TREE" torus-sim --ranks $ranks --algo swing --nbytes 64K,4M,100M $cost
done
