"""Input pipeline pieces in one process: the folder and TFRecord layouts agree image for image, shards are
disjoint and complete, the epoch order is a pure function of (seed, epoch, rank), global batches are the same
at every rank count and after a skip, the rotation matches numpy's, bad images are found by path, the digits
set is built once and completely, and a checkpoint round-trips. Budget: about 15 s (TensorFlow start-up and
one tiny model).
"""
from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
from PIL import Image  # noqa: E402

from torus.integrations.keras.app import checkpoint, data, digits, tfrecords  # noqa: E402

CLASSES = ["n01", "n02", "n10"]  # sorted folder names give labels 0, 1, 2


@pytest.fixture
def tree(tmp_path, rng):
    """An ILSVRC2012-style tree of random 12x10 RGB PNG images (lossless, so pixels are checkable):
    7 per class in train/, 2 per class in val/. Returns (root, {path: (label, pixels)})."""
    truth = {}
    for split, count in (("train", 7), ("val", 2)):
        for label, name in enumerate(CLASSES):
            (tmp_path / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)
                path = tmp_path / split / name / f"{i}.png"
                Image.fromarray(pixels).save(path)
                truth[str(path)] = (label, pixels)
    return tmp_path, truth


def _all_val(split: data.Split) -> tuple[np.ndarray, np.ndarray]:
    images, labels = zip(*data.val_dataset(split, batch_size=64, image_size=10, central_fraction=1.0)
                         .unbatch().as_numpy_iterator())
    return np.stack(images), np.array(labels)


def test_folder_labels_and_shards(tree):
    root, truth = tree
    shards = [data.open_split(root, "train", rank=r, size=3) for r in range(3)]
    paths = [p for s in shards for p in s.items]
    assert sorted(paths) == sorted(p for p in truth if "/train/" in p)  # disjoint and complete
    for s in shards:
        assert s.num_classes == 3 and s.count == len(s.items)
        assert [truth[p][0] for p in s.items] == s.labels.tolist()


def test_tfrecords_match_folders(tree, tmp_path_factory):
    root, truth = tree
    out = tmp_path_factory.mktemp("records")
    tfrecords.main([str(root), str(out), "--train-shards", "2", "--val-shards", "1"])
    assert sorted(p.name for p in out.iterdir()) == ["train-00000-of-00002", "train-00001-of-00002",
                                                    "validation-00000-of-00001"]
    record = next(iter(tf.data.TFRecordDataset(str(out / "validation-00000-of-00001"))))
    example = tf.train.Example.FromString(record.numpy()).features.feature
    assert example["image/class/label"].int64_list.value[0] in (1, 2, 3)  # 1-based
    assert example["image/height"].int64_list.value[0] == 10 and example["image/width"].int64_list.value[0] == 12
    from_records, from_folder = data.open_split(out, "val"), data.open_split(root, "val")
    assert from_records.kind == "tfrecord" and from_records.count == 6
    (x1, y1), (x2, y2) = _all_val(from_records), _all_val(from_folder)
    key = lambda x, y: sorted((int(label), image.tobytes()) for image, label in zip(x, y))  # noqa: E731
    assert key(x1, y1) == key(x2, y2)


def test_epoch_order_is_a_function_of_seed_epoch_rank(tree):
    split = data.open_split(tree[0], "train")
    aug = data.Augment.parse("crop=0.3,flip,rotate,color,noise")

    def epoch(e, seed=0):
        batches = data.train_dataset(split, epoch=e, batch_size=7, steps=3, image_size=8, augment=aug, seed=seed)
        return [(x.numpy(), y.numpy()) for x, y in batches]
    first, again, other = epoch(1), epoch(1), epoch(2)
    for (x, y), (x2, y2) in zip(first, again):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
    assert not all(np.array_equal(a[1], b[1]) for a, b in zip(first, other))
    assert np.concatenate([y for _, y in first]).tolist() != np.concatenate([y for _, y in epoch(1, seed=5)]).tolist()
    assert first[0][0].shape == (7, 8, 8, 3) and first[0][0].dtype == np.float32


