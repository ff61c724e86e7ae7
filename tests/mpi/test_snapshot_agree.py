"""agree_newest and node_writer (torus/snapshot/agree.py) under mpiexec, correct at any rank count.

Each rank has a folder of its own, as each node has its own storage. Rank ``r`` holds steps ``n_r - 5`` and
``n_r`` (``n_r = 100 + 10 * ((r + 1) // 2)``) unless ``r % 3 == 2`` (none), so from 5 ranks two ranks hold the
newest. The lowest rank holding the largest ``n_r`` has that file damaged (so it falls back to its older one,
and the newest may then be elsewhere or older), or a damaged newer one on top. The last rank also holds a
newer snapshot of another model key in the same job folder, and every rank a much newer one of another job.
The expected step and sender come from that plan alone (``_expected``); the expected arrays from the step's
seed (``_contents``), the expected meta from the sender's rank. Every rank's result is compared with them and,
by CRC-32, with every other rank's.
"""
from __future__ import annotations

import shutil
import tempfile
import warnings
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import torus
from torus.snapshot import SnapshotCorrupt, SnapshotSkipped, SnapshotStore, agree, agree_newest, node_writer

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
JOB, KEY = "job-42", "model-abc"
TIMEOUT = 60.0


@pytest.fixture
def folder():
    """A folder of this rank's own: its node's storage."""
    path = tempfile.mkdtemp(prefix=f"torus-snapshot-rank{RANK}-")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def _contents(step: int) -> dict:
    """The arrays every writer of ``step`` saves (the same on every rank: seeded by the step)."""
    rng = np.random.default_rng([step, 42])
    return {"dense/kernel": rng.standard_normal((33, 17)).astype(np.float32),
            "dense/bias16": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
            "iterations": np.array(step, np.int64),
            "empty": np.zeros((0, 4), np.float64),
            "mask": rng.integers(0, 2, 3).astype(bool),
            "big": rng.standard_normal(1 << 18).astype(np.float32)}  # 1 MiB


