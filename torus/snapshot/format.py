"""One snapshot = one file: a header, named numpy arrays, and a CRC-32 over all of it. No pickle.

Layout (little-endian; ``A`` = 64-byte alignment, relative to the start of the file):

    offset 0   fixed header, 32 bytes: magic ``b"TORUSNAP"`` (8), format version (u32), CRC-32 of the JSON
               header (u32), length of the JSON header in bytes (u64), length of the whole file in bytes (u64)
    offset 32  JSON header (UTF-8): {"job": str, "key": str, "step": int, "meta": {...},
               "arrays": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}
    data       starts at the first multiple of A after the JSON header; each array's bytes (C order) at
               ``data + offset``, every ``offset`` a multiple of A (so the arrays read back aligned)
    last 4     CRC-32 (u32) of every byte before it

dtypes: numpy's own numeric, bool, string and datetime dtypes are stored by their type string (``'<f4'``,
``'|b1'``, ``'>i8'``, ``'<U5'``), ml_dtypes' (``bfloat16``, ``float8_e4m3fn``, ``int4``...) by name. Object and
structured dtypes are refused (TypeError): they would need pickle, and a snapshot from elsewhere must never
run code. Reading only parses JSON and builds arrays over the bytes.

The checksum is ``zlib.crc32``, not a cryptographic hash such as ``hashlib.blake2b``: it guards against
accidental damage (a torn write, a flipped bit, a short transfer), where CRC-32 detects every burst of up to
32 bits and misses other damage with probability 2**-32; against deliberate tampering no unkeyed checksum
helps, since whoever edits the file recomputes it. zlib's CRC-32 runs several times faster than blake2b
(bench/snapshots/results/snapshot_write.txt), and both release the GIL, so the background writer and the verification
at resume take less CPU from training.

Writing is atomic: a temporary file in the same folder (``.<name>.<host>.<pid>.tmp``), fsync, ``os.replace``,
fsync of the folder. A crash at any point leaves the previous file of that name, or none, never a partial one
under the final name. Reading verifies magic, version, lengths and checksum before it believes any field, and
raises :class:`SnapshotCorrupt` naming the file and what is wrong.
"""
from __future__ import annotations

import errno
import json
import os
import re
import socket
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

MAGIC = b"TORUSNAP"
VERSION = 1
FIXED = struct.Struct("<8sIIQQ")  # magic, version, JSON header CRC-32, JSON header bytes, file bytes
TRAILER = struct.Struct("<I")  # CRC-32 of everything before it
ALIGN = 64
_CHUNK = 64 << 20  # bytes per write and per checksum update
_TYPESTR = re.compile(r"[<>|=][biufcmMSU]\d+(\[\w+\])?")  # numpy's own dtypes by type string


class SnapshotCorrupt(ValueError):
    """A snapshot that must not be loaded: truncated, damaged, or not a snapshot of this format.

    ``source``: the file (or, for received bytes, where they came from); ``reason``: what is wrong."""

    def __init__(self, source, reason: str):
        super().__init__(f"snapshot {source}: {reason}")
        self.source, self.reason = str(source), reason


@dataclass(frozen=True)
class Header:
    """What a snapshot says about itself: job id, model key, global step (all from the verified JSON header),
    and ``nbytes``, the length of the whole file in bytes."""
    job: str
    key: str
    step: int
    nbytes: int


@dataclass(frozen=True)
class Snapshot:
    """A verified snapshot. ``arrays``: name -> array, each a view into ``buffer`` (uint8, the whole file,
    ``buffer.size`` bytes; writable, so keep ``buffer`` unchanged while the arrays are in use); ``crc``: the
    file's CRC-32 (the trailer)."""
    job: str
    key: str
    step: int
    meta: dict
    arrays: dict
    crc: int
    buffer: np.ndarray


def dtype_code(dtype: np.dtype) -> str:
    """How ``dtype`` is stored: numpy's type string, or ml_dtypes' name. TypeError for object, structured,
    void and sub-array dtypes."""
    if dtype.type.__module__ == "ml_dtypes":
        return dtype.name
    if (dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in "biufcmMSU"
            or not dtype.itemsize):
        raise TypeError(f"dtype {dtype} cannot be stored in a snapshot: only numeric, bool, string, datetime "
                        "and ml_dtypes dtypes (no objects: a snapshot never holds pickled data)")
    return dtype.str