class _Comm:
    """What shared_split needs of a communicator, for ``size`` shards opened in this one process."""

    def __init__(self, shards):
        self.shards = shards

    def allgather(self, _mine):
        return [{where for where, _ in s.bad} for s in self.shards]


def test_global_batches_are_the_same_at_every_rank_count_and_after_a_skip(tree):
    """Global batch b (the ranks' slices, in rank order) is the same images, augmented the same, at 1, 2 and 3
    ranks, and from ``skip=k`` on equals the uninterrupted epoch's batches k.. (a resume at another count)."""
    aug = data.Augment.parse("crop=0.3,flip,rotate,color,noise")
    global_batch, steps = 6, 3

    def epoch(size, skip=0):
        shards = [data.open_split(tree[0], "train", rank=r, size=size) for r in range(size)]
        splits = [data.shared_split(s, _Comm(shards)) for s in shards]
        assert all(s.shared and s.count == 21 and s.items == splits[0].items for s in splits)
        per_rank = [[(x.numpy(), y.numpy()) for x, y in data.train_dataset(
            split, epoch=2, batch_size=global_batch // size, steps=steps, image_size=8, augment=aug, seed=3,
            rank=r, size=size, skip=skip)] for r, split in enumerate(splits)]
        return [(np.concatenate([b[0] for b in batch]), np.concatenate([b[1] for b in batch]))
                for batch in zip(*per_rank)]
    one = epoch(1)
    assert len(one) == steps and one[0][0].shape == (6, 8, 8, 3)
    assert len({y.tobytes() for _, y in one}) > 1  # not one batch repeated
    for size, skip in ((2, 0), (3, 0), (2, 1), (3, 2), (1, 2)):
        other = epoch(size, skip)
        assert len(other) == steps - skip, (size, skip)
        for (x, y), (x2, y2) in zip(one[skip:], other):
            np.testing.assert_array_equal(y, y2)
            np.testing.assert_allclose(x, x2, rtol=0, atol=1e-6)  # the same ops on the same image and key


def test_shared_split_leaves_out_every_ranks_bad_images(tree):
    root, truth = tree
    bad = sorted(p for p in truth if "/train/" in p)[4]
    Path(bad).write_bytes(b"not an image")
    shards = [data.open_split(root, "train", rank=r, size=2) for r in range(2)]
    assert sum(len(s.bad) for s in shards) == 1
    for s in shards:
        shared = data.shared_split(s, _Comm(shards))
        assert shared.count == 20 and bad not in shared.items
        assert [truth[p][0] for p in shared.items] == shared.labels.tolist()


def test_augment_parse():
    assert data.Augment.parse("none") == data.Augment()
    assert data.Augment.parse("crop=0.25,flip,rotate=5") == data.Augment(crop_area=0.25, flip=True, rotate=5.0)
    with pytest.raises(ValueError, match="unknown augmentation 'blur'"):
        data.Augment.parse("flip,blur")


def test_rotation_by_quarter_turns_matches_numpy(rng):
    image = rng.random((9, 9, 2)).astype(np.float32)
    np.testing.assert_allclose(data._rotate(tf.constant(image), tf.constant(0.0)).numpy(), image, atol=1e-6)
    # a positive angle turns the picture counter-clockwise, as np.rot90 does
    np.testing.assert_allclose(data._rotate(tf.constant(image), tf.constant(np.pi / 2, tf.float32)).numpy(),
                               np.rot90(image), atol=1e-5)


def test_bad_images_are_named(tree):
    root, _ = tree
    truncated, text = root / "train" / "n02" / "cut.png", root / "train" / "n10" / "text.jpg"
    good = (root / "train" / "n02" / "0.png").read_bytes()
    truncated.write_bytes(good[:40])
    text.write_text("not an image")
    with pytest.raises(data.DataError) as info:
        data.open_split(root, "train", on_bad_image="fail")
    assert str(truncated) in str(info.value) and str(text) in str(info.value)
    split = data.open_split(root, "train", on_bad_image="skip")
    assert split.count == 21 and sorted(p for p, _ in split.bad) == sorted([str(truncated), str(text)])
    assert str(truncated) not in split.items


