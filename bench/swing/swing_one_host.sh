#!/bin/bash
# Swing against ring, torus2d and MPI's own all-reduce on one host: ROUNDS torus-bench sweeps of one collective,
# every algorithm timed side by side within each iteration (torus-bench shuffles their order per iteration);
# one JSON per round, the load average beside it.
#   bench/swing/swing_one_host.sh OUT_PREFIX RANKS ROUNDS [torus-bench args...]
# e.g. bench/swing/swing_one_host.sh bench/swing/results/swing_allreduce_p4 4 3 allreduce -b 4K -e 64M -f 4 -n 20 -w 3
set -euo pipefail
prefix=$1 n=$2 rounds=$3
shift 3
for ((r = 1; r <= rounds; r++)); do
    echo "# round $r $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$prefix.txt"
    mpiexec -n "$n" torus-bench "$@" --json "${prefix}_r$r.json" >> "$prefix.txt"
done