def dtype_of(code: str) -> np.dtype:
    """The dtype stored as ``code`` (see :func:`dtype_code`); ValueError for anything else."""
    if _TYPESTR.fullmatch(code):
        dtype = np.dtype(code)
        if not dtype.hasobject:
            return dtype
    found = getattr(ml_dtypes, code, None) if code.isidentifier() and not code.startswith("_") else None
    if isinstance(found, type) and issubclass(found, np.generic):
        return np.dtype(found)
    raise ValueError(f"unknown dtype {code!r}")


def describe(job: str, key: str, step: int, arrays: dict, meta: dict) -> tuple[bytes, int]:
    """The fixed header and JSON header (padded to the data start) of a snapshot of ``arrays`` (name ->
    C-contiguous ndarray), and the whole file's length in bytes. TypeError/ValueError for what cannot be
    stored: a non-str name, object dtypes, a non-JSON ``meta``, a negative step."""
    if not isinstance(job, str) or not isinstance(key, str):
        raise TypeError(f"job id and model key must be str, got {type(job).__name__}, {type(key).__name__}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not isinstance(meta, dict):
        raise TypeError(f"snapshot meta must be a dict, got {type(meta).__name__}")
    entries, offset, end = [], 0, 0  # end: where the last array's bytes end, from the data start
    for name, a in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"array names must be str, got {name!r}")
        if not isinstance(a, np.ndarray):
            raise TypeError(f"array {name!r}: expected a numpy.ndarray, got {type(a).__name__}")
        entries.append({"name": name, "dtype": dtype_code(a.dtype), "shape": list(a.shape), "offset": offset,
                        "nbytes": a.nbytes})
        end = offset + a.nbytes
        offset = _aligned(end)
    try:
        text = json.dumps({"job": job, "key": key, "step": int(step), "meta": meta, "arrays": entries},
                          separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"snapshot meta must be JSON-serialisable (dict, list, str, int, float, bool, None): "
                        f"{e}") from None
    data = _aligned(FIXED.size + len(text))
    total = data + end + TRAILER.size
    head = FIXED.pack(MAGIC, VERSION, zlib.crc32(text), len(text), total) + text
    return head + bytes(data - len(head)), total


def write(path, job: str, key: str, step: int, arrays: dict, meta: dict) -> int:
    """Write a snapshot file at ``path`` atomically (module docstring); return its CRC-32.

    ``arrays``: name -> ndarray (any shape, 0-d and empty included; non-contiguous ones are copied);
    ``meta``: a JSON-serialisable dict. TypeError/ValueError (before any file is created) for what cannot be
    stored; OSError from the file system, the temporary file then removed and ``path`` left as it was."""
    path = Path(path)
    arrays = {n: a if not isinstance(a, np.ndarray) or a.flags.c_contiguous else np.ascontiguousarray(a)
              for n, a in arrays.items()}
    head, total = describe(job, key, step, arrays, meta)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with open(fd, "wb", closefd=True) as f:
            crc, written = _put(f, head, 0), 0
            for a in arrays.values():
                crc = _put(f, bytes(_aligned(written) - written), crc)  # up to this array's aligned offset
                crc = _put(f, _bytes(a), crc)
                written = _aligned(written) + a.nbytes
            f.write(TRAILER.pack(crc))
            f.flush()
            os.fsync(f.fileno())
        _rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)
    return crc