def test_missing_or_empty_data_folder(tmp_path):
    with pytest.raises(data.DataError, match="does not exist"):
        data.open_split(tmp_path / "nothing", "train")
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(data.DataError, match="holds no images"):
        data.open_split(tmp_path, "train")


def _build(cache: str) -> str:
    os.environ["TORUS_CACHE"] = cache
    return str(digits.ensure_digits(8))


def test_digits_built_once_completely_by_concurrent_processes(tmp_path):
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        roots = pool.map(_build, [str(tmp_path)] * 2)
    root = Path(roots[0])
    assert roots[1] == roots[0] and sorted(p.name for p in tmp_path.iterdir()) == ["digits-8", "digits-8.lock"]
    counts = {split: len(list((root / split).glob("digit_*/*.jpg"))) for split in ("train", "val")}
    assert counts == {"train": 1437, "val": 360}  # load_digits' 1,797 scans, 20 % held out
    assert data.class_names(root) == [f"digit_{d}" for d in range(10)]
    with Image.open(next((root / "val" / "digit_4").iterdir())) as image:
        assert image.size == (8, 8) and image.mode == "RGB"


def test_checkpoint_round_trip_and_latest(tmp_path, rng):
    import keras
    model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.fit(rng.random((8, 3)), rng.random((8, 2)), verbose=0)
    for epoch in (1, 2, 3):
        checkpoint.save(tmp_path, epoch, model, {"epoch": epoch})
    (tmp_path / ".checkpoint-000004.npz.123.tmp").write_bytes(b"half")  # a killed writer's leftover
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["checkpoint-000002.npz",
                                                                        "checkpoint-000003.npz"]
    assert checkpoint.read_state(checkpoint.latest(tmp_path)) == {"epoch": 3}
    saved = [v.numpy().copy() for v in model.weights + model.optimizer.variables]
    for v in model.weights + model.optimizer.variables:
        v.assign(np.zeros(v.shape, v.dtype))
    assert checkpoint.restore(checkpoint.latest(tmp_path), model) == {"epoch": 3}
    for v, s in zip(model.weights + model.optimizer.variables, saved):
        np.testing.assert_array_equal(v.numpy(), s)


def test_bad_tfrecord_is_named_and_left_out_in_every_file_order(tree, tmp_path_factory):
    root, truth = tree
    out = tmp_path_factory.mktemp("bad-records")
    items = [(Path(p).read_bytes(), label) for p, (label, _) in sorted(truth.items()) if "/train/" in p]
    items.insert(5, (b"garbage", 2))  # record 2 of file 1 below (records dealt round-robin to 2 files)
    files = [str(out / f"train-0000{f}-of-00002") for f in range(2)]
    for f, name in enumerate(files):
        with tf.io.TFRecordWriter(name) as writer:
            for encoded, label in items[f::2]:
                feature = {"image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded])),
                           "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label + 1]))}
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    split = data.open_split(out, "train", num_classes=3)
    assert [where for where, _ in split.bad] == [f"{files[1]}, record 2"] and split.count == 21
    expected = sorted(label for encoded, label in items if encoded != b"garbage")
    # the file order is a function of the epoch (seed 0: files 0, 1 in epoch 4, files 1, 0 in epoch 5); the bad
    # record must be left out in both orders
    orders = [np.random.default_rng([0, epoch, 0]).permutation(2).tolist() for epoch in (4, 5)]
    assert orders == [[0, 1], [1, 0]]
    for epoch in (4, 5):
        labels = [int(y) for _, y in data.train_dataset(split, epoch=epoch, batch_size=1, steps=21, image_size=4)
                  .unbatch().as_numpy_iterator()]
        assert sorted(labels) == expected
