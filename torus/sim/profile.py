"""A training step's compute profile for the step model (step.py): when each gradient bucket exists, its size,
the optimizer's tail and the metric all-reduce; read from a torus timeline or written by hand.

The JSON format (``torus-step-profile/1``), times in seconds from the step's start, sizes in bytes::

    {"format": "torus-step-profile/1",
     "source": "free text: where the figures came from",
     "buckets": [{"ready_s": 0.25, "nbytes": 4194304, "dtype": "float32", "algorithm": "ring"}, ...],
     "apply_s": 0.01,
     "metric": {"nbytes": 8, "dtype": "float32"}}

- ``buckets``, in the order the communication thread runs them (torus.integrations.keras.collectives.buckets: reverse
  variable order, fixed by the model): ``ready_s`` when the bucket has been copied into its buffer and handed
  to the thread, ``nbytes`` the bytes it all-reduces, ``dtype`` its element type on the wire (``nbytes`` is a
  whole number of them), ``algorithm`` optional (the one the run used; torus-sim ``--algo`` overrides it);
- ``apply_s``: the step's tail once its last bucket is ready and reduced, less the metric all-reduce (the
  optimizer's update and Keras' own work);
- ``metric``: the metric all-reduce after the update (``nbytes`` and ``dtype``), or null for none.

The compute alone is ``max(ready_s) + apply_s``. ``scaled`` multiplies every time by one factor (a faster or
slower machine with the same shape of backprop).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

import numpy as np

from torus.sim.model import ITEMSIZE

FORMAT = "torus-step-profile/1"
_BUCKET = re.compile(r"^bucket (\d+) (start|allreduce)$")


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: ready ``ready`` seconds after the step starts, ``nbytes`` bytes of ``dtype``."""
    ready: float
    nbytes: int
    dtype: str
    algorithm: str | None = None


@dataclass(frozen=True)
class Profile:
    """The buckets in thread order, ``apply`` (seconds), the metric all-reduce (``metric_nbytes`` bytes of
    ``metric_dtype``; 0 bytes: none) and a free-text ``source``. Raises ValueError for an empty bucket list,
    negative times or sizes, a size that is not a whole number of elements, or an unknown dtype."""
    buckets: tuple[Bucket, ...]
    apply: float
    metric_nbytes: int = 0
    metric_dtype: str = "float32"
    source: str = ""

    def __post_init__(self):
        if not self.buckets:
            raise ValueError("step profile: no buckets")
        for k, b in enumerate(self.buckets):
            _check_size(f"bucket {k}", b.nbytes, b.dtype)
            if not b.nbytes:
                raise ValueError(f"step profile: bucket {k} has 0 bytes")
            if not np.isfinite(b.ready) or b.ready < 0:
                raise ValueError(f"step profile: bucket {k} ready_s {b.ready} is not a time >= 0")
        if not np.isfinite(self.apply) or self.apply < 0:
            raise ValueError(f"step profile: apply_s {self.apply} is not a time >= 0")
        _check_size("metric", self.metric_nbytes, self.metric_dtype)

    @property
    def backprop(self) -> float:
        """Seconds from the step's start until the last bucket is ready."""
        return max(b.ready for b in self.buckets)

    @property
    def compute(self) -> float:
        """Seconds of the step without any communication: ``backprop + apply``."""
        return self.backprop + self.apply

    def scaled(self, compute: float) -> Profile:
        """The same profile with every time multiplied so that ``compute`` is ``compute`` seconds."""
        if not np.isfinite(compute) or compute <= 0 or self.compute <= 0:
            raise ValueError(f"step profile: cannot scale a compute of {self.compute} s to {compute} s")
        f = compute / self.compute
        return replace(self, buckets=tuple(replace(b, ready=b.ready * f) for b in self.buckets),
                       apply=self.apply * f, source=f"{self.source} (times x {f:.4g})".strip())

    def as_dict(self) -> dict:
        """The JSON form (module docstring)."""
        return {"format": FORMAT, "source": self.source,
                "buckets": [{"ready_s": b.ready, "nbytes": b.nbytes, "dtype": b.dtype,
                             **({"algorithm": b.algorithm} if b.algorithm else {})} for b in self.buckets],
                "apply_s": self.apply,
                "metric": {"nbytes": self.metric_nbytes, "dtype": self.metric_dtype} if self.metric_nbytes else None}


def _check_size(what: str, nbytes, dtype) -> None:
    if dtype not in ITEMSIZE:
        raise ValueError(f"step profile: {what} dtype {dtype!r} is not one of {', '.join(ITEMSIZE)}")
    if not isinstance(nbytes, (int, np.integer)) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"step profile: {what} nbytes {nbytes!r} is not a size in bytes >= 0")
    if nbytes % ITEMSIZE[dtype]:
        raise ValueError(f"step profile: {what} nbytes {nbytes} is not a whole number of {dtype} elements")


