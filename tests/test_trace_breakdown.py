"""``breakdown``: a step's parts, from a synthetic merged trace whose answer is known in closed form."""
import subprocess
import sys

import pytest

from torus.integrations.keras.app.breakdown import breakdown


def span(name, pid, ts, dur, **args):
    return {"name": name, "ph": "X", "pid": pid, "tid": 1, "ts": ts * 1e6, "dur": dur * 1e6, "args": args}


def step(pid, t0, last_start, waits, metric, length):
    """A step at t0: bucket starts up to last_start (relative), waits (start, dur) relative, a metric."""
    ev = [span("train step", pid, t0, length), span("bucket 0 start", pid, t0 + 0.1, 0.01),
          span("bucket 1 start", pid, t0 + last_start - 0.02, 0.02),
          span("bucket 0 allreduce", pid, t0 + 0.11, 0.5), span("bucket 1 allreduce", pid, t0 + 0.61, 0.3)]
    ev += [span(f"bucket {k} wait", pid, t0 + s, d) for k, (s, d) in enumerate(waits)]
    return ev + [span("metric allreduce", pid, t0 + length - metric - 0.01, metric)]


def test_the_parts_add_up_and_match_the_closed_form():
    events = []
    for k in range(4):  # the first step (tracing) is left out
        events += step(0, 10.0 * k, 0.6, [(0.6, 0.05), (0.65, 0.26)], 0.02, 1.0 if k else 5.0)
        events += step(1, 10.0 * k + 0.003, 0.5, [(0.5, 0.0), (0.5, 0.41)], 0.01, 1.0)
    got = breakdown({"traceEvents": events})
    r0, r1 = got[0], got[1]
    assert r0["steps"] == 3
    assert r0["backprop"] == pytest.approx(0.6) and r0["exposed"] == pytest.approx(0.31)
    assert r0["metric"] == pytest.approx(0.02) and r0["other"] == pytest.approx(1.0 - 0.6 - 0.31 - 0.02)
    assert r0["comm"] == pytest.approx(0.8) and r0["hidden"] == pytest.approx(1 - 0.31 / 0.8)
    assert r1["backprop"] == pytest.approx(0.5) and r1["exposed"] == pytest.approx(0.41)


def test_the_parts_are_the_median_steps_and_never_negative():
    # medians taken part by part would give step 1.0, backprop 0.6, exposed 0.45: other -0.05
    events = []
    for k, (length, start, wait) in enumerate([(9.0, 0.6, 0.3), (1.0, 0.4, 0.45), (1.1, 0.6, 0.45),
                                               (0.9, 0.7, 0.1)]):
        t0 = 10.0 * k  # step 0 (the first) is left out
        events += [span("train step", 0, t0, length), span("bucket 0 start", 0, t0 + start, 0.0),
                   span("bucket 0 allreduce", 0, t0 + start, wait), span("bucket 0 wait", 0, t0 + start, wait)]
    r = breakdown({"traceEvents": events})[0]
    assert r["steps"] == 3 and r["step"] == pytest.approx(1.0)
    assert r["backprop"] == pytest.approx(0.4) and r["exposed"] == pytest.approx(0.45)
    assert r["other"] == pytest.approx(1.0 - 0.4 - 0.45) and r["other"] >= 0
    four = {"traceEvents": events + [span("train step", 0, 50.0, 0.95), span("bucket 0 start", 0, 50.2, 0.0),
                                     span("bucket 0 wait", 0, 50.2, 0.5)]}
    r = breakdown(four)[0]  # 0.9, 0.95, 1.0, 1.1: the lower middle one
    assert r["steps"] == 4 and r["step"] == pytest.approx(0.95) and r["other"] == pytest.approx(0.95 - 0.2 - 0.5)


def test_steps_per_execution_parts_add_up_and_count_each_wait_once():
    # one span holds two steps: starts, waits and a metric all-reduce each; the first step's wait and metric
    # fall before the last start, and a metric all-reduce that overlaps a wait is counted once
    events = []
    for k in range(3):
        t0 = 10.0 * k
        events += [span("train step", 0, t0, 2.0),
                   span("bucket 0 start", 0, t0 + 0.3, 0.0), span("bucket 0 allreduce", 0, t0 + 0.3, 0.4),
                   span("bucket 0 wait", 0, t0 + 0.5, 0.2), span("metric allreduce", 0, t0 + 0.65, 0.15),
                   span("bucket 0 start", 0, t0 + 1.2, 0.0), span("bucket 0 allreduce", 0, t0 + 1.2, 0.5),
                   span("bucket 0 wait", 0, t0 + 1.3, 0.4), span("metric allreduce", 0, t0 + 1.8, 0.1)]
    r = breakdown({"traceEvents": events})[0]
    assert r["exposed"] == pytest.approx(0.2 + 0.4)
    assert r["metric"] == pytest.approx(0.1 + 0.1)  # 0.65-0.80 less its part in the wait to 0.70; 1.8-1.9
    assert r["backprop"] == pytest.approx(1.2 - 0.2 - 0.1)  # to the last start, less the wait and metric
    assert r["other"] == pytest.approx(2.0 - 0.9 - 0.6 - 0.2) and r["other"] >= 0
    assert r["comm"] == pytest.approx(0.9)


def test_overlap_off_counts_the_fused_allreduce_as_exposed():
    events = []
    for k in range(3):
        events += [span("train step", 0, 5.0 * k, 1.2), span("allreduce", 0, 5.0 * k + 0.45, 0.7)]
    r = breakdown({"traceEvents": events})[0]
    assert r["backprop"] == pytest.approx(0.45) and r["exposed"] == pytest.approx(0.7)
    assert r["hidden"] == pytest.approx(0.0) and r["other"] == pytest.approx(1.2 - 0.45 - 0.7)


def test_each_fit_drops_its_first_step_and_one_fit_can_be_chosen():
    events = []
    for fit, (length, fused) in enumerate([(1.0, 0.3), (2.0, 0.9)]):
        for k in range(3):  # each fit's first step is 10x longer (a retrace) and left out
            t0 = 100.0 * fit + 5.0 * k
            events += [span("train step", 0, t0, length * (10 if k == 0 else 1), fit=fit),
                       span("allreduce", 0, t0 + 0.1, fused)]
    assert breakdown({"traceEvents": events})[0]["steps"] == 4
    assert breakdown({"traceEvents": events}, fit=1)[0]["step"] == pytest.approx(2.0)
    assert breakdown({"traceEvents": events}, fit=0)[0]["exposed"] == pytest.approx(0.3)
    assert breakdown({"traceEvents": events}, fit=2) == {}


def test_the_tool_runs_without_tensorflow(tmp_path):
    import json
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [span("train step", 0, 5.0 * k, 1.0) for k in range(3)]}))
    code = ("import sys; from torus.integrations.keras.app import breakdown; rc = breakdown.main([sys.argv[1]]); "
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules; raise SystemExit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split()[:3] == ["0", "2", "1.000"]
