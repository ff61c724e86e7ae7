#!/bin/bash
# torus-sim --fit, then --validate, on K emulated hosts (network namespaces, tc-shaped links): per rate, per
# ranks-per-host and placement. Needs root (tests/cluster). Writes OUT/fit_TAG.{json,txt}, OUT/val_TAG.{json,txt}.
#   bench/across_hosts/cluster_sim_validate.sh [HOSTS=4] [OUT=/tmp/cluster_sim] [RATES="1gbit 4gbit"]
# CFGS="1 blocks,2 blocks" picks configurations (comma-separated; default all three), MPIARGS adds mpiexec
# arguments (e.g. MPIARGS="-genv MPIR_CVAR_CH4_NETMOD ofi -genv FI_PROVIDER tcp"), TAG a suffix to the files.
# Results: bench/across_hosts/results/cluster_sim_validate_*.txt (bench/across_hosts/README.md, "torus-sim replays
# what runs across hosts").
set -u
cd "$(dirname "$0")/../.."
HOSTS=${1:-4}; OUT=${2:-/tmp/cluster_sim}; RATES=${3:-"1gbit 4gbit"}
mkdir -p "$OUT"
SIM=$PWD/.venv/bin/torus-sim
[ -x "$SIM" ] || SIM=$(command -v torus-sim)
for rate in $RATES; do
  python -m tests.cluster --name tv up "$HOSTS" --rate "$rate" --subnet 41 || exit 1
  cfgs=("1 blocks" "2 blocks" "2 round_robin")
  [ -n "${CFGS:-}" ] && IFS=, read -ra cfgs <<< "$CFGS"
  for cfg in "${cfgs[@]}"; do
    set -- $cfg; ppn=$1; pl=$2; n=$((HOSTS * ppn))
    rr=""; [ "$pl" = round_robin ] && rr=--round-robin
    tag=${HOSTS}x${ppn}_${rate}_${pl}${TAG:-}
    echo "== $tag $(date +%T)"
    launch=(python -m tests.cluster --name tv run --ppn "$ppn" $rr -- ${MPIARGS:-} -n "$n" "$SIM")
    "${launch[@]}" --fit --json "$OUT/fit_$tag.json" > "$OUT/fit_$tag.txt" 2>&1
    "${launch[@]}" --validate --params "$OUT/fit_$tag.json" \
      --nbytes 1M,4M,16M,64M --json "$OUT/val_$tag.json" > "$OUT/val_$tag.txt" 2>&1
    echo "   rc=$?"
  done
  python -m tests.cluster --name tv down
done
