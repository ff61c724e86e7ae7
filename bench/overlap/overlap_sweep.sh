#!/bin/bash
# The overlap table (bench/overlap/README.md, "Overlap"): bench/overlap/overlap.py on emulated hosts, 2 x 1 and 2 x 2 ranks,
# at 1 Gbit/s, 4 Gbit/s and unshaped links; ResNet-50, the VGG-like CNN, the MLP, and ResNet-50 with fp16
# compression at 1 Gbit/s. Each configuration alternates overlap on / off / compute alone / all-reduce alone
# per round.
# Appends one JSON line per configuration to $1 (default bench/overlap/results/overlap.jsonl). As root (namespaces).
#   bench/overlap/overlap_sweep.sh bench/overlap/results/overlap.jsonl
# RATES="1gbit" and PPNS="2" narrow the sweep (defaults: "1gbit 4gbit none", "1 2"); MODELS (default
# "resnet50 cnn mlp") the models, FP16 (default "resnet50") those also run with fp16 at 1 Gbit/s, ROUNDS
# (default 3) the rounds per configuration; EXTRA more arguments of overlap.py (e.g. "--inter-op 1").
set -u
cd "$(dirname "$0")/../.."
out=${1:-bench/overlap/results/overlap.jsonl}
py=.venv/bin/python
export PATH=$PWD/.venv/bin:$PATH
name=ovlsweep
for rate in ${RATES:-1gbit 4gbit none}; do
    $py -m tests.cluster --name $name down >/dev/null 2>&1
    if [ "$rate" = none ]; then $py -m tests.cluster --name $name up 2 --subnet 22 >/dev/null
    else $py -m tests.cluster --name $name up 2 --rate "$rate" --subnet 22 >/dev/null; fi
    for ppn in ${PPNS:-1 2}; do
        runs=()
        for model in ${MODELS:-resnet50 cnn mlp}; do runs+=("--model $model"); done
        if [ "$rate" = 1gbit ]; then
            for model in ${FP16-resnet50}; do runs+=("--model $model --compression fp16"); done
        fi
        for run in "${runs[@]}"; do
            line=$(timeout 1200 $py -m tests.cluster --name $name run --ppn $ppn -- -n $((2 * ppn)) \
                   $py bench/overlap/overlap.py $run --rounds ${ROUNDS:-3} --steps 4 ${EXTRA:-} 2>&1 | grep '"step_s"' | tail -1)
            [ -n "$line" ] || { echo "rate $rate ppn $ppn $run: no result" >&2; continue; }
            echo "$line" | $py -c "import json, sys; r = json.loads(sys.stdin.read()); r['rate'] = '$rate'; \
r['hosts'] = 2; r['ranks_per_host'] = $ppn; print(json.dumps(r))" | tee -a "$out" | cut -c1-160
        done
    done
done
$py -m tests.cluster --name $name down >/dev/null 2>&1
