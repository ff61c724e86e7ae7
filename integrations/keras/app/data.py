"""Input pipelines for ImageNet-style data with tf.data: global batches (folders) or one shard per rank (TFRecords),
per-epoch deterministic order, and the augmentations Mikami et al. 2018 (arXiv:1811.05233, section 3) list.

Two layouts are read, both under ``root``:

- **ILSVRC2012 folders**: ``root/train/<class>/*.jpg`` and ``root/val/<class>/*.jpg`` (JPEG or PNG);
  the class index is the position of the folder name in the sorted list of ``train/`` folders.
- **TFRecord shards** in the usual ImageNet layout: files ``root/train-*`` and ``root/validation-*`` (or
  ``root/train/*`` and ``root/val/*``), records of ``tf.train.Example`` with ``image/encoded`` (JPEG bytes)
  and ``image/class/label`` (int64, **1-based**; 0 is the background class of the Inception scripts).
- **In memory**: Fashion-MNIST's idx files (``idx.py``, :func:`open_idx`), every image held by every rank;
  grayscale ``(batch, S, S, 1)``, normalised with the training set's own mean and standard deviation.

Sharding: the folder layout deals image files round-robin (rank ``r`` of ``size`` gets files ``r, r+size,
...``); TFRecords deal whole shard files when there are at least ``size`` of them, else records
(``Dataset.shard``). Every image of a rank's shard is decoded once by :func:`open_split` (in parallel by
tf.data) so that unreadable or corrupt images are reported by path before training, counted, and then either
skipped or raised (``on_bad_image``). For training, ``shared_split`` then gives every rank the folder layout's
whole good list: epoch ``e``'s global batches follow from ``(seed, e)`` alone, at any rank count; TFRecord
training order follows from ``(seed, e, rank)``. Every random augmentation is a stateless op seeded per element,
so a run resumed at any batch (``train_dataset(skip=)``) sees exactly the batches an uninterrupted run sees.

Folder and TFRecord images come out as float32 ``(batch, S, S, 3)`` normalised with the ImageNet channel mean
and standard deviation; labels as int32 ``(batch,)`` in ``[0, num_classes)``. Every dataset returned here holds this
rank's share and is marked so (``inputs.per_rank``): ``model.fit`` under a ``TorusStrategy`` takes its batches
as per-rank batches instead of splitting them as global ones.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from torus.integrations.keras.fit.inputs import per_rank

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".JPEG", ".JPG", ".PNG"}
MEAN_RGB = (0.485, 0.456, 0.406)
STDDEV_RGB = (0.229, 0.224, 0.225)
_FEATURES = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
             "image/class/label": tf.io.FixedLenFeature([], tf.int64)}
_SPLIT_NAMES = {"train": ("train",), "val": ("val", "validation")}


_UNDECODABLE = "cannot be decoded as an image"


class DataError(RuntimeError):
    """The data folder is missing, empty, malformed, or holds a bad image under ``on_bad_image="fail"``."""


@dataclasses.dataclass(frozen=True)
class Augment:
    """Which training augmentations run, each one switchable; zero or ``False`` turns it off.

    crop_area : smallest fraction of the image area a random resized crop keeps (aspect 3/4..4/3), 0 = off.
    flip : random horizontal flips.
    rotate : largest rotation in degrees (uniform in ``[-rotate, rotate]``), 0 = off.
    color : brightness delta (in ``[0, 1]`` pixel units); contrast and saturation vary by ``1 +- 2*color``
        and hue by ``color / 4``; 0 = off.
    noise : standard deviation of added Gaussian noise in ``[0, 1]`` pixel units, 0 = off.
    """
    crop_area: float = 0.0
    flip: bool = False
    rotate: float = 0.0
    color: float = 0.0
    noise: float = 0.0

    NAMES = ("crop", "flip", "rotate", "color", "noise")

    @classmethod
    def parse(cls, spec: str) -> Augment:
        """``"none"`` or a comma list of ``crop[=min_area]``, ``flip``, ``rotate[=degrees]``, ``color[=delta]``,
        ``noise[=stddev]`` (defaults 0.08, on, 10, 0.1, 0.02). Raises ``ValueError`` on an unknown name."""
        defaults = {"crop": 0.08, "flip": True, "rotate": 10.0, "color": 0.1, "noise": 0.02}
        fields: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            if item == "none":
                continue
            name, _, value = item.partition("=")
            if name not in defaults:
                raise ValueError(f"augment: unknown augmentation {name!r}; choose from {', '.join(cls.NAMES)}")
            field = "crop_area" if name == "crop" else name
            fields[field] = (value.lower() not in ("0", "off", "false")) if name == "flip" and value \
                else type(defaults[name])(float(value)) if value else defaults[name]
        return cls(**fields)


@dataclasses.dataclass
class Split:
    """One rank's shard of a split: what to read, how many good examples it holds, and the bad ones found.

    kind : ``"folder"`` (``items`` are image paths, ``labels`` their class indices), ``"tfrecord"``
        (``items`` are shard files, ``labels`` is None, ``record_shard`` is ``(size, rank)`` when records
        rather than files are dealt, ``bad_keys`` the keys of bad records, see ``_keyed_records``) or
        ``"array"`` (``items`` is a uint8 array ``(N, H, W, C)`` of pixels, ``labels`` int32 ``(N,)``).
    count : good examples in this rank's shard.  bad : ``[(where, error)]`` for each bad image this rank found.
    listing : the folder layout's whole listing, ``(paths, labels)`` before dealing (``shared_split`` reads it).
    shared : True where ``items`` are every rank's good examples, the same list on every rank
        (``shared_split``, ``open_idx``): the training order is then global, see ``train_dataset``.
    norm : per-channel ``(mean, stddev)`` of pixels in ``[0, 1]`` for normalising; None: ImageNet's.
    """
    kind: str
    items: list | np.ndarray
    labels: np.ndarray | None
    num_classes: int
    count: int
    bad: list
    record_shard: tuple | None = None
    bad_keys: frozenset = frozenset()
    listing: tuple | None = None
    shared: bool = False
    norm: tuple | None = None


def open_idx(root: str | Path, *, rank: int = 0, size: int = 1) -> tuple[Split, Split]:
    """Fashion-MNIST (or any folder of the four idx files, ``idx.py``) in memory: the whole training split,
    shared by every rank (global batches, as ``shared_split``), and this rank's slice ``rank::size`` of the
    test split (every rank's slices together: the whole test split, once). Pixels are uint8 ``(N, H, W, 1)``;
    ``norm`` is the training images' mean and standard deviation. Raises ``idx.IdxError`` (a ValueError) or
    ``idx.MissingData`` (an OSError) naming the file; involves no communication."""
    from torus.integrations.keras.app import idx
    train_x, train_y = idx.load_split(root, "train")
    test_x, test_y = idx.load_split(root, "test")
    if train_x.shape[1:] != test_x.shape[1:]:
        raise idx.IdxError(f"{root}: training images are {train_x.shape[1:]}, test images {test_x.shape[1:]}")
    scaled = train_x.astype(np.float32) / 255.0
    norm = ((float(scaled.mean()),), (float(scaled.std()),))
    train = Split("array", train_x[..., None], train_y.astype(np.int32), idx.NUM_CLASSES, len(train_y), [],
                  shared=True, norm=norm)
    test = Split("array", test_x[rank::size, ..., None], test_y[rank::size].astype(np.int32), idx.NUM_CLASSES,
                 len(test_y[rank::size]), [], norm=norm)
    return train, test


def subset(split: Split, count: int) -> Split:
    """The first ``count`` examples of a fixed random order (seed 0, whatever ``--seed``) of a shared split,
    kept in their original order: a smaller training set for quick runs. Raises ``DataError`` for a split
    that is not shared (TFRecords) or holds fewer than ``count`` examples."""
    if not split.shared:
        raise DataError("--train-images: TFRecord data is read per rank; a subset needs folder or idx data")
    if count > split.count:
        raise DataError(f"--train-images {count}: the training data holds only {split.count} images")
    keep = np.sort(np.random.default_rng(0).permutation(split.count)[:count])
    items = split.items[keep] if isinstance(split.items, np.ndarray) else [split.items[i] for i in keep]
    return dataclasses.replace(split, items=items, labels=_labels(split)[keep], count=count)


def _labels(split: Split) -> np.ndarray:
    """The labels of a folder or in-memory split (TFRecords carry theirs inside the records)."""
    if split.labels is None:
        raise DataError(f"{split.kind} data without labels")
    return split.labels


def shared_split(shard: Split, comm) -> Split:
    """The folder layout's good examples of every rank in one list, the same on every rank (collective: one
    all-gather of the bad paths). Training from it gives each global batch the same images whatever the rank
    count, which a resume at another rank count needs (``train_dataset``). TFRecord shards are returned as
    they are: their records are read per rank (a rank reads only its files)."""
    if shard.kind != "folder" or shard.listing is None:
        return shard
    bad = set().union(*comm.allgather({where for where, _ in shard.bad}))
    paths, labels = shard.listing
    keep = [i for i, path in enumerate(paths) if path not in bad]
    return dataclasses.replace(shard, items=[paths[i] for i in keep], labels=np.asarray(labels, np.int32)[keep],
                               count=len(keep), shared=True)


def _split_dir(root: Path, split: str) -> Path | None:
    for name in _SPLIT_NAMES[split]:
        if (root / name).is_dir():
            return root / name
    return None


def _tfrecord_files(root: Path, split: str) -> list[str]:
    folder = _split_dir(root, split)
    if folder is not None and not any(p.is_dir() for p in folder.iterdir()):
        return sorted(str(p) for p in folder.iterdir() if p.is_file())
    return sorted(str(p) for name in _SPLIT_NAMES[split] for p in root.glob(f"{name}-*") if p.is_file())


def class_names(root: str | Path) -> list[str]:
    """The sorted class folder names of ``root/train`` (the folder layout's label order)."""
    folder = _split_dir(Path(root), "train")
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder else []


def _decode(encoded):
    image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
    image.set_shape([None, None, 3])
    return image


def _scan(dataset, keys) -> list:
    """Decode every element of ``dataset`` (pairs ``(key, encoded)`` with the given ``keys``); return the keys
    that fail to decode: the ones missing after ``ignore_errors``."""
    sizes = dataset.map(lambda key, encoded: (key, tf.shape(_decode(encoded))[0]),
                        num_parallel_calls=tf.data.AUTOTUNE, deterministic=False).ignore_errors()
    seen = set()
    for key, _ in sizes.batch(4096).as_numpy_iterator():
        seen.update(key.tolist())
    return [key for key in keys if key not in seen]


def open_split(root: str | Path, split: str, *, rank: int = 0, size: int = 1,
               on_bad_image: str = "skip", num_classes: int | None = None) -> Split:
    """Find this rank's shard of ``split`` (``"train"`` or ``"val"``) under ``root`` and check its images.

    Raises :class:`DataError` when ``root`` or the split is missing or holds no images, when a TFRecord label
    is outside ``[1, num_classes]``, or, with ``on_bad_image="fail"``, when any image cannot be decoded (the
    message names each bad path). With ``"skip"`` each bad image is written to stderr as a warning and left
    out. Runs TensorFlow ops; involves no communication.
    """
    root = Path(root)
    if on_bad_image not in ("skip", "fail"):
        raise ValueError(f"open_split: on_bad_image must be 'skip' or 'fail', got {on_bad_image!r}")
    if not root.is_dir():
        raise DataError(f"data folder {root} does not exist")
    folder = _split_dir(root, split)
    classes = class_names(root)
    if folder is not None and classes:
        split_data = _open_folder(folder, classes, rank, size)
    else:
        files = _tfrecord_files(root, split)
        if not files:
            raise DataError(f"data folder {root} holds no {split} images: expected {split}/<class>/*.jpg "
                            f"folders or TFRecord files {_SPLIT_NAMES[split][-1]}-*")
        split_data = _open_tfrecords(files, rank, size, num_classes)
    if split_data.bad:
        lines = "\n".join(f"  {where}: {error}" for where, error in split_data.bad)
        message = f"rank {rank}: {len(split_data.bad)} bad image(s) in {split} data under {root}:\n{lines}"
        if on_bad_image == "fail":
            raise DataError(message)
        print(f"WARNING: {message}\n  (skipped; --on-bad-image fail stops instead)", file=sys.stderr, flush=True)
    return split_data


def _open_folder(folder: Path, classes: list[str], rank: int, size: int) -> Split:
    paths, labels = [], []
    for label, name in enumerate(classes):
        class_dir = folder / name
        if not class_dir.is_dir():
            continue
        files = sorted(p for p in class_dir.iterdir() if p.suffix in IMAGE_SUFFIXES)
        paths += [str(p) for p in files]
        labels += [label] * len(files)
    if not paths:
        raise DataError(f"data folder {folder} holds no images (expected <class>/*.jpg)")
    listing = (list(paths), list(labels))
    # deal a fixed interleaving of classes so every rank's shard holds every class
    order = np.random.default_rng(0).permutation(len(paths))[rank::size]
    paths = [paths[i] for i in order]
    dealt = np.asarray(labels, np.int32)[order]
    indexed = tf.data.Dataset.from_tensor_slices(paths).map(tf.io.read_file).enumerate()
    bad = set(_scan(indexed, range(len(paths))))
    keep = [i for i in range(len(paths)) if i not in bad]
    return Split("folder", [paths[i] for i in keep], dealt[keep], len(classes), len(keep),
                 [(paths[i], _UNDECODABLE) for i in sorted(bad)], listing=listing)


def _keyed_records(files, file_ids, record_shard):
    """``(key, serialized record)`` pairs of ``files`` read in the given order, 8 files at a time by a
    deterministic interleave; ``key = file_id << 32 | index of the record in its file``, so a record keeps
    its key whatever the file order. ``record_shard = (size, rank)`` deals records instead."""
    def records(path, file_id):
        return tf.data.TFRecordDataset(path).enumerate().map(lambda i, r: (file_id * 2 ** 32 + i, r))
    dataset = tf.data.Dataset.from_tensor_slices((list(files), np.asarray(file_ids, np.int64))).interleave(
        records, cycle_length=min(8, len(files)), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return dataset.shard(*record_shard) if record_shard else dataset


def _open_tfrecords(files: list[str], rank: int, size: int, num_classes: int | None) -> Split:
    record_shard = None
    if len(files) >= size:
        files = files[rank::size]
    else:
        record_shard = (size, rank)
    parsed = _keyed_records(files, range(len(files)), record_shard).map(
        lambda key, r: (key, tf.io.parse_single_example(r, _FEATURES)), num_parallel_calls=tf.data.AUTOTUNE)
    keys, labels = np.zeros(0, np.int64), np.zeros(0, np.int64)
    for k, y in parsed.map(lambda key, f: (key, f["image/class/label"])).batch(8192).as_numpy_iterator():
        keys, labels = np.concatenate([keys, k]), np.concatenate([labels, y])
    top = num_classes or int(labels.max(initial=0))
    if len(labels) and (labels.min() < 1 or labels.max() > top):
        raise DataError(f"TFRecords {files[0]}...: image/class/label must be 1-based in [1, {top}], "
                        f"found [{labels.min()}, {labels.max()}]")
    bad = _scan(parsed.map(lambda key, f: (key, f["image/encoded"])), keys.tolist())
    return Split("tfrecord", files, None, top, len(labels) - len(bad),
                 [(f"{files[k >> 32]}, record {k & 0xFFFFFFFF}", _UNDECODABLE) for k in bad], record_shard,
                 frozenset(bad))


def _image(split: Split, item):
    """One uint8 ``(H, W, C)`` image from an element of ``_examples``: decoded, or as held in memory."""
    return item if split.kind == "array" else _decode(item)


def _resize(image, image_size: int):
    """``image`` (float) resized bilinearly to ``image_size`` square, left as it is where it is that size."""
    if tuple(image.shape[:2]) == (image_size, image_size):
        return image
    return tf.image.resize(image, (image_size, image_size))


def _augment(image, seed, image_size: int, aug: Augment):
    """Random resized crop, flip, rotation, colour distortion and noise on one uint8 image, all stateless
    ops keyed by ``seed`` (shape (2,) int64); returns float32 ``(S, S, C)`` in ``[0, 1]``. Saturation and hue
    change only 3-channel images."""
    seeds = tf.random.experimental.stateless_split(seed, 8)
    if aug.crop_area > 0:
        begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.shape(image), tf.zeros([0, 0, 4], tf.float32), seed=seeds[0],
            area_range=(aug.crop_area, 1.0), aspect_ratio_range=(3 / 4, 4 / 3), max_attempts=10,
            use_image_if_no_bounding_boxes=True)
        image = tf.slice(image, begin, crop_size)
    image = _resize(tf.cast(image, tf.float32) / 255.0, image_size)
    if aug.flip:
        image = tf.image.stateless_random_flip_left_right(image, seeds[1])
    if aug.rotate > 0:
        angle = tf.random.stateless_uniform([], seeds[2], -aug.rotate, aug.rotate) * (np.pi / 180)
        image = _rotate(image, angle)
    if aug.color > 0:
        image = tf.image.stateless_random_brightness(image, aug.color, seeds[3])
        image = tf.image.stateless_random_contrast(image, 1 - 2 * aug.color, 1 + 2 * aug.color, seeds[4])
        if image.shape[-1] == 3:
            image = tf.image.stateless_random_saturation(image, 1 - 2 * aug.color, 1 + 2 * aug.color, seeds[5])
            image = tf.image.stateless_random_hue(image, aug.color / 4, seeds[6])
    if aug.noise > 0:
        image += aug.noise * tf.random.stateless_normal(tf.shape(image), seeds[7])
    return tf.clip_by_value(image, 0.0, 1.0)


def _normalise(image, norm: tuple | None):
    mean, stddev = norm or (MEAN_RGB, STDDEV_RGB)
    return (image - mean) / stddev


def _rotate(image, angle):
    """Rotate an ``(H, W, C)`` float image by ``angle`` radians about its centre (bilinear, zero fill)."""
    height, width = tf.cast(tf.shape(image)[0], tf.float32), tf.cast(tf.shape(image)[1], tf.float32)
    cos, sin = tf.cos(angle), tf.sin(angle)
    # the projective transform maps output coordinates to input ones: rotate by -angle about the centre
    x0 = (width - 1) / 2 - (cos * (width - 1) / 2 - sin * (height - 1) / 2)
    y0 = (height - 1) / 2 - (sin * (width - 1) / 2 + cos * (height - 1) / 2)
    transform = tf.stack([cos, -sin, x0, sin, cos, y0, 0.0, 0.0])[None]
    return tf.raw_ops.ImageProjectiveTransformV3(
        images=image[None], transforms=transform, output_shape=tf.shape(image)[:2], fill_value=0.0,
        interpolation="BILINEAR", fill_mode="CONSTANT")[0]


def _examples(split: Split, order: np.ndarray | None, shuffle_seed: int | None):
    """``(encoded, label)`` pairs of a rank's shard, in ``order`` (folder) or shuffled (TFRecord); for an
    in-memory split ``(pixels, label)``, in ``order``."""
    if split.kind == "array":
        images, labels = split.items, _labels(split)
        if order is not None:
            images, labels = images[order], labels[order]
        return tf.data.Dataset.from_tensor_slices((images, labels))
    if split.kind == "folder":
        paths = np.asarray(split.items)
        labels = _labels(split)
        if order is not None:
            paths, labels = paths[order], labels[order]
        return tf.data.Dataset.from_tensor_slices((paths, labels)).map(
            lambda p, y: (tf.io.read_file(p), y), num_parallel_calls=tf.data.AUTOTUNE)
    # dealt records need one file order on every rank and in every epoch; dealt files may be reordered
    ids = order if order is not None and not split.record_shard else np.arange(len(split.items))
    dataset = _keyed_records(np.asarray(split.items)[ids], ids, split.record_shard)
    if split.bad_keys:
        bad = tf.constant(sorted(split.bad_keys), tf.int64)
        dataset = dataset.filter(lambda key, r: tf.reduce_all(tf.not_equal(key, bad)))
    dataset = dataset.map(lambda key, r: tf.io.parse_single_example(r, _FEATURES),
                          num_parallel_calls=tf.data.AUTOTUNE)
    dataset = dataset.map(lambda f: (f["image/encoded"], tf.cast(f["image/class/label"] - 1, tf.int32)))
    if shuffle_seed is not None:
        dataset = dataset.shuffle(10_000, seed=shuffle_seed, reshuffle_each_iteration=False)
    return dataset


def train_dataset(split: Split, *, epoch: int, batch_size: int, steps: int, image_size: int,
                  augment: Augment = Augment(), seed: int = 0, rank: int = 0, size: int = 1, skip: int = 0):
    """Batches ``skip`` to ``steps - 1`` of ``batch_size`` (per rank) augmented training images from ``split``
    for ``epoch``.

    A shared split (``shared_split``) has a global order: a permutation of every example drawn from
    ``(seed, epoch)``, cut into global batches of ``batch_size * size``, of which rank ``rank`` reads the
    ``rank``-th slice; each augmentation is keyed by the example's position in that order. Global batch ``b``
    is then the same images, augmented the same, at any rank count. A rank's own shard (TFRecords) has an
    order and draws that depend on ``(seed, epoch, rank)``: the same at the same rank count only. Raises
    ``DataError`` when the split holds fewer than ``steps`` batches.
    """
    total = steps * batch_size * (size if split.shared else 1)
    if total > split.count:
        raise DataError(f"rank {rank}: train {'data' if split.shared else 'shard'} has {split.count} images, "
                        f"fewer than {steps} steps of {batch_size}" + (f" x {size} ranks" if split.shared else ""))
    if split.shared:
        global_order = np.random.default_rng([seed, epoch]).permutation(len(split.items))[:total]
        # positions in the global order of this rank's examples, batch after batch
        positions = np.arange(total).reshape(steps, size, batch_size)[skip:, rank].ravel()
        order, base = global_order[positions], tf.constant([seed * 1_000_003, epoch], tf.int64)
        dataset = tf.data.Dataset.zip(tf.data.Dataset.from_tensor_slices(positions.astype(np.int64)),
                                      _examples(split, order, None))
    else:
        rng = np.random.default_rng([seed, epoch, rank])
        order = rng.permutation(len(split.items))
        base = tf.constant([seed * 1_000_003 + rank, epoch], tf.int64)
        dataset = _examples(split, order, int(rng.integers(2 ** 31)) if split.kind == "tfrecord" else None)
        dataset = dataset.take(total).enumerate().skip(skip * batch_size)
    dataset = dataset.map(
        lambda i, example: (_normalise(_augment(_image(split, example[0]),
                                                tf.stack([base[0] + base[1] * 7919, i]),
                                                image_size, augment), split.norm), example[1]),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return _pipeline(dataset.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE))


def val_dataset(split: Split, *, batch_size: int, image_size: int, central_fraction: float = 0.875):
    """All of the rank's validation images (last batch may be short): central crop of ``central_fraction``
    of each side, resized to ``image_size``, normalised."""
    def prepare(item, label):
        image = _image(split, item)
        if central_fraction < 1:
            image = tf.image.central_crop(image, central_fraction)
        image = _resize(tf.cast(image, tf.float32) / 255.0, image_size)
        return _normalise(image, split.norm), label
    return _pipeline(_examples(split, None, None).map(prepare, num_parallel_calls=tf.data.AUTOTUNE)
                     .batch(batch_size).prefetch(tf.data.AUTOTUNE))


def synthetic_dataset(*, batch_size: int, steps: int, image_size: int, num_classes: int, seed: int = 0):
    """``steps`` copies of one random batch (like the TF benchmarks' ``--use_synthetic_data``): float32
    ``(batch_size, S, S, 3)`` normal images and int32 uniform labels, generated once on the host."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch_size, image_size, image_size, 3), np.float32)
    labels = rng.integers(0, num_classes, batch_size).astype(np.int32)
    return _pipeline(tf.data.Dataset.from_tensors((images, labels)).repeat(steps).prefetch(1))


def _pipeline(dataset):
    """``dataset`` marked as this rank's share (``per_rank``), without tf.data's autotuning thread: its
    AUTOTUNE stages keep TensorFlow's default parallelism. torus-train ends a ``fit`` every epoch, and that
    thread can hold the iterator's deletion at fit's end for seconds on one rank while every other rank waits
    (measured: bench/fault_injection/README.md, "Epoch ends")."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return per_rank(dataset.with_options(options))