def read(path) -> Snapshot:
    """Read and verify the snapshot file at ``path``. SnapshotCorrupt (a ValueError) naming the file for a
    short, long, damaged or foreign file; OSError (FileNotFoundError...) from the file system."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        fixed = f.read(FIXED.size)
        _check_fixed(path, fixed, size)
        buffer = np.empty(size, np.uint8)
        buffer[:FIXED.size] = np.frombuffer(fixed, np.uint8)
        view, got = buffer.data, FIXED.size
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise SnapshotCorrupt(path, f"truncated while being read: {got} of {size} bytes")
            got += n
    return parse(buffer, path)


def peek(path) -> Header:
    """The header of the snapshot file at ``path``, verified (magic, version, lengths against the file's size,
    the JSON header's own CRC-32) without reading the arrays: enough to list and prune snapshots, not to load
    one (:func:`read` checks the whole file). SnapshotCorrupt / OSError as :func:`read`."""
    with open(path, "rb") as f:
        fixed = f.read(FIXED.size)
        text_len = _check_fixed(path, fixed, os.fstat(f.fileno()).st_size)
        text = f.read(text_len)
    header = _header(path, fixed, text)
    return Header(header["job"], header["key"], header["step"], FIXED.unpack(fixed)[4])


def parse(buffer: np.ndarray, source) -> Snapshot:
    """Verify the bytes of a whole snapshot file (``buffer``: 1-d uint8 ndarray) and return it, its arrays
    views into ``buffer``. ``source`` names the bytes in errors (a path, ``"rank 3's step 120"``).
    SnapshotCorrupt for anything wrong."""
    size = buffer.size
    fixed = buffer[:FIXED.size].tobytes()
    text_len = _check_fixed(source, fixed, size)
    (stored,) = TRAILER.unpack(buffer[size - TRAILER.size:].tobytes())
    crc = 0
    for start in range(0, size - TRAILER.size, _CHUNK):
        crc = zlib.crc32(buffer[start:min(start + _CHUNK, size - TRAILER.size)].data, crc)
    if crc != stored:
        raise SnapshotCorrupt(source, f"checksum mismatch: CRC-32 of the contents is {crc:#010x}, the file "
                                      f"says {stored:#010x} (damaged)")
    header = _header(source, fixed, buffer[FIXED.size:FIXED.size + text_len].tobytes())
    data, end = _aligned(FIXED.size + text_len), size - TRAILER.size
    arrays: dict = {}
    for e in header["arrays"]:
        where = f"array {e.get('name')!r}" if isinstance(e, dict) else "an array entry"
        try:
            name, code, shape, offset, nbytes = (e[k] for k in ("name", "dtype", "shape", "offset", "nbytes"))
            dtype = dtype_of(code)
            ok = (isinstance(name, str) and name not in arrays and isinstance(shape, list)
                  and all(_natural(n) for n in shape) and _natural(offset) and _natural(nbytes)
                  and nbytes == dtype.itemsize * _product(shape) and data + offset + nbytes <= end)
        except (KeyError, TypeError, ValueError) as err:
            raise SnapshotCorrupt(source, f"{where}: bad entry ({err})") from None
        if not ok:
            raise SnapshotCorrupt(source, f"{where}: bad entry {e} (a name used twice, a negative or wrong "
                                          f"length, or beyond the file's {end - data} data bytes)")
        count = nbytes // dtype.itemsize if dtype.itemsize else 0
        arrays[name] = np.frombuffer(buffer, dtype, count, data + offset).reshape(shape)
    return Snapshot(header["job"], header["key"], header["step"], header["meta"], arrays, crc, buffer)


def sync_folder(folder) -> None:
    """fsync a folder, so that a rename in it survives a power loss (a no-op where the file system refuses)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # folders some file systems cannot sync
            raise
    finally:
        os.close(fd)


def _rename(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)  # a name of its own, so that tests can fail it


def _check_fixed(source, fixed: bytes, size: int) -> int:
    """The JSON header's length, after checking the fixed header against the file's ``size`` in bytes."""
    if size < FIXED.size + TRAILER.size or len(fixed) < FIXED.size:
        raise SnapshotCorrupt(source, f"truncated: {size} bytes, shorter than any snapshot "
                                      f"({FIXED.size + TRAILER.size})")
    magic, version, _, text_len, total = FIXED.unpack(fixed)
    if magic != MAGIC:
        raise SnapshotCorrupt(source, f"not a torus snapshot (starts with {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise SnapshotCorrupt(source, f"format version {version}; this torus reads version {VERSION}")
    if total != size:
        what = "truncated" if size < total else "longer than written"
        raise SnapshotCorrupt(source, f"{what}: {size} bytes, the header says {total}")
    if FIXED.size + text_len + TRAILER.size > size:
        raise SnapshotCorrupt(source, f"header length {text_len} does not fit in the file's {size} bytes")
    return text_len


def _header(source, fixed: bytes, text: bytes) -> dict:
    """The JSON header, checked against its CRC-32 and for the fields every snapshot has."""
    if zlib.crc32(text) != FIXED.unpack(fixed)[2]:
        raise SnapshotCorrupt(source, "header checksum mismatch (damaged header)")
    try:
        header = json.loads(text)
        ok = (isinstance(header, dict) and isinstance(header.get("job"), str) and isinstance(header.get("key"), str)
              and _natural(header.get("step")) and isinstance(header.get("meta"), dict)
              and isinstance(header.get("arrays"), list))
    except ValueError as e:  # json's errors, UnicodeDecodeError
        raise SnapshotCorrupt(source, f"unreadable header ({e})") from None
    if not ok:
        raise SnapshotCorrupt(source, "header lacks job, key, step, meta or arrays")
    return header


def _put(f, data, crc: int) -> int:
    """Write ``data`` (bytes-like) and return the CRC-32 continued over it."""
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK):
        part = view[start:start + _CHUNK]
        f.write(part)
        crc = zlib.crc32(part, crc)
    return crc


def _bytes(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy (any dtype, 0-d and empty included)."""
    return a.reshape(-1).view(np.uint8).data


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _natural(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _product(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
