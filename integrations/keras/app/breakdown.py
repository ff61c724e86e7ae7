"""Where the train steps of a ``TORUS_TIMELINE`` trace went (trace.py's lanes), per rank, without TensorFlow:

    python -m torus.integrations.keras.app.breakdown trace.json
"""
from __future__ import annotations


def breakdown(trace: dict, fit: int | None = None) -> dict:
    """Per rank, where its median train step went, in seconds (of its train steps, all but each fit's first,
    which may trace; only those of fit number ``fit`` where given: the step spans' ``fit`` arg), from a merged
    trace (``torus.timeline`` format, trace.py's lanes). The median step is the one of median length (the lower
    of the two middle ones for an even count), and every part below is that step's, so the parts add up to
    its length and none is negative (medians of each part taken apart need not: they can come from different
    steps):

    - ``backprop``: the step's start to its last bucket start (forward, backward and the bucket copies: the
      compute before the last gradient exists), less the waits and metric all-reduces in that time;
    - ``exposed``: the time in bucket waits (communication the step did not hide);
    - ``metric``: the time in metric all-reduces, outside waits;
    - ``other``: the rest (the optimizer update, input, Keras and callbacks), so the four add up to ``step``;
    - ``comm``: the buckets' time on the communication thread, and ``hidden`` = 1 - exposed / comm (at least 0: a
      wait also costs its own call, which can exceed a tiny bucket's all-reduce).

    Steps without buckets (overlap off) count the fused all-reduces as ``exposed`` and ``backprop`` as the
    time before the first. A ``train step`` span is one call of the train function: with
    ``steps_per_execution=K`` it holds K steps, and so do its parts. Returns ``{rank: {name: seconds}}``."""

    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    out = {}
    for rank in sorted({e["pid"] for e in spans}):
        mine = sorted((e for e in spans if e["pid"] == rank), key=lambda e: e["ts"])
        rows = []
        steps, seen = [], set()
        for e in mine:
            number = (e.get("args") or {}).get("fit", 0)
            if e["name"] == "train step" and (fit is None or number == fit):
                if number in seen:
                    steps.append(e)
                seen.add(number)
        for step in steps:
            t0, t1 = step["ts"], step["ts"] + step["dur"]
            inside = [e for e in mine if t0 <= e["ts"] < t1 and e is not step]
            starts = [e for e in inside if e["name"].endswith(" start") and "bucket" in e["name"]]
            waits = [e for e in inside if e["name"].endswith(" wait") and "bucket" in e["name"]]
            fused = [e for e in inside if e["name"] == "allreduce"]
            metrics = [e for e in inside if e["name"] == "metric allreduce"]
            comm = sum(e["dur"] for e in inside if e["name"].endswith(" allreduce") and "bucket" in e["name"])
            blocked = waits if starts else fused
            if starts:
                end = max(e["ts"] + e["dur"] for e in starts)
            else:
                end = fused[0]["ts"] if fused else t1
                comm = sum(e["dur"] for e in fused)
            exposed = _covered(blocked, t0, t1)
            metric = _covered(blocked + metrics, t0, t1) - exposed
            backprop = end - t0 - _covered(blocked + metrics, t0, end)
            rows.append((step["dur"], backprop, exposed, metric, comm))
        if not rows:
            continue
        middle = sorted(rows, key=lambda r: r[0])[(len(rows) - 1) // 2]
        step_s, backprop, exposed, metric, comm = (float(c) / 1e6 for c in middle)
        out[rank] = {"steps": len(rows), "step": step_s, "backprop": backprop, "exposed": exposed,
                     "metric": metric, "other": step_s - backprop - exposed - metric, "comm": comm,
                     "hidden": max(0.0, 1 - exposed / comm) if comm > 0 else None}
    return out


def _covered(spans: list, lo: float, hi: float) -> float:
    """The time in [lo, hi] that at least one of ``spans`` covers (overlapping spans counted once)."""
    total, reach = 0.0, lo
    for a, b in sorted((max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])) for e in spans):
        if b > max(a, reach):
            total += b - max(a, reach)
            reach = b
    return total


def main(argv=None) -> int:
    """``python -m torus.integrations.keras.app.breakdown FILE``: the step breakdown of a TORUS_TIMELINE trace."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m torus.integrations.keras.app.breakdown",
                                description="Where the train steps of a TORUS_TIMELINE trace went, per rank.")
    p.add_argument("trace", metavar="FILE")
    p.add_argument("--fit", type=int, help="only the steps of this fit (0: the script's first fit)")
    args = p.parse_args(argv)
    with open(args.trace) as f:
        rows = breakdown(json.load(f), args.fit)
    if not rows:
        which = "" if args.fit is None else f" of fit {args.fit}"
        print(f"{args.trace}: no 'train step' spans{which} (fit records them; a custom loop adds its own with "
              "strategy.timeline.span('train step', 'step', t0, t1))", file=sys.stderr)
        return 1
    print("each rank's median train step (after each fit's first, which may trace) and its parts")
    print("rank  steps   step_s  backprop  exposed   metric    other     comm  hidden")
    for rank, r in rows.items():
        hidden = "" if r["hidden"] is None else f"{r['hidden']:6.0%}"
        print(f"{rank:4d} {r['steps']:6d} {r['step']:8.3f} {r['backprop']:9.3f} {r['exposed']:8.3f} "
              f"{r['metric']:8.3f} {r['other']:8.3f} {r['comm']:8.3f}  {hidden}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
