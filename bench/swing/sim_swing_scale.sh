#!/bin/bash
# torus-sim at the paper grids (Mikami et al.: 1,088 = 16x68, 2,176 = 32x68) and at 64x64: ring, torus2d and
# swing all-reduce at 64 KiB, 4 MiB and 100 MiB, 4 ranks per node, the costs of bench/sim_validate/results/sim_paper.txt;
# once with each message owning its link (--no-shared-links) and once with a node's link shared (the default).
#   bench/swing/sim_swing_scale.sh > bench/swing/results/sim_swing_scale.txt
set -euo pipefail
# swing's latency-optimal form up to 8 KiB, the limit these results were made with: the default limit is 96 us
# on the link (torus/schedules/build.py), measured where a message costs tens of us; at 5 us per message and
# 12.5 GB/s it would give 1.2 MB, where this model prices that form up to 2.4x slower at 64 KiB on a torus
# network (bench/swing/results/sim_swing_latency.txt).
export TORUS_SWING_LATENCY_BYTES=8192
cost="--alpha 1e-6 --beta 2e-11 --gamma 3.3e-12 --ranks-per-node 4 --inter-alpha 5e-6 --inter-beta 8e-11"
for links in "--no-shared-links" "--shared-links"; do
    for grid in 1088:16x68 2176:32x68 4096:64x64; do
        cmd="torus-sim --ranks ${grid%%:*} --dims ${grid##*:} --algo ring,torus2d,swing --nbytes 64K,4M,100M $cost $links"
        echo "\$ $cmd"
        $cmd
    done
done