def _plan(size: int, damage: str) -> dict:
    """rank -> [(step, damaged)] it holds. ``damage``: "newest", the lowest rank holding the largest step
    has that file damaged; "newer", it has a damaged file one step newer on top."""
    newest = {r: 100 + 10 * ((r + 1) // 2) for r in range(size) if r % 3 != 2}
    top = max(newest.values())
    damaged = min(r for r, n in newest.items() if n == top)
    plan = {r: [(n - 5, False), (n, damage == "newest" and r == damaged)] for r, n in newest.items()}
    if damage == "newer":
        plan[damaged].append((top + 1, True))
    return plan


def _expected(size: int, damage: str) -> tuple[int, int]:
    """(step, sender): the newest undamaged step any rank holds, and the lowest rank holding it."""
    valid = [(step, r) for r, held in _plan(size, damage).items() for step, bad in held if not bad]
    step = max(s for s, _ in valid)
    return step, min(r for s, r in valid if s == step)


def _save(store: SnapshotStore, step: int, meta: dict) -> None:
    store.save_async(step, _contents(step), meta)
    assert store.wait(60) and not store.errors, store.errors


def _digest(step: int, arrays: dict, meta: dict) -> int:
    crc = zlib.crc32(repr((step, sorted(meta.items()))).encode())
    for name in sorted(arrays):
        crc = zlib.crc32(f"{name}:{arrays[name].dtype}:{arrays[name].shape}".encode(), crc)
        crc = zlib.crc32(arrays[name].tobytes(), crc)
    return crc


@pytest.mark.parametrize("damage", ["newest", "newer"])
@pytest.mark.parametrize("chunk", [None, 100_000])  # the default, and many chunks (not a multiple of 64)
def test_ranks_agree_on_the_newest_snapshot_any_rank_holds(folder, monkeypatch, chunk, damage):
    if chunk:
        monkeypatch.setattr(agree, "CHUNK_BYTES", chunk)
    store = SnapshotStore(folder, JOB, KEY, keep=10)
    plan = _plan(SIZE, damage)
    for step, bad in plan.get(RANK, []):
        _save(store, step, {"writer": RANK, "step": step})
        if bad:
            path = store.path(step)
            raw = bytearray(path.read_bytes())
            raw[len(raw) * 2 // 3] ^= 0x10
            path.write_bytes(bytes(raw))
    with SnapshotStore(folder, "another-job", KEY) as other:
        _save(other, 10**6, {})
    if RANK == SIZE - 1:
        with SnapshotStore(folder, JOB, "another-model") as other:
            _save(other, 10**5, {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = agree_newest(WORLD, store, TIMEOUT)
    skipped = sorted(str(w.message).split(":")[0].split()[-1] for w in caught
                     if issubclass(w.category, SnapshotSkipped))
    expect_skipped = sorted(str(store.path(s)) for s, bad in plan.get(RANK, []) if bad)
    assert skipped == expect_skipped, [str(w.message) for w in caught]

    step, sender = _expected(SIZE, damage)
    assert result is not None
    got_step, arrays, meta = result
    assert got_step == step and meta == {"writer": sender, "step": step}, (got_step, meta, step, sender)
    want = _contents(step)
    assert list(arrays) == list(want)
    for name, a in want.items():
        b = arrays[name]
        assert (b.dtype, b.shape) == (a.dtype, a.shape) and b.tobytes() == a.tobytes(), f"rank {RANK}: {name}"
    every = WORLD.allgather(_digest(got_step, arrays, meta))
    assert len(set(every)) == 1, f"ranks got different snapshots: {every}"
    store.close()


def test_no_rank_holds_one(folder):
    with SnapshotStore(folder, "another-job", KEY) as other:  # never this job's
        _save(other, 7, {})
    with SnapshotStore(folder, JOB, KEY) as store:
        assert agree_newest(WORLD, store, TIMEOUT) is None
    WORLD.Barrier()


def test_a_torus_comm_serves_too(folder):
    tc = torus.TorusComm(timeout=TIMEOUT)
    with SnapshotStore(folder, JOB, KEY) as store:
        if RANK == SIZE - 1:
            _save(store, 3, {"writer": RANK})
        step, arrays, meta = agree_newest(tc, store, TIMEOUT)
    assert (step, meta) == (3, {"writer": SIZE - 1})
    assert arrays["big"].tobytes() == _contents(3)["big"].tobytes()
    tc.Free()


def test_an_unreadable_folder_counts_as_none(folder, monkeypatch):
    with SnapshotStore(folder, JOB, KEY) as store:
        if RANK == 0:
            _save(store, 9, {"writer": 0})
        if RANK == SIZE - 1:
            def refused():
                raise PermissionError(13, "Permission denied", str(store.folder))
            monkeypatch.setattr(store, "load_newest", refused)
            with pytest.warns(SnapshotSkipped, match=f"agree_newest on rank {RANK}: cannot list .*Permission "
                                                     "denied.*this rank holds none"):
                result = agree_newest(WORLD, store, TIMEOUT)
        else:
            result = agree_newest(WORLD, store, TIMEOUT)
    if SIZE == 1:
        assert result is None
    else:
        assert result is not None and result[0] == 9 and result[2] == {"writer": 0}
    WORLD.Barrier()


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs a second rank")
def test_ranks_with_different_keys_all_raise(folder):
    key = "another-model" if RANK == SIZE - 1 else KEY
    with SnapshotStore(folder, JOB, key) as store:
        _save(store, 5, {})
        with pytest.raises(torus.MismatchError, match=f"agree_newest on rank {RANK}: ranks disagree on the "
                                                      f"model key \\(.*rank {SIZE - 1} has 'another-model'\\)"):
            agree_newest(WORLD, store, TIMEOUT)
    WORLD.Barrier()


@pytest.mark.skipif(SIZE < 2, reason="a receiver needs a second rank")
def test_a_failed_check_on_one_receiver_raises_on_every_rank(folder, monkeypatch):
    last = SIZE - 1
    if RANK == last:
        def damaged(buffer, source):
            buffer[-1] ^= 1  # as if the last byte had arrived wrong
            return real(buffer, source)
        real = agree.format.parse
        monkeypatch.setattr(agree.format, "parse", damaged)
    with SnapshotStore(folder, JOB, KEY) as store:
        if RANK == 0:
            _save(store, 9, {})
        here = " \\(here: checksum mismatch" if RANK == last else ";"
        with pytest.raises(SnapshotCorrupt, match=f"of step 9 sent by rank 0: failed its check on rank {last}"
                                                  f"{here}.*not loaded on any rank"):
            agree_newest(WORLD, store, TIMEOUT)
    WORLD.Barrier()


@pytest.mark.parametrize("rpn", [1, 2, 3, None])  # None: the real nodes (one machine here)
@pytest.mark.parametrize("how", ["argument", "environment", "TorusComm"])
def test_node_writer_is_one_rank_per_node(monkeypatch, rpn, how):
    if how == "environment" and rpn:
        monkeypatch.setenv("TORUS_RANKS_PER_NODE", str(rpn))
    else:
        monkeypatch.delenv("TORUS_RANKS_PER_NODE", raising=False)
    if how == "TorusComm":
        tc = torus.TorusComm(ranks_per_node=rpn, timeout=TIMEOUT)
        mine = node_writer(tc)
        with pytest.raises(ValueError, match="ranks_per_node is for an mpi4py communicator"):
            node_writer(tc, ranks_per_node=2)
        tc.Free()
    else:
        mine = node_writer(WORLD, rpn if how == "argument" else None)
    writers = WORLD.allgather(mine)
    per_node = rpn or SIZE  # every rank of this job runs on one machine
    assert writers == [r % per_node == 0 for r in range(SIZE)], writers
    nodes = -(-SIZE // per_node)
    assert sum(writers) == nodes


@pytest.mark.skipif(SIZE < 2, reason="a stall needs a second rank")
def test_a_rank_that_never_calls_times_the_others_out(folder):
    """Last in this file: the communicator is left with the others' abandoned requests."""
    comm = WORLD.Dup()
    with SnapshotStore(folder, JOB, KEY) as store:
        if RANK != SIZE - 1:
            with pytest.raises(torus.TimeoutError, match=f"agree_newest on rank {RANK}: no progress for 2 s "
                                                         "duplicating the communicator: some rank did not "
                                                         "call agree_newest"):
                agree_newest(comm, store, 2.0)
    WORLD.Barrier()
