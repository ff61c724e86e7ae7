#!/bin/bash
# torus-sim: Swing's two all-reduce forms at small sizes, at the paper grids (Mikami et al.: 1,088 = 16x68,
# 2,176 = 32x68) and 64x64, one rank per node on a star and on a 2D torus of nodes, beside torus2d, with the
# costs of bench/swing/sim_network_scale.sh. `swing` is run with TORUS_SWING_LATENCY_BYTES=-1 (the bandwidth-optimal
# form at every size), `swing_latency` is the latency-optimal one.
#   bench/swing/sim_swing_latency.sh > bench/swing/results/sim_swing_latency.txt
set -euo pipefail
cost="--alpha 1e-6 --beta 2e-11 --gamma 3.3e-12 --inter-alpha 5e-6 --inter-beta 8e-11"
for grid in 1088:16x68 2176:32x68 4096:64x64; do
    for net in star torus; do
        cmd="torus-sim --ranks ${grid%%:*} --dims ${grid##*:} --algo torus2d,swing,swing_latency --nbytes 1K,8K,64K,256K $cost --network $net"
        echo "\$ TORUS_SWING_LATENCY_BYTES=-1 $cmd"
        TORUS_SWING_LATENCY_BYTES=-1 $cmd
    done
done
