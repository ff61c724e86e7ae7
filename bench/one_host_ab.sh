#!/bin/bash
# Two source trees side by side on one host: bench/overlap/one_host_step.py under mpiexec, alternating A and B for ROUNDS.
#   bench/one_host_ab.sh OLD_TREE NEW_TREE [ROUNDS] [mpiexec -n] [one_host_step.py args...] >> results.jsonl
# Each tree must have its extensions built in place (python setup.py build_ext --inplace).
set -euo pipefail
a=$1 b=$2 rounds=${3:-4} n=${4:-2}
shift $(( $# < 4 ? $# : 4 ))
here=$(cd "$(dirname "$0")" && pwd)
for ((r = 0; r < rounds; r++)); do
    for tree in "$a" "$b"; do
        PYTHONPATH=$tree mpiexec -n "$n" python "$here/overlap/one_host_step.py" "$@"
    done
done
