#!/bin/bash
# torus-sim on three networks (sim/network.py): star (one non-blocking switch), a 2D torus of nodes laid out as
# the rank grid (dimension-order routing) and a fat tree with 3:1 tapered leaves of 32 nodes; one rank per node
# (as Swing's evaluation, De Sensi et al. NSDI'24), ring / torus2d / swing all-reduce at the paper grids
# (Mikami et al.: 1,088 = 16x68, 2,176 = 32x68) and at 64x64; 64 KiB, 4 MiB, 100 MiB; link 12.5 GB/s
# (inter-beta 8e-11 s/B), 5 us per message, reduction 3.3e-12 s/B (the costs of bench/swing/sim_swing_scale.sh).
#   bench/swing/sim_network_scale.sh > bench/swing/results/sim_network_scale.txt
set -euo pipefail
# swing's latency-optimal form up to 8 KiB, the limit these results were made with: the default limit is 96 us
# on the link (torus/schedules/build.py), measured where a message costs tens of us; at 5 us per message and
# 12.5 GB/s it would give 1.2 MB, where this model prices that form up to 2.4x slower at 64 KiB on a torus
# network (bench/swing/results/sim_swing_latency.txt).
export TORUS_SWING_LATENCY_BYTES=8192
cost="--alpha 1e-6 --beta 2e-11 --gamma 3.3e-12 --inter-alpha 5e-6 --inter-beta 8e-11"
for grid in 1088:16x68 2176:32x68 4096:64x64; do
    for net in star torus fattree:32:3; do
        cmd="torus-sim --ranks ${grid%%:*} --dims ${grid##*:} --algo ring,torus2d,swing --nbytes 64K,4M,100M $cost --network $net"
        echo "\$ $cmd"
        $cmd
    done
done
