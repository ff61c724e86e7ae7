"""torus.doctor on flight records built here (one process): the parting call and the rank named for a rank that
never entered a call, for ranks that called different collectives, for every rank timed out in one call (a cut
link), for a rank that left no record, and no problem named for a healthy job dumped with ranks a call apart;
the command line's exit statuses; the recorder's ring.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from torus import doctor, recorder


def _record(seq, state="done", op="allreduce", count=1000, error=None, start=100.0, end=None):
    return {"seq": seq, "op": op, "count": count, "dtype": "float32", "algorithm": "ring", "caller": "user",
            "start": start + seq, "end": None if state == "running" else (end or start + seq + 0.01),
            "state": state, "error": error, "transport": recorder.transport("ring")}


def _dump(rank, records, size=3, at=200.0, comm_id="c0ffee00"):
    return {"world_rank": rank, "world_size": size, "host": "h", "pid": 1, "reason": "test", "time": at,
            "communicators": [{"comm_id": comm_id, "rank": rank, "size": size, "world_ranks": list(range(size)),
                               "calls": max((r["seq"] for r in records), default=0), "records": records}]}


STALL = ("TimeoutError: allreduce(ring) on rank {r}: no progress for 15 s at step 2/4 waiting on rank 1 of the "
         "world communicator (a peer died, stalled or called a different collective); the communicator is "
         "unusable now, abort the job")


def test_a_rank_that_never_entered_the_call_is_named():
    ok = [_record(s) for s in (1, 2, 3)]
    dumps = [_dump(0, ok + [_record(4, "failed", error=STALL.format(r=0))]),
             _dump(1, ok),
             _dump(2, ok + [_record(4, "failed", error=STALL.format(r=2))])]
    lines = doctor.diagnose(dumps)
    text = "\n".join(lines)
    assert lines[0].startswith("torus doctor: communicator c0ffee00, 3 ranks"), text
    assert "the ranks part at call #4, allreduce of 1000 float32 (ring, MPI point-to-point plan)" in text
    assert "- rank 1 never entered it: its last call is #3 allreduce, done" in text
    assert "- rank 0 timed out at step 2/4 waiting on rank 1" in text
    assert "- rank 2 timed out at step 2/4 waiting on rank 1" in text


def test_ranks_that_call_different_collectives_are_named():
    ok = [_record(s, count=1000 + s) for s in (1, 2, 3)]
    dumps = [_dump(0, ok + [_record(4, "failed", count=1004, error="MismatchError: ...")]),
             _dump(1, ok + [_record(4, "failed", count=1005, error="MismatchError: ...")]),
             _dump(2, ok + [_record(4, "failed", count=1004, error="MismatchError: ...")])]
    text = "\n".join(doctor.diagnose(dumps))
    assert "the ranks part at call #4: they called different collectives:" in text
    assert "- ranks 0, 2: allreduce of 1004 float32" in text and "- rank 1: allreduce of 1005 float32" in text


def test_every_rank_waiting_in_one_call_names_each_ones_peer():
    """A cut link: every rank entered call #3 and timed out there, each waiting on a peer across the cut."""
    ok = [_record(s) for s in (1, 2)]
    wait = "TimeoutError: allreduce(ring) on rank {r}: no progress for 3 s at step 1/6 waiting on rank {p} of ..."
    dumps = [_dump(r, ok + [_record(3, "failed", error=wait.format(r=r, p=p))], size=4)
             for r, p in ((0, 3), (1, 2), (2, 1), (3, 0))]
    text = "\n".join(doctor.diagnose(dumps))
    assert "the ranks part at call #3, allreduce of 1000 float32" in text, text
    for r, p in ((0, 3), (1, 2), (2, 1), (3, 0)):
        assert f"- rank {r} timed out at step 1/6 waiting on rank {p}" in text, text


def test_a_rank_without_a_dump_is_named():
    ok = [_record(s) for s in (1, 2)]
    dumps = [_dump(0, ok + [_record(3, "failed", error=STALL.format(r=0))]),
             _dump(2, ok + [_record(3, "failed", error=STALL.format(r=2))])]
    text = "\n".join(doctor.diagnose(dumps))
    assert "the ranks part at call #3" in text
    assert "- rank 1 left no record" in text and "- rank 0 timed out at step 2/4 waiting on rank 1" in text


def test_a_healthy_job_caught_a_call_apart_is_not_a_problem():
    dumps = [_dump(0, [_record(s) for s in (1, 2, 3)] + [_record(4, "running")], size=2, at=104.5),
             _dump(1, [_record(s) for s in (1, 2, 3)], size=2, at=104.5)]
    assert doctor.diagnose(dumps) == ["torus doctor: communicator c0ffee00, 2 ranks (world ranks 0, 1), calls up "
                                      "to #4: the ranks agree and every recorded call finished"]


def test_a_call_running_long_after_a_rank_stopped_is_named():
    dumps = [_dump(0, [_record(s) for s in (1, 2, 3)] + [_record(4, "running")], size=2, at=200.0),
             _dump(1, [_record(s) for s in (1, 2, 3)], size=2, at=200.0)]
    text = "\n".join(doctor.diagnose(dumps))
    assert "the ranks part at call #4" in text and "- rank 1 never entered it" in text
    assert "- rank 0 is inside it (no error yet)" in text


def test_command_line(tmp_path, capsys):
    assert doctor.main([str(tmp_path)]) == 2
    ok = [_record(s) for s in (1, 2)]
    for rank, records in ((0, ok), (1, ok)):
        (tmp_path / f"torus-trace-rank{rank}.json").write_text(json.dumps(_dump(rank, records, size=2)))
    assert doctor.main([str(tmp_path)]) == 0
    (tmp_path / "torus-trace-rank1.json").write_text(json.dumps(_dump(1, ok[:1], size=2)))
    (tmp_path / "torus-trace-rank0.json").write_text(json.dumps(
        _dump(0, ok + [_record(3, "failed", error=STALL.format(r=0))], size=2)))
    assert doctor.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "- rank 1 never entered it: its last call is #1 allreduce, done" in out, out


@pytest.mark.parametrize("capacity", [0, 3])
def test_recorder_keeps_the_last_calls(capacity, monkeypatch):
    class _Comm:
        def bcast(self, value, root=0):
            return value

        def Get_rank(self):  # noqa: N802 - mpi4py's name
            return 0

        def Get_size(self):  # noqa: N802
            return 1

        def Get_group(self):  # noqa: N802
            from mpi4py import MPI
            return MPI.COMM_SELF.Get_group()
    rec = recorder.Recorder(_Comm(), capacity)
    for i in range(5):
        if rec.capacity:
            recorder.end(rec.begin("allreduce", 10 + i, np.dtype(np.float32), "shm"))
    held = rec.records()
    assert [h["seq"] for h in held] == ([3, 4, 5] if capacity else [])
    assert all(h["state"] == "done" and h["transport"] == "shared memory" and h["dtype"] == "float32"
               for h in held)
    assert [h["count"] for h in held] == ([12, 13, 14] if capacity else [])