def from_dict(d: dict) -> Profile:
    """A profile from its JSON form; ValueError naming the missing or bad field."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"step profile: expected a JSON object with \"format\": \"{FORMAT}\"")
    try:
        buckets = tuple(Bucket(float(b["ready_s"]), b["nbytes"], b["dtype"], b.get("algorithm"))
                        for b in d["buckets"])
        metric = d.get("metric") or {"nbytes": 0, "dtype": "float32"}
        return Profile(buckets, float(d["apply_s"]), metric["nbytes"], metric.get("dtype", "float32"),
                       str(d.get("source", "")))
    except KeyError as e:
        raise ValueError(f"step profile: missing field {e}") from None
    except TypeError as e:
        raise ValueError(f"step profile: malformed field ({e})") from None


def load(path: str) -> Profile:
    """A profile from ``path``: a profile JSON, or a torus timeline (a Chrome trace, read by ``from_trace``)."""
    with open(path) as f:
        d = json.load(f)
    if isinstance(d, dict) and "traceEvents" in d:
        return from_trace(d, source=path)
    return from_dict(d)


def _rank_steps(spans: list[dict], rank: int) -> list[dict]:
    """Per train step of ``rank`` that ran buckets (overlap on), after each fit's first (which traces): ``ready``
    {bucket: s}, ``nbytes`` {bucket: bytes}, ``dtype``, ``algorithm``, ``reduced`` (s, the last bucket's
    all-reduce end), ``end`` (s), ``metric`` (s), ``metric_nbytes``; times from the step's start."""
    mine = sorted((e for e in spans if e["pid"] == rank), key=lambda e: e["ts"])
    rows, fits = [], set()
    for step in (e for e in mine if e["name"] == "train step"):
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in mine if t0 <= e["ts"] < t1 and e is not step]
        row: dict = {"ready": {}, "nbytes": {}, "dtype": {}, "algorithm": {}, "reduced": 0.0,
                     "end": step["dur"] / 1e6, "metric": 0.0, "metric_nbytes": 0, "at": t0}
        for e in inside:
            m = _BUCKET.match(e["name"])
            args = e.get("args") or {}
            if e["name"] == "metric allreduce":
                row["metric"] += e["dur"] / 1e6
                row["metric_nbytes"] = max(row["metric_nbytes"], int(args.get("nbytes", 0)))
            elif m and m.group(2) == "start":
                row["ready"][int(m.group(1))] = (e["ts"] + e["dur"] - t0) / 1e6
            elif m:
                k = int(m.group(1))
                if "nbytes" not in args or "wire" not in args:
                    raise ValueError(f"step profile: rank {rank}'s span {e['name']!r} at {e['ts']} us lacks "
                                     "args nbytes/wire")
                row["nbytes"][k], row["dtype"][k] = int(args["nbytes"]), str(args["wire"])
                row["algorithm"][k] = args.get("algorithm")
                row["reduced"] = max(row["reduced"], (e["ts"] + e["dur"] - t0) / 1e6)
        if not row["ready"]:
            continue
        fit = (step.get("args") or {}).get("fit", 0)  # trace.py numbers the fits: each one's first step traces
        if fit in fits:
            rows.append(row)
        fits.add(fit)
    return rows


def from_trace(trace: dict, source: str = "") -> Profile:
    """The profile of a torus timeline (torus.timeline's Chrome trace with the spans of
    torus.integrations.keras.collectives.trace: ``train step``, ``bucket K start``, ``bucket K allreduce`` with args
    ``nbytes``/``wire``/``algorithm``, ``metric allreduce``). Per rank, over its train steps with buckets
    after the first (which traces), the median of: each bucket's ready time (its ``start`` span's end, from
    the step's start), the apply tail (the step's end less the later of the last ready time and the last bucket
    all-reduce's end, less the metric all-reduce) and the metric all-reduce; then per figure the largest over
    the ranks (a collective waits for the last rank). Sizes and dtypes must agree over steps and ranks.
    Raises ValueError naming what is missing or inconsistent."""
    spans = [e for e in trace.get("traceEvents", ()) if e.get("ph") == "X"]
    if not any(e.get("name") == "train step" for e in spans):
        raise ValueError(f"step profile: {source or 'trace'} has no 'train step' spans")
    per_rank = {}
    for rank in sorted({e["pid"] for e in spans}):
        rows = _rank_steps(spans, rank)
        if rows:
            per_rank[rank] = rows
    if not per_rank:
        raise ValueError(f"step profile: {source or 'trace'} has no train step with bucket spans after the "
                         "first (overlap on, at least 2 steps)")
    ref = per_rank[min(per_rank)][0]
    layout = (ref["nbytes"], ref["dtype"])
    for rank, rows in per_rank.items():
        for row in rows:
            if set(row["ready"]) != set(row["nbytes"]) or (row["nbytes"], row["dtype"]) != layout:
                raise ValueError(f"step profile: rank {rank}'s step at {row['at']} us has buckets "
                                 f"{sorted(row['ready'])} started and {sorted(row['nbytes'])} all-reduced, "
                                 f"{row['nbytes']} bytes; expected each of {sorted(layout[0])} once, "
                                 f"{layout[0]} bytes")
    order = sorted(layout[0])
    if order != list(range(len(order))):
        raise ValueError(f"step profile: bucket indices {order} are not 0..{len(order) - 1}")

    def worst(fn) -> float:
        return max(float(np.median([fn(row) for row in rows])) for rows in per_rank.values())

    buckets = tuple(Bucket(worst(lambda r, k=k: r["ready"][k]), layout[0][k], layout[1][k],
                           ref["algorithm"][k]) for k in order)
    apply = worst(lambda r: max(0.0, r["end"] - max(max(r["ready"].values()), r["reduced"]) - r["metric"]))
    steps = min(len(rows) for rows in per_rank.values())
    return Profile(buckets, apply, max(r["metric_nbytes"] for rows in per_rank.values() for r in rows),
                   "float32", f"{source}: medians over {steps} steps per rank after the first, "
                   f"largest over {len(per_rank)} ranks".lstrip(": "))
