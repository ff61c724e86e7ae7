"""What only the shared-memory transport (algorithm="shm", torus/runtime/shm.py) has: buffers many times the
window's segment, back-to-back calls of changing sizes and collectives without a barrier between them, the
per-step signature check, the stall timeout at a step, the refusal across nodes and the TORUS_ALGO override.
The shared cases (oracle.CASES: every dtype, op, count, placement and recvcounts pattern) cover it too.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import torus
from oracle import SIZE, WORLD, assert_matches, assert_same_on_all_ranks, expected, make, one_node, sentinel, torus_comm

RANK, LAST = WORLD.Get_rank(), SIZE - 1
pytestmark = pytest.mark.skipif(not one_node(), reason="the ranks span several nodes; shm serves one node")


def _reference_reduce_scatter(x, counts, op):
    ref, bound = expected(x, op, exact=True)
    lo = sum(counts[:RANK])
    return ref[lo:lo + counts[RANK]], bound


def _reference_allgather(block, counts):
    out = np.empty(sum(counts), block.dtype)
    displs = np.cumsum([0, *counts[:-1]])
    WORLD.Allgatherv(block, [out, (counts, displs)])
    return out


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int64])
@pytest.mark.parametrize("mode", ["in", "out"])
def test_buffers_many_times_the_segment(mode, dtype, rng):
    """1 KiB segments: a 30,011-element all-reduce takes tens to hundreds of steps, alternating buffers."""
    tc, algo = torus_comm("shm", segment_bytes=1024)
    for op in ("sum", "max", "avg" if np.dtype(dtype).kind == "f" else "min"):
        x = make(rng, dtype, op, 30_011)
        ref, bound = expected(x, op)
        if mode == "in":
            out = x.copy()
            tc.allreduce(torus.IN_PLACE, out, op=op, algorithm=algo)
        else:
            out = tc.allreduce(x, sentinel(x.size, x.dtype), op=op, algorithm=algo)
        what = f"allreduce(shm, {op}, {np.dtype(dtype)}, 30011, {mode})"
        assert_matches(out, ref, bound, what)
        assert_same_on_all_ranks(out, what)


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_outputs_copied_out_with_streaming_stores(monkeypatch, offset, rng):
    """Out of place from STREAM_MIN_BYTES (lowered here to 4 KiB) the copy out uses non-temporal stores: an
    output that starts ``offset`` elements past a 16-byte boundary, with a count that leaves a ragged tail,
    holds numpy's result; all-gather as well (its copy out is the same code)."""
    monkeypatch.setattr(torus.runtime.shm, "STREAM_MIN_BYTES", 4096)
    tc, algo = torus_comm("shm", segment_bytes=8192)
    n = 50_003
    x = make(rng, np.float32, "sum", n)
    backing = sentinel(n + 4, x.dtype)
    out = backing[offset:offset + n]
    tc.allreduce(x, out, algorithm=algo)
    what = f"allreduce(shm, sum, float32, {n}, out of place at +{offset})"
    assert_matches(out, *expected(x, "sum"), what)
    assert_same_on_all_ranks(out, what)
    counts = [n // SIZE + r for r in range(SIZE)]
    block = make(rng, np.float32, "max", counts[RANK])
    gathered = sentinel(sum(counts) + 4, block.dtype)[offset:offset + sum(counts)]
    tc.allgather(block, gathered, recvcounts=counts, algorithm=algo)
    assert gathered.tobytes() == _reference_allgather(block, counts).tobytes()


def test_calls_either_side_of_the_one_step_size(rng):
    """All-reduces up to WHOLE_MAX_BYTES run in one step, each rank reducing everything from the slots
    (ranks in a fixed order, so every rank's result is the same); larger ones take the pipelined steps.
    Alternating them back to back, in and out of place, with avg and max: every result is numpy's and the
    same on every rank."""
    tc, algo = torus_comm("shm")
    edge = torus.runtime.shm.WHOLE_MAX_BYTES // 4
    calls = []
    for i, n in enumerate([edge, edge + 1, 1, edge - 1, 3 * edge + 7, edge, 2, edge + 1]):
        op = ("avg", "max")[i % 2]
        x = make(rng, np.float32, op, n)
        if i % 3 == 0:
            out = x.copy()
            tc.allreduce(torus.IN_PLACE, out, op=op, algorithm=algo)
        else:
            out = tc.allreduce(x, sentinel(n, x.dtype), op=op, algorithm=algo)
        calls.append((x, op, out))
    for i, (x, op, out) in enumerate(calls):
        what = f"call {i}: allreduce(shm, {op}) of {x.size} float32"
        assert_matches(out, *expected(x, op), what)
        assert_same_on_all_ranks(out, what)


def test_back_to_back_calls_of_changing_sizes(rng):
    """40 calls, sizes and collectives changing every call (0 and 1 element among them), no synchronisation
    between them: every call's result is checked only after all have run, so a stale segment or flag from
    an earlier call (of another size) would show as a wrong value."""
    tc, algo = torus_comm("shm", segment_bytes=256)
    sizes = [0, 1, 300, 5, 4096, 1, 0, 77, 10_001, 3]
    calls = []
    for i in range(40):
        n = sizes[i % len(sizes)] + i
        kind = ("allreduce", "reduce_scatter", "allgather")[i % 3]
        counts = [(n + r) % 11 for r in range(SIZE)]
        if kind == "allreduce":
            x = make(rng, np.float64, "sum", n)
            calls.append((kind, x, counts, tc.allreduce(x, algorithm=algo)))
        elif kind == "reduce_scatter":
            x = make(rng, np.int32, "sum", sum(counts))
            calls.append((kind, x, counts, tc.reduce_scatter(x, recvcounts=counts, algorithm=algo)))
        else:
            x = make(rng, np.float32, "max", counts[RANK])
            calls.append((kind, x, counts, tc.allgather(x, recvcounts=counts, algorithm=algo)))
    for i, (kind, x, counts, out) in enumerate(calls):
        what = f"call {i}: {kind}(shm) of {x.size} elements"
        if kind == "allreduce":
            assert_matches(out, *expected(x, "sum"), what)
        elif kind == "reduce_scatter":
            assert_matches(out, *_reference_reduce_scatter(x, counts, "sum"), what)
        else:
            assert out.tobytes() == _reference_allgather(x, counts).tobytes(), what
        if kind != "reduce_scatter":  # each rank holds its own block there
            assert_same_on_all_ranks(out, what)


@pytest.mark.skipif(SIZE < 2, reason="a stall needs a second rank")
def test_a_peer_that_never_copies_in_is_a_timeout_naming_it():
    tc = torus.TorusComm(check=False, timeout=2, segment_bytes=4096)
    x = np.ones(10, np.float64)
    assert np.array_equal(tc.allreduce(x, algorithm="shm"), np.full(10, float(SIZE)))  # window set up
    if RANK != LAST:
        with pytest.raises(torus.TimeoutError) as info:
            tc.allreduce(x, algorithm="shm")
        msg = str(info.value)
        assert msg.startswith(f"allreduce(shm) on rank {RANK}: no progress for 2 s at step 1/1 waiting on rank "
                              f"{LAST} of the shared-memory window to copy in its input"), msg
        assert "abort the job" in msg, msg
        with pytest.raises(torus.TorusError, match="unusable after an earlier failure"):
            tc.allreduce(x, algorithm="shm")
    WORLD.Barrier()


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs a second rank")
def test_a_peer_with_another_count_is_a_mismatch_even_with_the_check_off():
    tc = torus.TorusComm(check=False, timeout=60, segment_bytes=4096)
    n = 20 if RANK == LAST else 24
    with pytest.raises(torus.MismatchError, match=f"allreduce\\(shm\\) on rank {RANK}: rank [0-9]+ called a "
                                                  "different collective, dtype, op or counts"):
        tc.allreduce(np.ones(n, np.float32), algorithm="shm")
    WORLD.Barrier()


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs a second rank")
@pytest.mark.parametrize("n", [100, 5000, 70_000])
def test_a_mismatch_once_the_window_is_open_names_the_argument_and_leaves_it_usable(n, rng):
    """With the argument check on, shm calls skip its all-gather once the window is open; a peer with another
    count then fails every rank at the call's first step, which runs the all-gather to say what differs
    (the count, per rank), and later calls still run (one-step, stepped and both-sizes calls)."""
    tc, algo = torus_comm("shm")
    tc.allreduce(np.ones(8, np.float32), algorithm=algo)  # the window is open from here on
    mine = n + 1 if RANK == LAST else n
    for _ in range(2):
        with pytest.raises(torus.MismatchError, match=f"on rank {RANK}: ranks disagree on count .*rank {LAST} "
                                                      f"has {n + 1}"):
            tc.allreduce(np.ones(mine, np.float32), algorithm=algo)
    x = make(rng, np.float64, "sum", n)
    out = tc.allreduce(x, algorithm=algo)
    assert_matches(out, *expected(x, "sum"), f"allreduce(shm) of {n} after the mismatch")
    assert_same_on_all_ranks(out, "after the mismatch")


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs a second rank")
def test_reduce_scatter_recvcounts_that_differ_are_named_once_the_window_is_open():
    """Same total, other blocks on the last rank: the step's header differs, and the all-gather names each
    rank's recvcounts (the signature carries only their checksum)."""
    tc, algo = torus_comm("shm")
    tc.allreduce(np.ones(8, np.float32), algorithm=algo)
    blocks = list(range(1, SIZE + 1))
    mine = blocks[::-1] if RANK == LAST else blocks
    most = "rank 0 has" if SIZE == 2 else f"ranks 0-{LAST - 1} have"
    named = f"recvcounts ({most} {blocks}; rank {LAST} has {blocks[::-1]})"
    with pytest.raises(torus.MismatchError, match=re.escape(named)):
        tc.reduce_scatter(np.ones(sum(blocks), np.float32), recvcounts=mine, algorithm=algo)
    x = np.full(sum(blocks), RANK + 1.0)
    out = tc.reduce_scatter(x, recvcounts=blocks, algorithm=algo)
    assert (out == SIZE * (SIZE + 1) / 2).all() and out.size == blocks[RANK]


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs a second rank")
@pytest.mark.parametrize("other", ["ring", "native"])
def test_a_rank_on_another_algorithm_is_a_mismatch_not_a_stall(other, rng):
    """Window open, check on: the last rank runs ``other`` while the rest run shm. Its header says so, so
    every rank raises MismatchError naming the algorithms at once (well inside the 20 s stall timeout, which
    would be a TimeoutError), twice in a row; then shm and ``other`` calls both still match numpy."""
    tc = torus.TorusComm(timeout=20)
    try:
        tc.allreduce(np.ones(8, np.float32), algorithm="shm")  # the window is open from here on
        for n in (100, 70_000):
            algo = other if RANK == LAST else "shm"
            with pytest.raises(torus.MismatchError, match=f"on rank {RANK}: ranks disagree on algorithm "
                                                          f".*rank {LAST} has {other}"):
                tc.allreduce(np.ones(n, np.float32), algorithm=algo)
        for algo in ("shm", other, "shm"):
            x = make(rng, np.float64, "sum", 5000)
            out = tc.allreduce(x, algorithm=algo)
            assert_matches(out, *expected(x, "sum"), f"allreduce({algo}) after the mismatch")
            assert_same_on_all_ranks(out, f"allreduce({algo}) after the mismatch")
    finally:
        tc.Free()


def test_a_freed_alloc_buffer_is_refused_not_a_crash():
    """After free_alloc (and for a buffer still allocated, after TorusComm.Free) a call or a write is an
    error, and a read, of the array or of a view made before, sees zeros (one rank: its last values)
    instead of a SIGSEGV."""
    tc, algo = torus.TorusComm(timeout=60), "shm"
    a = tc.alloc(1000, np.float32)
    kept = tc.alloc(70_000, np.float64)
    a[:] = RANK + 1
    kept[:] = RANK + 1
    view = a[10:]
    tc.allreduce(torus.IN_PLACE, a, algorithm=algo)
    assert a[0] == SIZE * (SIZE + 1) / 2
    tc.free_alloc(a)
    # Zeros where the ranks shared pages; one rank's buffer is its own memory, which keeps its values.
    left = a[0] if SIZE == 1 else 0
    assert (a == left).all() and (view == left).all(), "a freed buffer reads safely"
    with pytest.raises(ValueError, match=f"on rank {RANK}: recvbuf \\(in place\\) is read-only"):
        tc.allreduce(torus.IN_PLACE, a, algorithm=algo)
    with pytest.raises(ValueError, match="read-only"):
        a[:] = 1
    with pytest.raises(ValueError, match=f"free_alloc on rank {RANK}: this array was freed already"):
        tc.free_alloc(a)
    tc.Free()
    assert (kept == (RANK + 1 if SIZE == 1 else 0)).all(), "an alloc buffer left at Free reads safely"
    assert not kept.flags.writeable


@pytest.mark.skipif(SIZE < 2, reason="one rank per node needs two ranks")
@pytest.mark.parametrize("forced", [False, True])
def test_refused_when_the_ranks_span_nodes(monkeypatch, forced):
    """Emulated nodes of one rank: refused locally, before any communication (the check is off, so a rank
    that went ahead would leave the others waiting; each raises on its own)."""
    tc = torus.TorusComm(check=False, timeout=10, ranks_per_node=1)
    if forced:
        monkeypatch.setenv("TORUS_ALGO", "shm")
    with pytest.raises(ValueError, match=f"allreduce on rank {RANK}: algorithm 'shm' needs every rank on one "
                                         f"node; these {SIZE} ranks are on {SIZE} nodes"):
        tc.allreduce(np.ones(4), algorithm="auto" if forced else "shm")
    WORLD.Barrier()


def test_torus_algo_selects_it(monkeypatch, rng):
    monkeypatch.setenv("TORUS_ALGO", "shm")
    tc = torus.TorusComm(timeout=60)
    x = make(rng, np.int64, "sum", 1000)
    out = tc.allreduce(x)  # auto, overridden
    assert_matches(out, *expected(x, "sum"), "allreduce(auto -> shm)")
    assert tc._shm._seq > 0, "TORUS_ALGO=shm did not run the shared-memory transport"
    tc.Free()


@pytest.mark.skipif(SIZE < 2, reason="a peer's argument error needs a second rank")
@pytest.mark.parametrize("check", [True, False])
def test_a_peer_that_rejects_its_arguments_is_named_without_the_all_gather(check, rng):
    """Once the window is open, shm calls skip the argument all-gather: a rank whose own arguments fail
    (avg on int64) says so in its shm header, the others raise MismatchError naming it. With the check on
    the ranks stay in step (the next call is right); with it off the transport refuses further calls."""
    tc = torus.TorusComm(check=check, timeout=60, segment_bytes=4096)
    x = make(rng, np.int64, "sum", 100)
    assert_matches(tc.allreduce(x, algorithm="shm"), *expected(x, "sum"), "allreduce(shm) opening the window")
    if RANK == LAST:
        with pytest.raises(TypeError, match=f"allreduce on rank {RANK}: "):
            tc.allreduce(x, op="avg", algorithm="shm")
    else:
        with pytest.raises(torus.MismatchError, match=f"allreduce\\(shm\\) on rank {RANK}: rank {LAST} rejected "
                                                      "its own arguments"):
            tc.allreduce(x, algorithm="shm")
    if check:
        x = make(rng, np.int64, "sum", 5000)
        assert_matches(tc.allreduce(x, algorithm="shm"), *expected(x, "sum"), "allreduce(shm) after the error")
    else:
        with pytest.raises(torus.TorusError, match="unusable after an earlier failure"):
            tc.allreduce(x, algorithm="shm")
    WORLD.Barrier()
    tc.Free()


@pytest.fixture(scope="module")
def alloc_comm():
    tc = torus.TorusComm(timeout=60, segment_bytes=4096)
    yield tc
    tc.Free()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int32, np.float64])
