#!/bin/bash
# Swing with the grid axis inside the nodes first (this tree) against the axes in turn (a worktree of c2dab40,
# the commit before, with this tree's built extensions copied in), alternating rounds on emulated hosts:
# 4 hosts x 2 ranks dealt round robin (columns are the hosts' ranks) and 2 hosts x 4 ranks in blocks; torus2d,
# ring and native in every run. Needs root (tests/cluster). The A/B is bench/harness/ab.py's (the order of the
# two trees flips every round); this script brings up the hosts and makes the tables. Results:
# bench/swing/results/swing_node_first/ (bench/swing/README.md, "The node axis first").
#   git worktree add /tmp/wt-old c2dab40 && cp torus/_ext/*.so /tmp/wt-old/torus/_ext/
#   OLD_TREE=/tmp/wt-old bench/swing/swing_node_first.sh OUT [RATES="1gbit 4gbit"] [ROUNDS=2]
set -u
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/swing_node_first}; RATES=${2:-"1gbit 4gbit"}; ROUNDS=${ROUNDS:-2}; OLD_TREE=${OLD_TREE:?a worktree}
mkdir -p "$OUT"
: > "$OUT/table.txt"
for rate in $RATES; do
  python -m tests.cluster --name nf up 4 --rate "$rate" --subnet 25 > /dev/null || exit 1
  for cfg in "2 8 --round-robin rr4x2" "4 8 - blk2x4"; do
    set -- $cfg; ppn=$1; n=$2; rr=$3; tag=${4}_$rate; [ "$rr" = - ] && rr=""
    echo "== $tag $(date +%T)"
    python bench/harness/ab.py --a "$OLD_TREE" --b . --labels old,new --ranks "$n" --rounds "$ROUNDS" \
      --launch "python -m tests.cluster --name nf run --ppn $ppn $rr -- -n {ranks}" --keep "$OUT" --tag "$tag" \
      -- torus-bench allreduce -b 1M -e 64M -f 4 -n 5 -w 1 --algo swing,torus2d,ring,native > "$OUT/${tag}_ab.txt"
    echo "   rc=$?"
    for side in new old; do
      echo "## $tag, swing $side"; python bench/swing/swing_table.py "$OUT/${tag}_${side}"_p*_r*.json
    done >> "$OUT/table.txt"
  done
  python -m tests.cluster --name nf down > /dev/null
done
