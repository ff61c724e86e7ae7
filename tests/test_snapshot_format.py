"""Snapshot files and the node's store (torus/snapshot), in one process: exact round trips of many dtypes and
shapes; every truncation and every flipped byte of a small file refused as SnapshotCorrupt; a crash before the
rename leaves the previous file; the newest two kept; other jobs and keys never returned; latest wins.

The layout checks read the bytes with ``struct`` and ``zlib`` directly (the format's docstring is the spec),
not through the module under test.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
import zlib

import numpy as np
import pytest

from torus.snapshot import Cadence, SnapshotCorrupt, SnapshotSkipped, SnapshotStore, format, store

ml_dtypes = pytest.importorskip("ml_dtypes")


def _random(rng, dtype, shape) -> np.ndarray:
    """Random contents for any dtype: random bytes where every bit pattern is a value (NaN payloads
    included), else values drawn per kind."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if dtype.kind in "US":
        return np.array(["".join(rng.choice(list("abcxyz"), rng.integers(0, 4))) for _ in range(n)],
                        dtype).reshape(shape)
    if dtype.kind in "mM":
        return rng.integers(-10**9, 10**9, n).astype(dtype).reshape(shape)
    if dtype.name in ("int4", "uint4"):
        lo, hi = (-8, 8) if dtype.name == "int4" else (0, 16)
        return rng.integers(lo, hi, n).astype(dtype).reshape(shape)
    return np.frombuffer(rng.bytes(n * dtype.itemsize), dtype).reshape(shape).copy()


DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
          ml_dtypes.int4, np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint8, np.bool_, np.complex64,
          np.complex128, ">f4", ">i8", "<U3", "S5", "datetime64[s]", "timedelta64[ms]"]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (2, 3, 4, 1)]


def _same(a: np.ndarray, b: np.ndarray, name: str) -> None:
    assert b.dtype == a.dtype, f"{name}: dtype {b.dtype} != {a.dtype}"
    assert b.shape == a.shape, f"{name}: shape {b.shape} != {a.shape}"
    assert b.tobytes() == a.tobytes(), f"{name}: bytes differ"


