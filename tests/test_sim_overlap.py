"""torus-sim --step: the FIFO step model (sim/step.py) against hand-computed schedules and bounds, the step
profile (sim/profile.py) against an independent scan of the real timeline, and the CLI's errors. Single
process, no timed assertions; a few seconds."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest

from torus.sim import closed_form, profile, step
from torus.sim.cli import main
from torus.sim.model import Cost, Layout
from torus.sim.profile import Bucket, Profile

TIMELINE = Path(__file__).resolve().parents[1] / "bench" / "overlap" / "results" / "overlap_timeline_2x1_1gbit.json"


def _table_price(table: dict[int, float]):
    """A price that looks the time up by byte count (the model must not care how a time was made)."""
    return lambda nbytes, dtype, algorithm: table[nbytes]


def _profile(ready, nbytes, apply=0.25, metric=0):
    return Profile(tuple(Bucket(r, n, "float32", "ring") for r, n in zip(ready, nbytes)), apply, metric)


def test_fifo_hand_computed():
    """Ready 1, 2, 3 s; all-reduces 2, 0.5, 1 s: starts 1, 3, 3.5, finishes 3, 3.5, 4.5; backprop ends at 3;
    step = 4.5 + apply 0.25 + metric 0.1 = 4.85; compute alone 3.25, exposed 1.6, comm 3.6, fused 3.2."""
    p = _profile([1.0, 2.0, 3.0], [400, 800, 1200], metric=8)
    r = step.model(p, _table_price({400: 2.0, 800: 0.5, 1200: 1.0, 2400: 3.2, 8: 0.1}))
    assert r.starts == pytest.approx((1.0, 3.0, 3.5))
    assert r.finishes == pytest.approx((3.0, 3.5, 4.5))
    assert (r.backprop, r.compute) == pytest.approx((3.0, 3.25))
    assert r.step == pytest.approx(4.85)
    assert r.exposed == pytest.approx(1.6)
    assert r.comm == pytest.approx(3.6)
    assert r.overlap == pytest.approx(1 - 1.6 / 3.6)
    assert r.off == pytest.approx(3.0 + 3.2 + 0.25 + 0.1)
    assert r.exposed_off == pytest.approx(3.3)


def test_nothing_to_overlap_is_compute_plus_every_allreduce():
    """Every bucket ready only at backprop's end: the thread runs them back to back after it, so the step is
    backprop + sum(T_i) + apply + metric, whatever the times."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        k = int(rng.integers(1, 7))
        B = float(rng.uniform(0.1, 2))
        sizes = [4 * (i + 1) for i in range(k)]
        times = {n: float(rng.uniform(0, 1)) for n in sizes} | {8: 0.01, 4 * k * (k + 1) // 2: 0.5}
        p = _profile([B] * k, sizes, apply=0.3, metric=8)
        r = step.model(p, _table_price(times))
        assert r.step == pytest.approx(B + sum(times[n] for n in sizes) + 0.3 + 0.01)


def test_zero_communication_is_compute_alone():
    """All-reduces that cost nothing: on and off both equal the compute alone, nothing exposed."""
    p = _profile([0.2, 0.5, 0.9], [40, 80, 120], apply=0.1, metric=8)
    r = step.model(p, lambda nbytes, dtype, algorithm: 0.0)
    assert (r.step, r.off, r.exposed) == pytest.approx((1.0, 1.0, 0.0))
    assert r.overlap == 1.0


def test_bounds_and_monotonicity():
    """compute + metric <= step <= off-like serial bound (backprop + sum T + apply + metric); the last
    all-reduce ends no earlier than the first ready time plus every T; a longer all-reduce or a later ready
    time never shortens the step."""
    rng = np.random.default_rng(2)
    for _ in range(50):
        k = int(rng.integers(1, 6))
        ready = np.sort(rng.uniform(0, 1, k)).tolist()
        sizes = [4 * (i + 1) for i in range(k)]
        times = {n: float(rng.uniform(0, 0.5)) for n in sizes} | {8: 0.02, 4 * k * (k + 1) // 2: 1.0}
        p = _profile(ready, sizes, apply=0.1, metric=8)
        r = step.model(p, _table_price(times))
        total = sum(times[n] for n in sizes)
        assert p.compute + 0.02 - 1e-12 <= r.step <= p.backprop + total + 0.1 + 0.02 + 1e-12
        assert r.finishes[-1] >= ready[0] + total - 1e-12
        j = int(rng.integers(0, k))
        longer = dict(times)
        longer[sizes[j]] += 0.3
        assert step.model(p, _table_price(longer)).step >= r.step - 1e-12
        later = list(ready)
        later[j] += 0.2
        assert step.model(_profile(later, sizes, 0.1, 8), _table_price(times)).step >= r.step - 1e-12


def test_slowdown_closed_form():
    """One bucket ready at 0, backprop to 2 s, slowdown 2 (half rate before 2 s): T = 1 ends at 2; T = 1.5
    has 1 s done by 2 s and ends at 2.5; T = 0.5 ends at 1. slowdown 1 is the plain schedule."""
    for T, end in ((1.0, 2.0), (1.5, 2.5), (0.5, 1.0)):
        assert step.fifo([0.0], [T], 2.0, slowdown=2.0)[1] == pytest.approx([end])
    assert step.fifo([0.0, 0.5], [1.0, 1.0], 0.7) == (pytest.approx([0.0, 1.0]), pytest.approx([1.0, 2.0]))
    with pytest.raises(ValueError, match="slowdown"):
        step.fifo([0.0], [1.0], 1.0, slowdown=0.5)


def test_sim_price_is_the_replay():
    """2 ranks, one level: a bucket's price is the ring all-reduce closed form (2 steps of M/2 bytes, one
    reduction of M/2), i.e. the simulator's replay, not a formula of the step model's own."""
    cost = Cost(alpha=1e-5, beta=8e-9, gamma=1e-10)
    price = step.sim_price(Layout(2, 1, 1), cost)
    for nbytes in (4096, 4_300_840, 27_305_984):
        want = closed_form.time("ring", "allreduce", nbytes, 1e-5, 8e-9, 1e-10, 2, 2, 1)
        assert price(nbytes, "float32", "ring") == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="whole number"):
        price(6, "float32", "ring")


def _scan(trace: dict):
    """Independently of profile.py: bucket index -> set of (nbytes, wire) over every 'bucket K allreduce'."""
    found: dict[int, set] = {}
    for e in trace["traceEvents"]:
        m = re.fullmatch(r"bucket (\d+) allreduce", e.get("name", ""))
        if m:
            found.setdefault(int(m.group(1)), set()).add((e["args"]["nbytes"], e["args"]["wire"]))
    return found


def test_profile_of_the_real_timeline():
    """The measured trace: as many buckets as it all-reduces, each with the bytes and wire dtype its spans
    carry, ready times in bucket order within the step, a non-negative tail; the fused all-reduce of the off
    fit in the same file moved the sum of the bucket sizes."""
    trace = json.loads(TIMELINE.read_text())
    found = _scan(trace)
    p = profile.from_trace(trace, source="t")
    assert len(p.buckets) == len(found)
    for k, b in enumerate(p.buckets):
        assert found[k] == {(b.nbytes, b.dtype)}
        assert b.algorithm == "ring"
    ready = [b.ready for b in p.buckets]
    assert ready == sorted(ready) and ready[0] > 0
    steps = [e["dur"] / 1e6 for e in trace["traceEvents"] if e.get("name") == "train step"]
    assert p.compute < max(steps) and p.apply >= 0
    fused = {e["args"]["nbytes"] for e in trace["traceEvents"] if e.get("name") == "allreduce"}
    assert fused == {sum(b.nbytes for b in p.buckets)}
    assert p.metric_nbytes == 8


def test_profile_round_trip_and_scaling(tmp_path):
    p = profile.from_trace(json.loads(TIMELINE.read_text()))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p.as_dict()))
    assert profile.load(str(path)) == p
    q = p.scaled(0.2)
    assert q.compute == pytest.approx(0.2)
    assert q.buckets[1].ready / q.buckets[3].ready == pytest.approx(p.buckets[1].ready / p.buckets[3].ready)
    assert [b.nbytes for b in q.buckets] == [b.nbytes for b in p.buckets]


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(buckets=[]), "no buckets"),
    (lambda d: d["buckets"][0].update(nbytes=-4), "nbytes -4"),
    (lambda d: d["buckets"][0].update(nbytes=6), "whole number"),
    (lambda d: d["buckets"][1].update(ready_s=-1.0), "bucket 1 ready_s"),
    (lambda d: d["buckets"][0].update(dtype="float128"), "dtype"),
    (lambda d: d.pop("apply_s"), "missing field 'apply_s'"),
    (lambda d: d.update(format="other"), "format"),
])
def test_bad_profiles_are_refused(edit, match):
    d = _profile([0.1, 0.2], [40, 80]).as_dict()
    edit(d)
    with pytest.raises(ValueError, match=match):
        profile.from_dict(d)


