"""torus.timeline in one process (MPI.COMM_SELF): the trace's fields, lanes and args, spans from many threads at
once, the event cap, the clock correction of ``merge`` on hand-made payloads, the atomic and idempotent close,
the per-rank file and the merge command line. Expected times are written out by hand from the injected clock.
Budget: about 2 s (one subprocess).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from mpi4py import MPI

from torus import timeline


def fixed_clock(value: float = 100.0):
    return lambda: value


def load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def by_name(trace: dict) -> dict:
    return {e["name"]: e for e in trace["traceEvents"] if e["ph"] != "M"}


def test_fields_lanes_and_args(tmp_path):
    path = tmp_path / "t.json"
    tl = timeline.Timeline(path, MPI.COMM_SELF, lanes=("step", "wait"), clock=fixed_clock(100.0))
    tl.span("allreduce", "comm", 100.5, 100.75, bytes=np.int64(4096), algorithm="torus2d",
            dtype=np.dtype("float16"), bucket=3, norm=float("nan"), scale=np.float32(0.5))
    tl.span("backwards", "wait", 101.0, 100.0)  # t1 < t0: written with dur 0
    tl.instant("metrics", "zeta")
    with tl.region("train_step", "step", step=7):
        pass
    tl.close()
    trace = load(path)
    assert os.listdir(tmp_path) == ["t.json"]  # the temporary file was renamed, nothing else written
    ev = by_name(trace)
    assert ev["allreduce"] == {"name": "allreduce", "ph": "X", "ts": 500000.0, "dur": 250000.0, "pid": 0,
                               "tid": 3, "args": {"bytes": 4096, "algorithm": "torus2d", "dtype": "float16",
                                                  "bucket": 3, "norm": "nan", "scale": 0.5}}
    assert ev["backwards"]["dur"] == 0 and ev["backwards"]["ts"] == 1e6
    assert ev["metrics"] == {"name": "metrics", "ph": "i", "s": "t", "ts": 0.0, "pid": 0, "tid": 4}
    assert ev["train_step"] == {"name": "train_step", "ph": "X", "ts": 0.0, "dur": 0.0, "pid": 0, "tid": 1,
                                "args": {"step": 7}}
    meta = [(e["name"], e["tid"], e["args"]) for e in trace["traceEvents"] if e["ph"] == "M"]
    # the declared lanes first, in their order, then the others by name
    assert meta == [("process_name", 0, {"name": f"rank 0 ({socket.gethostname()})"}),
                    ("process_sort_index", 0, {"sort_index": 0}),
                    ("thread_name", 1, {"name": "step"}), ("thread_sort_index", 1, {"sort_index": 1}),
                    ("thread_name", 2, {"name": "wait"}), ("thread_sort_index", 2, {"sort_index": 2}),
                    ("thread_name", 3, {"name": "comm"}), ("thread_sort_index", 3, {"sort_index": 3}),
                    ("thread_name", 4, {"name": "zeta"}), ("thread_sort_index", 4, {"sort_index": 4})]
    assert all(e["pid"] == 0 for e in trace["traceEvents"])
    assert trace["otherData"]["ranks"]["0"]["events"] == 4 and trace["otherData"]["missing_ranks"] == []


def test_threads_at_once_and_the_cap(tmp_path):
    threads, each = 8, 400
    for cap, kept in ((threads * each, threads * each), (1000, 1000)):
        path = tmp_path / f"cap{cap}.json"
        tl = timeline.Timeline(path, MPI.COMM_SELF, max_events=cap)
        start = threading.Barrier(threads)

        def record(k):
            start.wait()
            for i in range(each):
                t = tl.clock()
                tl.span(f"t{k}.{i}", f"lane{k % 3}", t, t, k=k, i=i)

        workers = [threading.Thread(target=record, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        tl.close()
        trace = load(path)
        names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
        assert len(names) == len(set(names)) == kept
        if kept == threads * each:
            assert set(names) == {f"t{k}.{i}" for k in range(threads) for i in range(each)}
        else:
            labels = [e["args"]["labels"] for e in trace["traceEvents"] if e["name"] == "process_labels"]
            assert labels == [f"dropped {threads * each - cap} events (max_events {cap})"]
        assert trace["otherData"]["ranks"]["0"]["dropped"] == threads * each - kept
        lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        present = sorted({f"lane{k % 3}" for k in range(threads)} if kept == threads * each else
                         {f"lane{e['args']['k'] % 3}" for e in trace["traceEvents"] if e["ph"] == "X"})
        assert lanes == {tid: lane for tid, lane in enumerate(present, 1)}  # by name, lanes with events only
        for e in trace["traceEvents"]:
            if e["ph"] == "X":
                assert lanes[e["tid"]] == f"lane{e['args']['k'] % 3}", e


def payload(rank, clock, events, origin=100.0, run="run-a", size=2):
    return {"format": timeline.FORMAT, "run": run, "rank": rank, "size": size, "host": f"h{rank}",
            "origin_s": origin, "lanes": [], "clock": clock, "max_events": 10, "dropped": 0, "events": events}


def test_merge_places_events_on_rank_0s_clock():
    rank0 = payload(0, [{"local_s": 100.0, "offset_s": 0.0, "error_s": 0.0}], [["step", "a", 100.25, 100.5, None]])
    # rank 1's clock is 90 s behind rank 0's at local 10 and 90.002 s at local 20: +0.2 ms a second
    rank1 = payload(1, [{"local_s": 10.0, "offset_s": 90.0, "error_s": 1e-5},
                        {"local_s": 20.0, "offset_s": 90.002, "error_s": 1e-5}],
                    [["step", "b", 15.0, 17.5, None], ["step", "c", 5.0, None, None]])
    ev = by_name(timeline.merge([rank1, rank0]))
    assert (ev["a"]["pid"], ev["a"]["ts"], ev["a"]["dur"]) == (0, 250000.0, 250000.0)
    # 15 + 90.001 - 100 = 5.001 s; to 17.5 + 90.0015 - 100 = 7.5015 s
    assert (ev["b"]["pid"], ev["b"]["ts"], ev["b"]["dur"]) == (1, 5001000.0, 2500500.0)
    # before the first sample the line is extended: 5 + 89.999 - 100
    assert ev["c"]["ts"] == pytest.approx(-5001000.0, abs=1e-3)
    # one sample: a constant offset
    single = payload(1, [{"local_s": 10.0, "offset_s": 90.0, "error_s": 1e-5}], [["step", "d", 15.0, 16.0, None]])
    ev = by_name(timeline.merge([single]))
    assert (ev["d"]["ts"], ev["d"]["dur"]) == (5e6, 1e6)
    assert timeline.merge([single])["otherData"]["missing_ranks"] == [0]
    with pytest.raises(ValueError, match="rank 1 is from run run-b"):
        timeline.merge([rank0, payload(1, rank1["clock"], [], run="run-b")])
    with pytest.raises(ValueError, match="rank 1 given twice"):
        timeline.merge([rank1, rank1])


def test_close_is_idempotent_and_stops_recording(tmp_path):
    path = tmp_path / "t.json"
    tl = timeline.Timeline(path, MPI.COMM_SELF, clock=fixed_clock())
    tl.instant("before", "step")
    tl.close()
    first = path.read_bytes()
    tl.instant("after", "step")
    path.unlink()
    tl.close()
    tl.close(collective=False)
    assert os.listdir(tmp_path) == []
    assert [e["name"] for e in json.loads(first)["traceEvents"] if e["ph"] != "M"] == ["before"]


def run_merge(*args):
    return subprocess.run([sys.executable, "-m", "torus.timeline", "merge", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_rank_file_and_merge_command(tmp_path):
    path = tmp_path / "t.json"
    tl = timeline.Timeline(path, MPI.COMM_SELF, clock=fixed_clock(10.0))
    tl.span("s", "comm", 10.5, 11.0, bucket=1)
    tl.close(collective=False)
    assert os.listdir(tmp_path) == ["t.json.rank0"]  # the per-rank file only
    rank_file = load(tmp_path / "t.json.rank0")
    out = tmp_path / "merged.json"
    done = run_merge(out, tmp_path / "t.json.rank0")
    assert done.returncode == 0, done.stderr
    assert load(out) == timeline.merge([rank_file])
    assert by_name(load(out))["s"]["ts"] == 500000.0
    bad = run_merge(tmp_path / "x.json", tmp_path / "missing.rank3")
    assert bad.returncode == 2 and "missing.rank3" in bad.stderr.splitlines()[-1]
    assert not (tmp_path / "x.json").exists()


def test_from_env(tmp_path, monkeypatch):
    monkeypatch.delenv("TORUS_TIMELINE", raising=False)
    assert timeline.from_env(MPI.COMM_SELF) is None
    monkeypatch.setenv("TORUS_TIMELINE", "")
    assert timeline.from_env(MPI.COMM_SELF) is None
    monkeypatch.setenv("TORUS_TIMELINE", str(tmp_path / "env.json"))
    tl = timeline.from_env(MPI.COMM_SELF, lanes=("step",))
    assert isinstance(tl, timeline.Timeline)
    tl.close()
    assert load(tmp_path / "env.json")["otherData"]["size"] == 1