def test_round_trip_every_dtype_and_shape_bitwise(tmp_path, rng):
    arrays = {f"{np.dtype(d).name}/{'x'.join(map(str, s)) or 'scalar'}": _random(rng, d, s)
              for d in DTYPES for s in SHAPES}
    arrays["strided view"] = _random(rng, np.float32, (6, 8))[::2, 1::3]  # copied on writing
    arrays[""] = np.array(7, np.int8)  # any str is a name
    arrays["weird/name é"] = _random(rng, np.float32, (3,))
    meta = {"epoch": 3, "position": [1, 2], "lr": 0.125, "nested": {"a": None, "b": True}, "text": "é"}
    path = tmp_path / "s.snap"
    crc = format.write(path, "job-1", "model-key", 1234, arrays, meta)
    snap = format.read(path)
    assert (snap.job, snap.key, snap.step, snap.meta, snap.crc) == ("job-1", "model-key", 1234, meta, crc)
    assert list(snap.arrays) == list(arrays)
    for name, a in arrays.items():
        _same(a, snap.arrays[name], name)
        offset = snap.arrays[name].ctypes.data - snap.buffer.ctypes.data
        assert offset % format.ALIGN == 0 or snap.arrays[name].nbytes == 0, f"{name}: offset {offset}"
    # the layout, read independently: fixed header, JSON header and its CRC, trailer CRC over the rest
    raw = path.read_bytes()
    magic, version, text_crc, text_len, total = struct.unpack_from("<8sIIQQ", raw)
    assert (magic, version, total) == (b"TORUSNAP", 1, len(raw))
    text = raw[32:32 + text_len]
    assert zlib.crc32(text) == text_crc and json.loads(text)["step"] == 1234
    assert struct.unpack("<I", raw[-4:])[0] == zlib.crc32(raw[:-4]) == crc
    first = json.loads(text)["arrays"][0]
    data = -(-(32 + text_len) // 64) * 64
    assert raw[data + first["offset"]:data + first["offset"] + first["nbytes"]] == next(iter(arrays.values())).tobytes()


def test_no_arrays_and_empty_meta(tmp_path):
    format.write(tmp_path / "e.snap", "j", "", 0, {}, {})
    snap = format.read(tmp_path / "e.snap")
    assert (snap.step, snap.arrays, snap.meta, snap.key) == (0, {}, {}, "")


@pytest.mark.parametrize("arrays, meta, error", [
    ({"o": np.array([1, "a"], object)}, {}, "cannot be stored"),
    ({"rec": np.zeros(2, [("a", "f4"), ("b", "i4")])}, {}, "cannot be stored"),
    ({"v": np.zeros(2, "V4")}, {}, "cannot be stored"),
    ({"l": [1, 2]}, {}, "expected a numpy.ndarray"),
    ({1: np.zeros(2)}, {}, "names must be str"),
    ({"a": np.zeros(2)}, {"f": object()}, "JSON-serialisable"),
    ({"a": np.zeros(2)}, [1], "meta must be a dict"),
])
def test_what_cannot_be_stored_raises_before_any_file(tmp_path, arrays, meta, error):
    with pytest.raises(TypeError, match=error):
        format.write(tmp_path / "x.snap", "j", "k", 1, arrays, meta)
    assert os.listdir(tmp_path) == []


def _small_file(tmp_path, rng) -> tuple:
    arrays = {"w": _random(rng, np.float32, (5, 3)), "b": _random(rng, ml_dtypes.bfloat16, (4,)),
              "i": np.array(17, np.int64), "e": np.zeros((0,), np.float64)}
    path = tmp_path / "step-1.snap"
    format.write(path, "j", "k", 1, arrays, {"epoch": 2})
    return path, path.read_bytes()


def test_every_truncation_is_corrupt(tmp_path, rng):
    path, raw = _small_file(tmp_path, rng)
    bad = tmp_path / "bad.snap"
    for n in range(len(raw)):  # every length short of the whole file, 0 included
        bad.write_bytes(raw[:n])
        with pytest.raises(SnapshotCorrupt, match="truncated") as info:
            format.read(bad)
        assert str(bad) in str(info.value) and info.value.source == str(bad)
        with pytest.raises(SnapshotCorrupt):
            format.peek(bad)
    bad.write_bytes(raw + b"\0")
    with pytest.raises(SnapshotCorrupt, match="longer than written"):
        format.read(bad)


def test_every_flipped_byte_is_corrupt(tmp_path, rng):
    path, raw = _small_file(tmp_path, rng)
    bad = tmp_path / "bad.snap"
    for i in range(len(raw)):
        damaged = bytearray(raw)
        damaged[i] ^= 1 << int(rng.integers(8))
        bad.write_bytes(bytes(damaged))
        with pytest.raises(SnapshotCorrupt) as info:
            format.read(bad)
        assert str(bad) in str(info.value), f"byte {i}: {info.value}"


def test_wrong_magic_and_version_name_themselves(tmp_path, rng):
    path, raw = _small_file(tmp_path, rng)
    path.write_bytes(b"PK\x03\x04" + raw[4:])
    with pytest.raises(SnapshotCorrupt, match="not a torus snapshot"):
        format.read(path)
    path.write_bytes(raw[:8] + struct.pack("<I", 2) + raw[12:])
    with pytest.raises(SnapshotCorrupt, match="format version 2; this torus reads version 1"):
        format.read(path)


def _forge(raw: bytes, edit) -> bytes:
    """``raw`` with its JSON header edited by ``edit(header)`` and every checksum and length made right
    again: what only a buggy or hostile writer produces. The data keeps its place."""
    _, _, _, text_len, _ = struct.unpack_from("<8sIIQQ", raw)
    data = -(-(32 + text_len) // 64) * 64
    header = json.loads(raw[32:32 + text_len])
    edit(header)
    text = json.dumps(header).encode()
    new_data = -(-(32 + len(text)) // 64) * 64
    body = raw[data:-4]
    out = struct.pack("<8sIIQQ", b"TORUSNAP", 1, zlib.crc32(text), len(text), new_data + len(body) + 4) + text
    out += bytes(new_data - len(out)) + body
    return out + struct.pack("<I", zlib.crc32(out))


@pytest.mark.parametrize("edit, error", [
    (lambda h: h["arrays"][0].update(dtype="|O"), "unknown dtype"),
    (lambda h: h["arrays"][0].update(dtype="__builtins__"), "unknown dtype"),
    (lambda h: h["arrays"][0].update(offset=10**9), "bad entry"),
    (lambda h: h["arrays"][0].update(shape=[5, 4]), "bad entry"),
    (lambda h: h["arrays"][0].update(shape=[-5, -3]), "bad entry"),
    (lambda h: h["arrays"][1].update(name="w"), "bad entry"),
    (lambda h: h["arrays"][0].pop("nbytes"), "bad entry"),
    (lambda h: h.update(step=-1), "lacks job, key, step"),
    (lambda h: h.update(meta=[]), "lacks job, key, step"),
])
def test_fields_are_checked_even_when_the_checksums_match(tmp_path, rng, edit, error):
    path, raw = _small_file(tmp_path, rng)
    path.write_bytes(_forge(raw, edit))
    with pytest.raises(SnapshotCorrupt, match=error):
        format.read(path)


def test_a_crash_before_the_rename_leaves_the_previous_file(tmp_path, rng, monkeypatch):
    path = tmp_path / "step-5.snap"
    old = {"w": _random(rng, np.float64, (100,))}
    format.write(path, "j", "k", 5, old, {"v": "old"})

    def crash(tmp, final):
        assert tmp.exists() and tmp.stat().st_size > 0  # written in full, not yet renamed
        raise OSError(errno.EIO, "simulated crash before the rename")
    monkeypatch.setattr(format, "_rename", crash)
    with pytest.raises(OSError, match="simulated crash"):
        format.write(path, "j", "k", 5, {"w": _random(rng, np.float64, (100,))}, {"v": "new"})
    monkeypatch.undo()
    snap = format.read(path)
    assert snap.meta == {"v": "old"}
    _same(old["w"], snap.arrays["w"], "w")
    assert os.listdir(tmp_path) == ["step-5.snap"]  # the temporary file is gone


def _store(tmp_path, job="job", key="key", keep=2) -> SnapshotStore:
    return SnapshotStore(tmp_path, job, key, keep=keep)


def _files(s: SnapshotStore) -> list:
    return sorted(os.listdir(s.folder))


def _names(s: SnapshotStore, *steps) -> list:
    return sorted(s.path(n).name for n in steps)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_the_newest_keep_are_kept(tmp_path, rng, keep):
    with _store(tmp_path, keep=keep) as s:
        for step in (3, 10, 20, 25, 40):
            s.save_async(step, {"w": _random(rng, np.float32, (8,))}, {"step": step})
            assert s.wait(30)
        assert _files(s) == _names(s, *(3, 10, 20, 25, 40)[-keep:])
        assert s.newest_complete() == (40, s.folder / f"step-40-{zlib.crc32(b'key'):08x}.snap")
        assert s.errors == [] and s.dropped == 0


def test_newest_complete_skips_damaged_ones_with_one_warning_each(tmp_path, rng):
    s = _store(tmp_path, keep=5)
    written = {}
    for step in (1, 2, 3, 4):
        written[step] = {"w": _random(rng, np.float32, (50,))}
        s.save_async(step, written[step], {"step": step})
        assert s.wait(30)
    raw = s.path(4).read_bytes()
    s.path(4).write_bytes(raw[:-7])  # partial
    raw3 = bytearray(s.path(3).read_bytes())
    raw3[len(raw3) // 2] ^= 0x40  # a bit flipped in the data: only the whole-file check sees it
    s.path(3).write_bytes(bytes(raw3))
    in_flight = f".{s.path(9).name}.otherhost.1.tmp"
    (s.folder / in_flight).write_bytes(raw)  # a write in flight elsewhere: not a candidate
    with pytest.warns(SnapshotSkipped) as caught:
        assert s.newest_complete() == (2, s.path(2))
    texts = [str(w.message) for w in caught]
    assert len(texts) == 2 and f"{s.path(4)}: truncated" in texts[0], texts
    assert f"{s.path(3)}: checksum mismatch" in texts[1], texts
    with pytest.warns(SnapshotSkipped):
        snap = s.load_newest()
    assert snap is not None and snap.meta == {"step": 2}
    _same(written[2]["w"], snap.arrays["w"], "w")
    # the next write deletes the damaged files it found, older and newer alike
    s.save_async(5, written[1], {})
    assert s.wait(30)
    assert _files(s) == sorted([in_flight, *_names(s, 1, 2, 5)])
    s.close()


def test_other_jobs_and_keys_are_never_returned(tmp_path, rng):
    a = _store(tmp_path, job="job-a", key="k1")
    a.save_async(10, {"w": _random(rng, np.float32, (4,))}, {})
    a.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _store(tmp_path, job="job-b", key="k1").newest_complete() is None  # another folder
    other_key = _store(tmp_path, job="job-a", key="k2")  # same folder, another model: its files not opened
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert other_key.newest_complete() is None
    # a file renamed to another step, or holding another key under this key's name, is not believed
    os.rename(a.path(10), a.path(11))
    with pytest.warns(SnapshotSkipped, match="step 10, not .* step 11"):
        assert a.newest_complete() is None
    os.rename(a.path(11), a.path(10))
    format.write(a.path(20), "job-a", "k2", 20, {}, {})
    with pytest.warns(SnapshotSkipped, match="model key 'k2', step 20, not job 'job-a', key 'k1'"):
        assert a.newest_complete() == (10, a.path(10))
    a.path(20).unlink()
    # the two keys write in one folder, below and above each other's steps, and prune only their own
    for step in (3, 10, 12, 14):
        other_key.save_async(step, {"w": _random(rng, np.float32, (4,))}, {})
        assert other_key.wait(30)
    assert _files(a) == sorted(_names(a, 10) + _names(other_key, 12, 14))
    assert other_key.newest_complete() == (14, other_key.path(14)) and a.newest_complete() == (10, a.path(10))
    other_key.close()


def test_latest_wins(tmp_path, rng, monkeypatch):
    started, release, steps = threading.Event(), threading.Event(), []
    real = format.write

    def slow_write(path, job, key, step, arrays, meta):
        steps.append(step)
        started.set()
        assert release.wait(30)
        return real(path, job, key, step, arrays, meta)
    monkeypatch.setattr(format, "write", slow_write)
    s = _store(tmp_path, keep=5)
    data = {n: {"w": _random(rng, np.float32, (16,))} for n in (1, 2, 3, 4)}
    s.save_async(1, data[1], {})
    assert started.wait(30)  # step 1 is being written
    for n in (2, 3, 4):
        s.save_async(n, data[n], {"n": n})  # 2 then 3 wait, each replaced by the next
    assert not s.wait(0.05)
    release.set()
    assert s.wait(30)
    assert steps == [1, 4] and s.dropped == 2
    assert _files(s) == _names(s, 1, 4)
    _same(data[4]["w"], s.load_newest().arrays["w"], "w")
    s.close()


def test_a_failed_write_warns_and_the_next_one_works(tmp_path, rng, monkeypatch):
    s = _store(tmp_path)
    s.save_async(1, {"w": _random(rng, np.float32, (4,))}, {})
    assert s.wait(30)

    def full(tmp, final):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(format, "_rename", full)
    with pytest.warns(RuntimeWarning, match=f"snapshot writer \\({s.folder}\\): OSError: .*No space left"):
        s.save_async(2, {"w": _random(rng, np.float32, (4,))}, {})
        assert s.wait(30)
    monkeypatch.undo()
    assert [e.errno for e in s.errors] == [errno.ENOSPC] and _files(s) == _names(s, 1)
    s.save_async(3, {"w": _random(rng, np.float32, (4,))}, {})
    assert s.wait(30) and _files(s) == _names(s, 1, 3)
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.save_async(4, {}, {})


def test_save_async_checks_on_the_callers_thread(tmp_path):
    s = _store(tmp_path)
    with pytest.raises(TypeError, match="cannot be stored"):
        s.save_async(1, {"o": np.array([None])}, {})
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        s.save_async(-1, {}, {})
    assert not s.folder.exists()  # nothing made before the arguments pass
    s.close()


def test_temporary_files_of_dead_writers_on_this_host_are_removed(tmp_path, rng):
    s = _store(tmp_path)
    s.folder.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    host = socket.gethostname()
    names = [f".{s.path(7).name}.{host}.{int(dead.stdout)}.tmp", f".{s.path(7).name}.{host}.{os.getppid()}.tmp",
             f".{s.path(7).name}.elsewhere.{int(dead.stdout)}.tmp"]
    for n in names:
        (s.folder / n).write_bytes(b"partial")
    s.save_async(1, {"w": _random(rng, np.float32, (4,))}, {})
    assert s.wait(30)
    assert _files(s) == sorted(names[1:] + _names(s, 1))  # the live writer's and the other host's stay
    s.close()


def test_pending_snapshot_is_written_at_exit(tmp_path):
    script = ("import numpy as np\nfrom torus.snapshot import SnapshotStore\n"
              f"s = SnapshotStore({str(tmp_path)!r}, 'j', 'k')\n"
              "s.save_async(7, {'w': np.arange(1 << 20, dtype=np.float64)}, {'at': 'exit'})\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    snap = format.read(SnapshotStore(tmp_path, "j", "k").path(7))
    assert snap.meta == {"at": "exit"} and np.array_equal(snap.arrays["w"], np.arange(1 << 20))


def test_directory_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("TORUS_SNAPSHOT_DIR", str(tmp_path / "env"))
    assert SnapshotStore(None, "j", "k").folder == tmp_path / "env" / "j"
    assert SnapshotStore(tmp_path / "arg", "j", "k").folder == tmp_path / "arg" / "j"
    monkeypatch.delenv("TORUS_SNAPSHOT_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert SnapshotStore(None, "j", "k").folder == tmp_path / "home" / ".cache" / "torus" / "snapshots" / "j"
    assert store.DEFAULT_DIR == "~/.cache/torus/snapshots"


@pytest.mark.parametrize("job, keep", [("", 2), ("a/b", 2), ("..", 2), ("j", 0), ("j", 1.5)])
def test_bad_job_id_or_keep(tmp_path, job, keep):
    with pytest.raises(ValueError, match="job id|keep"):
        SnapshotStore(tmp_path, job, "k", keep=keep)


def test_cadence_whichever_comes_first():
    now = [100.0]
    c = Cadence(steps=10, seconds=5.0, clock=lambda: now[0])
    assert not c.due(0)  # the counts start here
    assert not c.due(9) and c.due(10)
    c.taken(10)
    now[0] += 4.9
    assert not c.due(11)
    now[0] += 0.2
    assert c.due(11)  # seconds first
    c.taken(11)
    assert not c.due(20) and c.due(21)
    off = Cadence(steps=0, seconds=0, clock=lambda: now[0])
    off.due(0)
    now[0] += 1e6
    assert not off.due(10**9)
    with pytest.raises(ValueError, match="must be >= 0"):
        Cadence(steps=-1)


def test_cadence_defaults_and_knobs(monkeypatch):
    monkeypatch.delenv("TORUS_SNAPSHOT_STEPS", raising=False)
    monkeypatch.delenv("TORUS_SNAPSHOT_SECONDS", raising=False)
    c = Cadence()
    assert (c.steps, c.seconds) == (500, 60.0)
    monkeypatch.setenv("TORUS_SNAPSHOT_STEPS", "7")
    monkeypatch.setenv("TORUS_SNAPSHOT_SECONDS", "0")
    c = Cadence(clock=time.monotonic)
    assert (c.steps, c.seconds) == (7, 0.0)
    c.due(0)
    assert not c.due(6) and c.due(7)
