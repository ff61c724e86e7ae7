"""A per-rank event recorder that writes one merged Chrome trace: what each rank did, and when, on one time axis.

Every rank records spans and instants on named lanes (the train step, each gradient bucket's wait and
all-reduce, the metric all-reduce); ``close()`` gathers them to rank 0, which writes one file in the Trace
Event Format that Perfetto (ui.perfetto.dev) and chrome://tracing open::

    from torus import timeline
    tl = timeline.from_env(comm)         # TORUS_TIMELINE=FILE; None when unset (callers then record nothing)
    with tl.region("train_step", "step", step=12):
        ...
    tl.span("allreduce", "comm", t0, t1, bytes=n, algorithm="torus2d", bucket=3)
    tl.close()                           # collective: rank 0 writes FILE

Contract: ``Timeline(path, comm)``, ``save()`` and ``close()`` are collective over ``comm`` (every rank, in the
same order as its other collectives on ``comm``); ``span``, ``region`` and ``instant`` are local and
thread-safe (one lock, one list append), and record nothing after ``close``. Times are seconds from
``tl.clock``. Each rank's clock is mapped onto rank 0's by ping-pongs at construction and at close. A rank
keeps its first ``max_events`` events and counts the rest. ``close()`` is idempotent and writes atomically;
``close(collective=False)`` writes one ``path.rank<R>`` per rank where a gather would hang, and
``python -m torus.timeline merge OUT IN...`` joins them. The trace's layout, the clock estimate and its error:
docs/design.md, "The timeline".
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from torus import knobs

FORMAT = "torus.timeline/1"  # the per-rank payload (gathered by close, written by close(collective=False))
MAX_EVENTS = 200_000  # per rank; an event is about 200 bytes, so at most about 40 MB
PINGS = 8  # ping-pongs per rank and clock sample
_TAG = 0x7106  # on the Timeline's own duplicate of comm


class Timeline:
    """Records this rank's events; see the module docstring for the contract.

    Args:
        path: the merged trace, written by rank 0 at ``close()``.
        comm: an mpi4py intracommunicator; the constructor is collective over it (it duplicates ``comm`` and
            measures the clock offsets).
        lanes: lane names in the order the viewer should show them (rank 0's list counts); lanes not named
            follow in name order. Default: none, so all lanes in name order.
        max_events: events kept per rank (default ``MAX_EVENTS``); later ones are counted as dropped.
        clock: the time source in seconds (default ``time.perf_counter``); a test hook, e.g. a skewed clock.
    """

    def __init__(self, path: str | os.PathLike, comm, *, lanes: Sequence[str] = (),
                 max_events: int = MAX_EVENTS, clock: Callable[[], float] = time.perf_counter):
        self.path = os.fspath(path)
        self.rank = comm.Get_rank()
        if max_events < 0:
            raise ValueError(f"Timeline on rank {self.rank}: max_events {max_events} must be at least 0")
        self.clock = clock
        self._comm = comm.Dup()
        self._size = self._comm.Get_size()
        self._lanes = [str(lane) for lane in lanes]
        self._max = int(max_events)
        self._events: list[tuple] = []  # (lane, name, t0, t1 or None for an instant, args or None)
        self._dropped = 0
        self._lock = threading.Lock()
        self._closed = False
        self.saves = 0  # save() calls so far: a caller that saves once per phase can number its phases
        origin = self.clock()
        self._samples = [self._offset_sample()]
        # rank 0's construction time on its own clock (ts 0) and a name for this run, on every rank, so that
        # any subset of per-rank files merges
        self._origin, self._run = self._comm.bcast((origin, f"{socket.gethostname()}:{os.getpid()}:{origin!r}"))

    def span(self, name: str, lane: str, t0: float, t1: float, **args) -> None:
        """Record ``name`` on ``lane`` from ``t0`` to ``t1`` (seconds from ``self.clock``)."""
        self._add((lane, name, t0, t1, args or None))

    def instant(self, name: str, lane: str, **args) -> None:
        """Record ``name`` on ``lane`` now."""
        self._add((lane, name, self.clock(), None, args or None))

    @contextlib.contextmanager
    def region(self, name: str, lane: str, **args) -> Iterator[None]:
        """Record the ``with`` block as a span (also when it raises)."""
        t0 = self.clock()
        try:
            yield
        finally:
            self._add((lane, name, t0, self.clock(), args or None))

    def _add(self, event: tuple) -> None:
        with self._lock:
            if self._closed:
                return
            if len(self._events) < self._max:
                self._events.append(event)
            else:
                self._dropped += 1

    def save(self) -> None:
        """Collective: rank 0 writes the trace of every event so far to ``path`` (replacing an earlier save)
        and recording goes on (a clock sample is added, so drift is corrected up to now). After ``close``:
        nothing."""
        with self._lock:
            if self._closed:
                return
            events = list(self._events)
        self.saves += 1
        self._samples.append(self._offset_sample())
        payloads = self._comm.gather(self._payload(events), root=0)
        if self.rank == 0:
            _write_json(self.path, merge(payloads))

    def close(self, collective: bool = True) -> None:
        """Write the trace: collective (rank 0 writes ``path``), or with ``collective=False`` local (this rank
        writes ``path.rank<R>``). A second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not collective:
            _write_json(f"{self.path}.rank{self.rank}", self._payload(self._events))
            return
        self._samples.append(self._offset_sample())
        payloads = self._comm.gather(self._payload(self._events), root=0)
        self._comm.Free()
        if self.rank == 0:
            _write_json(self.path, merge(payloads))

    def _payload(self, events: list) -> dict:
        """This rank's ``events`` and clock samples: what ``close`` gathers and ``close(collective=False)``
        writes."""
        return {"format": FORMAT, "run": self._run, "rank": self.rank, "size": self._size,
                "host": socket.gethostname(), "origin_s": self._origin, "lanes": self._lanes,
                "clock": self._samples, "max_events": self._max, "dropped": self._dropped,
                "events": [[lane, name, t0, t1, _plain_args(args)] for lane, name, t0, t1, args in events]}

    def _offset_sample(self) -> dict:
        """One clock sample, collective: ``{"local_s", "offset_s", "error_s"}`` with rank 0's clock reading
        ``local_s + offset_s`` at this rank's ``local_s``, within ``error_s`` (half the shortest round trip)."""
        comm, buf = self._comm, np.zeros(1)
        if self.rank == 0:
            for peer in range(1, self._size):  # one rank at a time, so that round trips do not queue
                for _ in range(PINGS):
                    comm.Recv(buf, source=peer, tag=_TAG)
                    buf[0] = self.clock()
                    comm.Send(buf, dest=peer, tag=_TAG)
            return {"local_s": self.clock(), "offset_s": 0.0, "error_s": 0.0}
        best = (float("inf"), 0.0, 0.0)
        for _ in range(PINGS):
            ta = self.clock()
            comm.Send(buf, dest=0, tag=_TAG)
            comm.Recv(buf, source=0, tag=_TAG)
            tb = self.clock()
            best = min(best, (tb - ta, (ta + tb) / 2, float(buf[0]) - (ta + tb) / 2))
        rtt, middle, offset = best
        return {"local_s": middle, "offset_s": offset, "error_s": rtt / 2}


def from_env(comm, **kwargs) -> Timeline | None:
    """``Timeline(os.environ["TORUS_TIMELINE"], comm, **kwargs)``, or None where the variable is unset or empty.
    Collective when it is set: every rank must see the same value (mpiexec passes the environment on)."""
    path = knobs.read("TORUS_TIMELINE")
    return Timeline(path, comm, **kwargs) if path else None


def _plain_args(args: dict | None) -> dict | None:
    if not args:
        return None
    out: dict[str, Any] = {}
    for key, value in args.items():
        if isinstance(value, np.generic):
            value = value.item()
        finite = isinstance(value, float) and math.isfinite(value)
        plain = value is None or isinstance(value, (bool, int, str)) or finite
        out[str(key)] = value if plain else str(value)  # JSON has no NaN or infinity
    return out


def _offset_function(samples: list[dict]) -> Callable[[float], float]:
    """Offset to rank 0's clock at a local time: linear through the first and last sample, or constant."""
    first, last = samples[0], samples[-1]
    if last["local_s"] == first["local_s"]:
        return lambda t: first["offset_s"]
    slope = (last["offset_s"] - first["offset_s"]) / (last["local_s"] - first["local_s"])
    return lambda t: first["offset_s"] + slope * (t - first["local_s"])


def merge(payloads: Sequence[dict]) -> dict:
    """The trace (a dict for ``json.dump``) of per-rank payloads from one run, in any order; every rank's
    events placed on rank 0's clock, in microseconds from rank 0's construction. ValueError on payloads of
    another format or run, or a rank given twice."""
    if not payloads:
        raise ValueError("merge: no per-rank payloads")
    ranks = sorted(payloads, key=lambda p: p.get("rank", -1))
    for p in ranks:
        if p.get("format") != FORMAT:
            raise ValueError(f"merge: rank {p.get('rank')}: format {p.get('format')!r}, expected {FORMAT!r}")
        if p["run"] != ranks[0]["run"]:
            raise ValueError(f"merge: rank {p['rank']} is from run {p['run']}, rank {ranks[0]['rank']} from "
                             f"run {ranks[0]['run']}")
    seen = [p["rank"] for p in ranks]
    if len(set(seen)) != len(seen):
        raise ValueError(f"merge: rank {next(r for r in seen if seen.count(r) > 1)} given twice")
    origin = ranks[0]["origin_s"]
    order: dict[str, int] = {}
    for lane in ranks[0]["lanes"]:
        order.setdefault(lane, len(order) + 1)
    for lane in sorted({e[0] for p in ranks for e in p["events"]} - set(order)):
        order[lane] = len(order) + 1
    meta: list[dict] = []
    events: list[dict] = []
    info = {}
    for p in ranks:
        pid, offset = p["rank"], _offset_function(p["clock"])
        meta += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                  "args": {"name": f"rank {pid} ({p['host']})"}},
                 {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
        if p["dropped"]:
            meta.append({"name": "process_labels", "ph": "M", "pid": pid, "tid": 0,
                         "args": {"labels": f"dropped {p['dropped']} events (max_events {p['max_events']})"}})
        for lane in sorted({e[0] for e in p["events"]}, key=order.__getitem__):
            meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": order[lane], "args": {"name": lane}},
                     {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": order[lane],
                      "args": {"sort_index": order[lane]}}]
        for lane, name, t0, t1, args in p["events"]:
            ts = (t0 + offset(t0) - origin) * 1e6
            event: dict[str, Any] = {"name": name, "ph": "X" if t1 is not None else "i", "ts": round(ts, 3),
                                     "pid": pid, "tid": order[lane]}
            if t1 is None:
                event["s"] = "t"
            else:
                event["dur"] = round(max(0.0, (t1 + offset(t1) - origin) * 1e6 - ts), 3)
            if args:
                event["args"] = args
            events.append(event)
        info[str(pid)] = {"host": p["host"], "events": len(p["events"]), "dropped": p["dropped"],
                          "max_events": p["max_events"], "clock": p["clock"]}
    size = ranks[0]["size"]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"tool": FORMAT, "run": ranks[0]["run"], "size": size, "ranks": info,
                          "missing_ranks": sorted(set(range(size)) - set(seen)),
                          "time": "microseconds from rank 0's construction, on rank 0's clock"}}


