#!/bin/bash
# The bucket cap (bench/overlap/README.md, "The bucket cap"): bench/overlap/overlap.py on 2 emulated hosts, every cap of
# $CAPS_RESNET50 / $CAPS_MLP alternated with overlap off, compute alone and the all-reduce alone in each round (one
# process: the train function traced once per cap); MODELS and ROUNDS narrow it; GROWTHS (e.g. "2,inf") also
# alternates the buckets' ramp (bench/overlap/README.md, "The bucket ramp"). Appends one JSON line per model to $1
# (default bench/overlap/results/bucket_sweep.jsonl). As root (namespaces).
#   bench/overlap/bucket_sweep.sh bench/overlap/results/bucket_sweep.jsonl [rate] [ranks per host]
#   CAPS_RESNET50=25M GROWTHS=2,4,inf MODELS=resnet50 ROUNDS=5 bench/overlap/bucket_sweep.sh OUT 1gbit 1
set -u
cd "$(dirname "$0")/../.."
out=${1:-bench/overlap/results/bucket_sweep.jsonl}
rate=${2:-1gbit}
ppn=${3:-1}
py=.venv/bin/python
export PATH=$PWD/.venv/bin:$PATH
name=bktsweep
$py -m tests.cluster --name $name down >/dev/null 2>&1
$py -m tests.cluster --name $name up 2 --rate "$rate" --subnet 23 >/dev/null || exit 1
declare -A caps=([resnet50]=${CAPS_RESNET50:-4M,8M,16M,25M,64M} [mlp]=${CAPS_MLP:-1M,2M,4M,25M}
                [cnn]=${CAPS_CNN:-25M})
for model in ${MODELS:-resnet50 mlp}; do
    line=$(timeout 1800 $py -m tests.cluster --name $name run --ppn "$ppn" -- -n $((2 * ppn)) \
           $py bench/overlap/overlap.py --model "$model" --bucket-bytes "${caps[$model]}" --rounds "${ROUNDS:-3}" \
           ${GROWTHS:+--bucket-growth "$GROWTHS"} --steps 4 2>&1 | grep '"step_s"' | tail -1)
    [ -n "$line" ] || { echo "$model: no result" >&2; continue; }
    echo "$line" | $py -c "import json, sys; r = json.loads(sys.stdin.read()); r['rate'] = '$rate'; \
r['hosts'] = 2; r['ranks_per_host'] = $ppn; print(json.dumps(r))" | tee -a "$out" | cut -c1-200
done
$py -m tests.cluster --name $name down >/dev/null 2>&1
