"""torus.timeline across ranks: every rank's events, from several threads at once, in one trace with consistent
lanes; skewed and drifting clocks placed on rank 0's clock; the per-rank files of ``close(collective=False)``
and the merge command, which gives the collective close's file byte for byte.

Clocks: all ranks run on one host, where ``time.perf_counter`` (CLOCK_MONOTONIC) is one clock for every process,
so it serves as the true time. Rank r's Timeline reads ``c_r(T) = T * (1 + rate_r) + skew_r`` instead (skews of
hundreds of seconds, drifts of a few percent); an event recorded at true time T must land at rank 0's reading
of that instant, ``c_0(T)``, minus rank 0's origin. Bound: each clock sample is off by at most its recorded
``error_s`` (half its round trip: rank 0's reading lies inside it), and the line through two samples is off by
at most the larger of the two wherever the true offset is linear, as it is here; converted to rank 0's clock
units (a factor ``(1 + rate_0) / (1 + rate_r)``) and with 2 ns for the three-decimal microseconds.
Budget: about 2 s a run (0.5 s of sleeps).
"""
from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from oracle import WORLD
from torus import timeline

RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
ROUNDING_S = 2e-9


@pytest.fixture
def shared_dir():
    """A folder every rank sees (one host), removed after the test."""
    path = Path(WORLD.bcast(tempfile.mkdtemp(prefix="timeline-") if RANK == 0 else None))
    yield path
    WORLD.Barrier()
    if RANK == 0:
        shutil.rmtree(path)


def skewed(rank: int, drift: bool):
    """(rate, skew, clock) of ``rank``: ``clock()`` reads ``perf_counter() * (1 + rate) + skew``."""
    rate = (0.01 + 0.04 * rank) if drift else 0.0
    skew = -3.0 + 250.5 * rank
    return rate, skew, lambda: time.perf_counter() * (1 + rate) + skew


