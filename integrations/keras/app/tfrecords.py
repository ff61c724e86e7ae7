"""``torus-make-tfrecords``: write TFRecord shards in the usual ImageNet layout from an ILSVRC2012 folder tree.

``torus-make-tfrecords SRC DEST [--train-shards 1024] [--val-shards 128]`` reads ``SRC/train/<class>/*.jpg``
and ``SRC/val/<class>/*.jpg`` and writes ``DEST/train-00000-of-01024`` ... and ``DEST/validation-00000-of-00128``
..., each record a ``tf.train.Example`` with the keys of TensorFlow's ``build_imagenet_data.py``:
``image/encoded`` (the file's bytes, unchanged), ``image/format`` (``JPEG``/``PNG``), ``image/class/label``
(int64, 1-based: sorted class folder index + 1), ``image/class/synset`` (the folder name), ``image/filename``,
``image/height`` and ``image/width``. Images are dealt to shards in a fixed shuffled order (seed 0) so every
shard holds every class. Shards are written as hidden temporary files and renamed when complete.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from torus.integrations.keras.app.data import IMAGE_SUFFIXES, DataError, class_names


def _bytes(value: bytes):
    import tensorflow as tf
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _int64(value: int):
    import tensorflow as tf
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))


def example(path: Path, label: int, synset: str):
    """The ``tf.train.Example`` for one image file (``label`` 1-based). Raises ``PIL.UnidentifiedImageError``
    (an ``OSError``) when the file is not an image."""
    import tensorflow as tf
    from PIL import Image
    encoded = path.read_bytes()
    with Image.open(path) as image:
        width, height = image.size
        kind = image.format or "JPEG"
    return tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": _bytes(encoded), "image/format": _bytes(kind.encode()),
        "image/class/label": _int64(label), "image/class/synset": _bytes(synset.encode()),
        "image/filename": _bytes(path.name.encode()), "image/height": _int64(height),
        "image/width": _int64(width)}))


def write_split(src: Path, classes: list[str], dest: Path, prefix: str, shards: int) -> int:
    """Write the images under ``src`` (``<class>/*``) as ``shards`` files ``dest/<prefix>-NNNNN-of-MMMMM``;
    return the number of records. Raises ``DataError`` when ``src`` holds no images."""
    import tensorflow as tf
    items = [(p, label + 1, name) for label, name in enumerate(classes) if (src / name).is_dir()
             for p in sorted((src / name).iterdir()) if p.suffix in IMAGE_SUFFIXES]
    if not items:
        raise DataError(f"torus-make-tfrecords: {src} holds no images (expected <class>/*.jpg)")
    order = np.random.default_rng(0).permutation(len(items))
    dest.mkdir(parents=True, exist_ok=True)
    shards = min(shards, len(items))
    for shard in range(shards):
        final = dest / f"{prefix}-{shard:05d}-of-{shards:05d}"
        tmp = dest / f".{final.name}.tmp"
        with tf.io.TFRecordWriter(str(tmp)) as writer:
            for i in order[shard::shards]:
                writer.write(example(*items[i]).SerializeToString())
        os.replace(tmp, final)
    return len(items)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="torus-make-tfrecords", description=__doc__.splitlines()[0])
    p.add_argument("src", help="ILSVRC2012 folder tree (train/<class>/*.jpg, val/<class>/*.jpg)")
    p.add_argument("dest", help="output folder")
    p.add_argument("--train-shards", type=int, default=1024)
    p.add_argument("--val-shards", type=int, default=128)
    args = p.parse_args(argv)
    src, dest = Path(args.src), Path(args.dest)
    classes = class_names(src)
    if not classes:
        p.error(f"{src}/train holds no class folders")
    for split, prefix, shards in (("train", "train", args.train_shards), ("val", "validation", args.val_shards)):
        if (src / split).is_dir():
            count = write_split(src / split, classes, dest, prefix, shards)
            print(f"{prefix}: {count} images in {min(shards, count)} shards under {dest}")
    return 0