def test_bad_traces_are_refused():
    trace = json.loads(TIMELINE.read_text())
    with pytest.raises(ValueError, match="no 'train step' spans"):
        profile.from_trace({"traceEvents": [e for e in trace["traceEvents"] if e.get("name") != "train step"]})
    no_buckets = {"traceEvents": [e for e in trace["traceEvents"] if "bucket" not in e.get("name", "")]}
    with pytest.raises(ValueError, match="no train step with bucket spans"):
        profile.from_trace(no_buckets)
    holed = copy.deepcopy(trace)
    spans = holed["traceEvents"]
    victim = [i for i, e in enumerate(spans) if e.get("name") == "bucket 2 allreduce"][3]
    del spans[victim]
    with pytest.raises(ValueError, match=r"buckets \[0, 1, 2, 3, 4\] started and \[0, 1, 3, 4\] all-reduced"):
        profile.from_trace(holed)


def test_model_needs_an_algorithm():
    p = Profile((Bucket(0.1, 40, "float32"),), 0.0)
    with pytest.raises(ValueError, match="name no algorithm"):
        step.model(p, lambda n, d, a: 0.0)
    assert step.model(p, lambda n, d, a: 1.0, algorithm="ring").step == pytest.approx(1.1)


def test_cli(tmp_path, capsys):
    out, saved = tmp_path / "o.json", tmp_path / "p.json"
    assert main(["--step", str(TIMELINE), "--ranks", "2", "--alpha", "1e-5", "--beta", "8e-9",
                 "--compute-step", "0.5", "--json", str(out), "--save-profile", str(saved)]) == 0
    rows = json.loads(out.read_text())["step"]
    assert [(r["ranks"], r["algorithm"]) for r in rows] == [(2, "ring")]
    assert rows[0]["compute"] == pytest.approx(0.5)
    assert profile.load(str(saved)).compute == pytest.approx(0.5)
    assert "eff on" in capsys.readouterr().out
    for argv in (["--step", str(tmp_path / "missing.json")], ["--step", str(TIMELINE), "--slowdown", "0.5"],
                 ["--step", str(TIMELINE), "--compute-step", "-1"], ["--step", str(TIMELINE), "--sweep"],
                 ["--compute-step", "1"]):
        assert main(argv) == 2
    bad = tmp_path / "bad.json"
    d = json.loads(saved.read_text())
    d["buckets"][0]["nbytes"] = -4
    bad.write_text(json.dumps(d))
    assert main(["--step", str(bad), "--ranks", "2"]) == 2
    assert "nbytes -4" in capsys.readouterr().err