def load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_every_rank_every_thread(shared_dir):
    path = shared_dir / "t.json"
    tl = timeline.Timeline(path, WORLD, lanes=("step", "wait"))
    threads, each = 3, 300
    start = threading.Barrier(threads + 1)

    def record(k):
        start.wait()
        for i in range(each):
            t = time.perf_counter()
            tl.span(f"allreduce {k}.{i}", "comm" if k == 0 else f"wait{k}", t, t + 1e-6, bytes=8 * i,
                    algorithm="ring", dtype="float32", bucket=i)

    workers = [threading.Thread(target=record, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    for i in range(each):  # the main thread at the same time; lanes first used in an order that depends on the rank
        with tl.region(f"step {i}", "step" if (i + RANK) % 2 else "metric", step=i):
            pass
    for w in workers:
        w.join()
    tl.close()
    if RANK != 0:
        assert not path.exists() or SIZE == 1
        return
    trace = load(path)
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    for e in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= e.keys() and e["ph"] == "X" and e["dur"] >= 0, e
        assert isinstance(e["ts"], float) and isinstance(e["dur"], float), e
    got = sorted((e["pid"], e["name"]) for e in events)
    want = sorted([(r, f"allreduce {k}.{i}") for r in range(SIZE) for k in range(threads) for i in range(each)]
                  + [(r, f"step {i}") for r in range(SIZE) for i in range(each)])
    assert got == want  # every rank, every thread, each event once
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {r: f"rank {r} ({socket.gethostname()})" for r in range(SIZE)}
    sort = {e["pid"]: e["args"]["sort_index"] for e in trace["traceEvents"] if e["name"] == "process_sort_index"}
    assert sort == {r: r for r in range(SIZE)}
    # the same tid for a lane on every rank: the declared lanes first, then by name
    lanes = ["step", "wait", "comm", "metric"] + [f"wait{k}" for k in range(1, threads)]
    tids = {lane: tid for tid, lane in enumerate(lanes, 1)}
    named = sorted((e["pid"], e["tid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name")
    assert named == sorted((r, tids[lane], lane) for r in range(SIZE) for lane in lanes if lane != "wait")
    for e in events:
        lane = "comm" if e["name"].startswith("allreduce 0.") else f"wait{e['name'][10]}" \
            if e["name"].startswith("allreduce") else ("step" if (e["args"]["step"] + e["pid"]) % 2 else "metric")
        assert e["tid"] == tids[lane], e
        if e["name"].startswith("allreduce"):
            i = int(e["name"].split(".")[1])
            assert e["args"] == {"bytes": 8 * i, "algorithm": "ring", "dtype": "float32", "bucket": i}, e
    assert trace["otherData"]["missing_ranks"] == []


def probes(tl, clock_rate_skew, n=3, pause=0.1):
    """Record n spans of 1 ms (true time) ``pause`` s apart; their true start times."""
    rate, skew = clock_rate_skew
    true = []
    for k in range(n):
        time.sleep(pause)
        T = time.perf_counter()
        tl.span(f"probe {k}", "probe", T * (1 + rate) + skew, (T + 1e-3) * (1 + rate) + skew)
        true.append(T)
    time.sleep(pause / 2)
    return true


def check_placed(trace, true, drift: bool, samples_per_rank: int):
    """Every probe of every rank within its bound of where rank 0's clock puts it (module docstring)."""
    rate0, skew0, _ = skewed(0, drift)
    got = {(e["pid"], e["name"]): e for e in trace["traceEvents"] if e["name"].startswith("probe")}
    assert len(got) == SIZE * len(true[0])
    # rank 0's origin on its own clock, from its own probes (offset 0): the same for each
    origins = [T * (1 + rate0) + skew0 - got[(0, f"probe {k}")]["ts"] / 1e6 for k, T in enumerate(true[0])]
    assert max(origins) - min(origins) < ROUNDING_S, origins
    origin = origins[0]
    for r in range(SIZE):
        rate_r = skewed(r, drift)[0]
        clock = trace["otherData"]["ranks"][str(r)]["clock"]
        assert len(clock) == samples_per_rank
        bound = max(s["error_s"] for s in clock) * (1 + rate0) / (1 + rate_r) + ROUNDING_S
        for k, T in enumerate(true[r]):
            e = got[(r, f"probe {k}")]
            want_ts = (T * (1 + rate0) + skew0 - origin) * 1e6
            assert abs(e["ts"] - want_ts) <= bound * 1e6, (r, k, e["ts"], want_ts, bound)
            assert abs(e["dur"] - 1e3 * (1 + rate0)) <= 2 * bound * 1e6, (r, k, e["dur"], bound)
            if drift and r > 0:
                # the test can fail: a constant offset (the first sample's) would miss by more than the bound
                local = T * (1 + rate_r) + skewed(r, drift)[1]
                const = (local + clock[0]["offset_s"] - origin) * 1e6
                assert abs(const - want_ts) > 3 * bound * 1e6, (r, k, const, want_ts, bound)


def test_skewed_drifting_clocks_are_corrected(shared_dir):
    rate, skew, clock = skewed(RANK, drift=True)
    path = shared_dir / "t.json"
    tl = timeline.Timeline(path, WORLD, clock=clock)
    true = WORLD.gather(probes(tl, (rate, skew)), root=0)
    tl.close()
    if RANK == 0:
        check_placed(load(path), true, drift=True, samples_per_rank=2)


def test_rank_files_and_merge_command(shared_dir):
    rate, skew, clock = skewed(RANK, drift=False)
    path = shared_dir / "t.json"
    tl = timeline.Timeline(path, WORLD, clock=clock)
    true = WORLD.gather(probes(tl, (rate, skew), pause=0.03), root=0)
    tl.close(collective=False)
    WORLD.Barrier()
    if RANK == 0:
        assert sorted(p.name for p in shared_dir.iterdir()) == sorted(f"t.json.rank{r}" for r in range(SIZE))
        out = shared_dir / "merged.json"
        assert timeline.main(["merge", str(out), *(str(shared_dir / f"t.json.rank{r}") for r in range(SIZE))]) == 0
        check_placed(load(out), true, drift=False, samples_per_rank=1)  # the construction sample only
        if SIZE > 1:  # a merge of the ranks that are left (rank 0 among them or not)
            for ranks in ([0], list(range(1, SIZE))):
                timeline.main(["merge", str(out), *(str(shared_dir / f"t.json.rank{r}") for r in ranks)])
                trace = load(out)
                assert sorted({e["pid"] for e in trace["traceEvents"]}) == ranks
                assert trace["otherData"]["missing_ranks"] == sorted(set(range(SIZE)) - set(ranks))


def test_merge_command_equals_collective_close(shared_dir):
    """The payloads close() gathers, also written as per-rank files: the merge command makes the same file."""
    rate, skew, clock = skewed(RANK, drift=True)
    path = shared_dir / "t.json"
    gathered = timeline.Timeline._payload

    def payload_and_file(self, events):
        p = gathered(self, events)
        timeline._write_json(f"{self.path}.copy{self.rank}", p)
        return p

    with mock.patch.object(timeline.Timeline, "_payload", payload_and_file):
        tl = timeline.Timeline(path, WORLD, lanes=("step",), clock=clock)
        with tl.region("step", "step", step=1):
            probes(tl, (rate, skew), n=2, pause=0.01)
        tl.instant("done", "metric", loss=0.25)
        tl.close()
    WORLD.Barrier()
    if RANK == 0:
        out = shared_dir / "merged.json"
        assert timeline.main(["merge", str(out), *(str(shared_dir / f"t.json.copy{r}") for r in range(SIZE))]) == 0
        assert out.read_bytes() == path.read_bytes()
        trace = load(out)
        assert all(len(trace["otherData"]["ranks"][str(r)]["clock"]) == 2 for r in range(SIZE))
        assert len([e for e in trace["traceEvents"] if e["ph"] != "M"]) == 4 * SIZE
