"""The idx files of MNIST and Fashion-MNIST, read and checked without TensorFlow.

Format (LeCun et al., http://yann.lecun.com/exdb/mnist/, "file formats"; Fashion-MNIST, Xiao, Rasul and
Vollgraf 2017, arXiv:1708.07747, keeps it unchanged): two zero bytes, a type byte (``0x08`` uint8, ``0x09``
int8, ``0x0B`` int16, ``0x0C`` int32, ``0x0D`` float32, ``0x0E`` float64), the number of dimensions, then each
dimension as a big-endian uint32, then the values, big-endian, row-major, and nothing after them. A file may be
gzip-compressed (``.gz``).

A data folder holds four files, each plain or ``.gz``: ``train-images-idx3-ubyte`` (N, 28, 28) uint8,
``train-labels-idx1-ubyte`` (N,) uint8, and the same for the test split under the prefix ``t10k``. Debian's
``dataset-fashion-mnist`` package installs them in :data:`FASHION_MNIST_DIR`; ``--data fashion-mnist`` names
that folder. Every problem is an :class:`IdxError` naming the file and what is wrong (bad magic, wrong
dimensions, a count that does not match, truncated data or gzip stream, a label out of range); a missing
folder or file is :class:`MissingData`.
"""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
KEYWORD = "fashion-mnist"
NUM_CLASSES = 10
FILES = {("train", "images"): "train-images-idx3-ubyte", ("train", "labels"): "train-labels-idx1-ubyte",
         ("test", "images"): "t10k-images-idx3-ubyte", ("test", "labels"): "t10k-labels-idx1-ubyte"}
_DTYPES: dict[int, np.dtype] = {0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"),
                                0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_HINT = "apt-get install dataset-fashion-mnist, or --data DIR holding " + ", ".join(
    f"{name}[.gz]" for name in FILES.values())


class IdxError(ValueError):
    """An idx file that cannot be read as what it should hold; the message names the file."""


class MissingData(FileNotFoundError):
    """The Fashion-MNIST folder or one of its four files is missing; the message says how to get them."""


def parse(raw: bytes, name: str = "<bytes>") -> np.ndarray:
    """The array an idx file's bytes hold, in native byte order, of the file's dtype and dimensions.

    ``name`` only labels errors. Raises :class:`IdxError` for a header shorter than its dimensions say, a magic
    number whose first two bytes are not zero or whose type byte is unknown, and data shorter or longer than
    the product of the dimensions.
    """
    if len(raw) < 4:
        raise IdxError(f"{name}: truncated: {len(raw)} bytes, shorter than the 4-byte magic number")
    if raw[0] or raw[1] or raw[2] not in _DTYPES:
        raise IdxError(f"{name}: bad magic number 0x{raw[:4].hex()}: not an idx file (expected 0x0000TTNN, "
                       f"TT a type in {', '.join(f'{t:02x}' for t in _DTYPES)})")
    dtype, ndim = _DTYPES[raw[2]], raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise IdxError(f"{name}: truncated header: {ndim} dimensions need {4 + 4 * ndim} bytes, the file has "
                       f"{len(raw)}")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, 4))
    need = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    have = len(raw) - 4 - 4 * ndim
    if have != need:
        problem = "truncated" if have < need else "trailing bytes"
        raise IdxError(f"{name}: {problem}: dimensions {dims} need {need} bytes of data, the file holds {have}")
    return np.frombuffer(raw, dtype, offset=4 + 4 * ndim).reshape(dims).astype(dtype.newbyteorder("="))


def read(path: str | Path) -> np.ndarray:
    """:func:`parse` of the file at ``path``, gunzipped first when its name ends in ``.gz``.

    Raises :class:`IdxError` (also for a truncated or corrupt gzip stream) and ``OSError`` when unreadable.
    """
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise IdxError(f"{path}: truncated or corrupt gzip stream ({exc})") from None
    return parse(raw, str(path))


def _find(root: Path, name: str) -> Path | None:
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def locate(data: str) -> Path | None:
    """The idx folder ``--data`` names: :data:`FASHION_MNIST_DIR` for ``"fashion-mnist"``, ``data`` itself
    when it holds any of the four files, else None (another layout, or no such folder: ``data.open_split``
    says which). Raises :class:`MissingData` (one line: what is missing, how to get it) where the package
    folder is absent or a folder holds some of the four files but not all."""
    root = FASHION_MNIST_DIR if data == KEYWORD else Path(data)
    if data == KEYWORD and not root.is_dir():
        raise MissingData(f"--data {KEYWORD}: {root} does not exist; {_HINT}")
    if not root.is_dir():
        return None
    missing = [name for name in FILES.values() if _find(root, name) is None]
    if len(missing) == len(FILES):
        if data == KEYWORD:
            raise MissingData(f"--data {KEYWORD}: {root} holds none of its idx files; {_HINT}")
        return None
    if missing:
        raise MissingData(f"--data {data} lacks {', '.join(f'{m}[.gz]' for m in missing)}; {_HINT}")
    return root


def load_split(root: str | Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)`` of ``split`` (``"train"`` or ``"test"``) under ``root``: uint8 ``(N, H, W)`` pixels
    (0 = background) and uint8 ``(N,)`` labels in ``[0, NUM_CLASSES)``.

    Raises :class:`IdxError` naming the file where images are not 3-D uint8, labels not 1-D uint8, the two
    counts differ or a label is out of range; :class:`MissingData` where a file is absent.
    """
    root = Path(root)
    paths = {}
    for kind in ("images", "labels"):
        found = _find(root, FILES[split, kind])
        if found is None:
            raise MissingData(f"{root}: no {FILES[split, kind]}[.gz]; {_HINT}")
        paths[kind] = found
    images, labels = read(paths["images"]), read(paths["labels"])
    if images.ndim != 3 or images.dtype != np.uint8:
        raise IdxError(f"{paths['images']}: expected uint8 images (N, rows, cols), found {images.dtype} "
                       f"{images.shape}")
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise IdxError(f"{paths['labels']}: expected uint8 labels (N,), found {labels.dtype} {labels.shape}")
    if len(images) != len(labels):
        raise IdxError(f"{paths['labels']}: {len(labels)} labels for the {len(images)} images of "
                       f"{paths['images']}")
    if len(labels) and labels.max() >= NUM_CLASSES:
        raise IdxError(f"{paths['labels']}: label {labels.max()} is outside [0, {NUM_CLASSES})")
    return images, labels
