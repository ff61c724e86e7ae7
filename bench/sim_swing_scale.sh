#!/bin/bash
# torus-sim at the paper grids (Mikami et al.: 1,088 = 16x68, 2,176 = 32x68) and at 64x64: ring, torus2d and
# swing all-reduce at 64 KiB, 4 MiB and 100 MiB, 4 ranks per node, the costs of bench/results/sim_paper.txt;
# once with each message owning its link (--no-shared-links) and once with a node's link shared (the default).
#   bench/sim_swing_scale.sh > bench/results/sim_swing_scale.txt
set -euo pipefail
cost="--alpha 1e-6 --beta 2e-11 --gamma 3.3e-12 --ranks-per-node 4 --inter-alpha 5e-6 --inter-beta 8e-11"
for links in "--no-shared-links" "--shared-links"; do
    for grid in 1088:16x68 2176:32x68 4096:64x64; do
        cmd="torus-sim --ranks ${grid%%:*} --dims ${grid##*:} --algo ring,torus2d,swing --nbytes 64K,4M,100M $cost $links"
        echo "\$ $cmd"
        $cmd
    done
done