def _write_json(path: str, obj) -> None:
    """Write ``obj`` to ``path`` atomically (a temporary file beside it, then ``os.replace``)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, separators=(",", ":"), allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m torus.timeline merge OUT IN...``: merge per-rank files into one trace."""
    parser = argparse.ArgumentParser(prog="python -m torus.timeline", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    m = commands.add_parser("merge", help="merge the per-rank files of close(collective=False) into one trace")
    m.add_argument("out", metavar="OUT", help="the merged trace (JSON)")
    m.add_argument("inputs", metavar="IN", nargs="+", help="per-rank files (PATH.rank<R>)")
    args = parser.parse_args(argv)
    payloads = []
    for name in args.inputs:
        try:
            with open(name) as f:
                payloads.append(json.load(f))
        except (OSError, ValueError) as e:
            parser.error(f"merge: {name}: {e}")
    try:
        trace = merge(payloads)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        parser.error(f"{e}" if isinstance(e, ValueError) else f"merge: not a per-rank file: {e!r}")
    _write_json(args.out, trace)
    print(f"{args.out}: {len(trace['otherData']['ranks'])} ranks, {len(trace['traceEvents'])} events"
          + (f", missing ranks {trace['otherData']['missing_ranks']}" if trace["otherData"]["missing_ranks"]
             else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
