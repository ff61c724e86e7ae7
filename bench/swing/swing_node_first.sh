#!/bin/bash
# Swing with the grid axis inside the nodes first (this tree) against the axes in turn (a worktree of c2dab40,
# the commit before, with this tree's built extensions copied in), alternating rounds on emulated hosts:
# 4 hosts x 2 ranks dealt round robin (columns are the hosts' ranks) and 2 hosts x 4 ranks in blocks; torus2d,
# ring and native in every run. Needs root (tests/cluster). Results: bench/swing/results/swing_node_first*;
# bench/README.md, "Swing".
#   git worktree add /tmp/wt-old c2dab40 && cp torus/_ext/*.so /tmp/wt-old/torus/_ext/
#   OLD_TREE=/tmp/wt-old bench/swing/swing_node_first.sh OUT [RATES="1gbit 4gbit"] [ROUNDS=2]
set -u
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/swing_node_first}; RATES=${2:-"1gbit 4gbit"}; ROUNDS=${ROUNDS:-2}; OLD_TREE=${OLD_TREE:?a worktree}
mkdir -p "$OUT"
for rate in $RATES; do
  python -m tests.cluster --name nf up 4 --rate "$rate" --subnet 25 > /dev/null || exit 1
  for cfg in "2 8 --round-robin rr4x2" "4 8 - blk2x4"; do
    set -- $cfg; ppn=$1; n=$2; rr=$3; tag=$4; [ "$rr" = - ] && rr=""
    for round in $(seq "$ROUNDS"); do
      for side in new old; do
        bench=(torus-bench); [ $side = old ] && bench=("$PWD/.venv/bin/python" "$PWD/bench/old_tree.py" torus-bench)
        echo "== $rate $tag $side r$round $(date +%T)"
        python -m tests.cluster --name nf run --ppn "$ppn" $rr -- -genv OLD_TREE "$OLD_TREE" -n "$n" "${bench[@]}" allreduce -b 1M -e 64M -f 4 \
          -n 5 -w 1 --algo swing,torus2d,ring,native --json "$OUT/${tag}_${rate}_${side}_r$round.json" \
          > "$OUT/${tag}_${rate}_${side}_r$round.txt" 2>&1
        echo "   rc=$?"
      done
    done
  done
  python -m tests.cluster --name nf down > /dev/null
done
for f in "$OUT"/*_new_r1.json; do
  t=$(basename "$f" _new_r1.json)
  for side in new old; do echo "## $t, swing $side"; python bench/swing/swing_table.py "$OUT/${t}_${side}"_r*.json; done
done > "$OUT/table.txt"
