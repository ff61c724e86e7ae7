"""The embedded default dataset: scikit-learn's ``load_digits`` (1,797 real 8x8 scans of handwritten digits,
10 classes) written out once as JPEGs in the ILSVRC2012 folder layout, so ``torus-train`` runs with no download.

Layout (``root = ~/.cache/torus/digits-<size>``, or ``$TORUS_CACHE/digits-<size>``)::

    root/train/digit_0/00017.jpg ... root/train/digit_9/...   (80 %, stratified, fixed seed)
    root/val/digit_0/...                                      (20 %)

Each 8x8 scan (values 0..16) is scaled to 0..255, resized bilinearly to ``size x size`` and stored as RGB
(three equal channels), JPEG quality 95. The build is safe under concurrent ranks or jobs: it holds an
``fcntl`` lock on ``root.lock``, writes into a temporary folder beside ``root`` and publishes it with one
``os.replace``, so a reader sees either no folder or a complete one.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from torus import knobs

VAL_FRACTION = 0.2
SPLIT_SEED = 0


def cache_dir() -> Path:
    """The folder holding built datasets: ``$TORUS_CACHE`` or ``~/.cache/torus``."""
    return Path(knobs.read("TORUS_CACHE") or Path.home() / ".cache" / "torus")


def _write_split(root: Path, images, labels, size: int) -> None:
    import numpy as np
    from PIL import Image
    for index, (image, label) in enumerate(zip(images, labels)):
        folder = root / f"digit_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.clip(image * (255.0 / 16.0), 0, 255).astype(np.uint8)
        Image.fromarray(pixels, "L").resize((size, size), Image.Resampling.BILINEAR).convert("RGB") \
            .save(folder / f"{index:05d}.jpg", quality=95)


def ensure_digits(size: int = 32) -> Path:
    """Build the digits dataset at ``size x size`` pixels if it is not there yet; return its root folder.

    Idempotent and safe to call from every rank at once (see the module docstring). Raises ``ValueError``
    for ``size < 8``.
    """
    if size < 8:
        raise ValueError(f"ensure_digits: size must be at least 8 pixels, got {size}")
    root = cache_dir() / f"digits-{size}"
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if root.is_dir():  # another process built it while we waited for the lock
            return root
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
        digits = load_digits()
        x_train, x_val, y_train, y_val = train_test_split(
            digits.images, digits.target, test_size=VAL_FRACTION, random_state=SPLIT_SEED,
            stratify=digits.target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
        try:
            _write_split(tmp / "train", x_train, y_train, size)
            _write_split(tmp / "val", x_val, y_val, size)
            os.replace(tmp, root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return root
