#!/usr/bin/env python
"""Per size and placement: the median over rounds of each algorithm's median time (torus-bench --json files of
bench/swing/swing_one_host.sh or of the same sweep across hosts), and swing's time over each other algorithm's.

    python bench/swing/swing_table.py bench/swing/results/swing_allreduce_p4_r*.json
"""
from __future__ import annotations

import json
import statistics
import sys


def main(paths: list[str]) -> None:
    rounds = [json.load(open(p))["results"] for p in paths]
    algos = list(dict.fromkeys(r["algorithm"] for r in rounds[0]))
    others = [a for a in algos if a != "swing"]
    print(f"# {len(paths)} rounds: {' '.join(paths)}")
    print("# median over rounds of each round's median time (us); swing/X = swing's time over X's "
          "(below 1: swing faster); spread = max/min of swing's per-round medians")
    print(f"{'size':>10} {'placement':>12} " + " ".join(f"{a:>10}" for a in algos) + " "
          + " ".join(f"{'swing/' + a:>14}" for a in others) + f" {'spread':>7}")
    for place in ("out_of_place", "in_place"):
        for size in dict.fromkeys(r["size"] for r in rounds[0]):
            t = {a: [next(r[place]["time_us"] for r in rs if r["algorithm"] == a and r["size"] == size)
                     for rs in rounds] for a in algos}
            med = {a: statistics.median(v) for a, v in t.items()}
            spread = max(t["swing"]) / min(t["swing"])
            print(f"{size:>10} {place:>12} " + " ".join(f"{med[a]:>10.0f}" for a in algos) + " "
                  + " ".join(f"{med['swing'] / med[a]:>14.2f}" for a in others) + f" {spread:>7.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