@pytest.mark.parametrize("count", [0, 1, 7, 30_011])
def test_an_alloc_buffer_is_reduced_where_it_lies(alloc_comm, dtype, count, rng):
    """TorusComm.alloc's array, all-reduced in place, matches MPI and the ordinary shm path bit for bit on
    every rank, call after call with fresh data (so nothing stale survives), between ordinary calls."""
    tc = alloc_comm
    a = tc.alloc(count, dtype)
    assert a.shape == (count,) and a.dtype == np.dtype(dtype)
    for op in ("sum", "max", "avg" if np.dtype(dtype).kind == "f" else "prod"):
        x = make(rng, dtype, op, count)
        a[:] = x
        plain = x.copy()
        tc.allreduce(torus.IN_PLACE, plain, op=op, algorithm="shm")
        out = tc.allreduce(torus.IN_PLACE, a, op=op, algorithm="shm")
        what = f"allreduce(shm, alloc, {op}, {np.dtype(dtype)}, {count})"
        assert out is a, what
        assert_matches(a, *expected(x, op), what)
        assert a.tobytes() == plain.tobytes(), what
        assert_same_on_all_ranks(a, what)


def test_free_alloc_then_alloc_again(alloc_comm, rng):
    """free_alloc releases one buffer (collective); buffers made after it reduce right, and a view or an
    ordinary array is refused before anything is freed."""
    tc = alloc_comm
    keep, gone = tc.alloc(50, np.int64), tc.alloc(50, np.int64)
    with pytest.raises(ValueError, match=f"free_alloc on rank {RANK}: not an array from TorusComm.alloc"):
        tc.free_alloc(gone[1:])
    with pytest.raises(ValueError, match=f"free_alloc on rank {RANK}: not an array from TorusComm.alloc"):
        tc.free_alloc(np.zeros(50, np.int64))
    tc.free_alloc(gone)
    for a in (tc.alloc(50, np.int64), keep, tc.alloc(9, np.int64)):
        x = make(rng, np.int64, "sum", a.size)
        a[:] = x
        tc.allreduce(torus.IN_PLACE, a, algorithm="shm")
        assert_matches(a, *expected(x, "sum"), f"allreduce(shm, alloc after free_alloc, {a.size})")


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs a second rank")
def test_an_alloc_buffer_against_an_ordinary_one_is_a_mismatch():
    tc = torus.TorusComm(check=False, timeout=60)
    a = tc.alloc(100, np.float32)
    a[:] = 1
    buf = a if RANK != LAST else np.ones(100, np.float32)
    with pytest.raises(torus.MismatchError, match=f"allreduce\\(shm\\) on rank {RANK}: rank [0-9]+ called a "):
        tc.allreduce(torus.IN_PLACE, buf, algorithm="shm")
    WORLD.Barrier()
    tc.Free()


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs a second rank")
def test_alloc_and_free_alloc_that_disagree_are_a_mismatch_not_a_hang(alloc_comm, rng):
    """alloc with another count or dtype on the last rank, and two buffers freed in another order there:
    MismatchError on every rank naming what differs, well inside the stall timeout (before: a hang that the
    timeout did not end, or arrays of different sizes); nothing is allocated or freed, so the same buffers
    then free in the same order and reduce right."""
    tc = alloc_comm
    for count, dtype, field in ((100 + (RANK == LAST), np.float32, f"count .*rank {LAST} has 101"),
                                (100, np.float64 if RANK == LAST else np.float32, f"dtype .*rank {LAST} has float64")):
        with pytest.raises(torus.MismatchError, match=f"alloc on rank {RANK}: ranks disagree on {field}"):
            tc.alloc(count, dtype)
    a, b = tc.alloc(30, np.float64), tc.alloc(30, np.float64)
    with pytest.raises(torus.MismatchError, match=f"free_alloc on rank {RANK}: ranks disagree on which buffer"):
        tc.free_alloc(b if RANK == LAST else a)
    x = make(rng, np.float64, "sum", 30)
    b[:] = x
    tc.allreduce(torus.IN_PLACE, b, algorithm="shm")
    assert_matches(b, *expected(x, "sum"), "allreduce(shm) of an alloc buffer after the mismatched free")
    tc.free_alloc(a)
    tc.free_alloc(b)


def test_a_freed_torus_comm_refuses_calls():
    tc = torus.TorusComm(timeout=30)
    tc.allreduce(np.ones(4), algorithm="shm")
    tc.Free()
    for call in (lambda: tc.allreduce(np.ones(4)), lambda: tc.alloc(4), tc.Free):
        with pytest.raises(torus.TorusError, match=f"on rank {RANK}: this TorusComm was freed"):
            call()


@pytest.mark.skipif(SIZE < 2, reason="one rank per node needs two ranks")
def test_alloc_is_refused_across_nodes():
    tc = torus.TorusComm(check=False, timeout=10, ranks_per_node=1)
    with pytest.raises(ValueError, match=f"alloc on rank {RANK}: shared memory needs every rank on one node"):
        tc.alloc(4, np.float32)
    with pytest.raises(TypeError, match=f"alloc on rank {RANK}: dtype complex64"):
        tc.alloc(4, np.complex64)
    WORLD.Barrier()


@pytest.mark.parametrize("count, error, text", [(-1, ValueError, "count -1 is negative"),
                                                (10.0, TypeError, "count must be an integer, got 10.0"),
                                                ("10", TypeError, "count must be an integer")])
def test_alloc_rejects_a_bad_count_before_any_message(alloc_comm, count, error, text):
    """Every rank makes the same bad call: each raises its own error, and the communicator goes on."""
    with pytest.raises(error, match=f"alloc on rank {RANK}: {text}"):
        alloc_comm.alloc(count, np.float32)
    a = alloc_comm.alloc(3, np.int32)
    a[:] = 1
    alloc_comm.allreduce(torus.IN_PLACE, a, algorithm="shm")
    assert (a == SIZE).all()
    alloc_comm.free_alloc(a)
