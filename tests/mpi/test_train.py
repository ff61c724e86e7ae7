"""torus-train end to end on real images (the digits set at 8x8 pixels) with a tiny CNN, in this MPI job:
TFRecords written by TensorFlow's own ``tf.io.TFRecordWriter``, the ILSVRC2012 folder layout, corrupt JPEGs
(reported with their path, skipped or fatal), missing and empty folders. Runs at 1 and 2 ranks.
Budget: about 25 s at 2 ranks (tracing dominates), less at 1.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
from mpi4py import MPI  # noqa: E402

from torus.integrations.keras.app import cli, digits, trainer  # noqa: E402
from torus.integrations.keras.app.data import DataError  # noqa: E402

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 2, reason="torus-train tests run at 1 and 2 ranks")


@pytest.fixture(scope="module")
def shared_tmp(world):
    """A folder every rank sees under the same path (rank 0 makes it), removed at the end."""
    path = world.bcast(tempfile.mkdtemp(prefix="torus-train-") if world.Get_rank() == 0 else None, root=0)
    yield Path(path)
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def digits8(shared_tmp, world):
    """The embedded digits set at 8x8 pixels, built by rank 0 into the shared folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORUS_CACHE", str(shared_tmp / "cache"))
        root = digits.ensure_digits(8) if world.Get_rank() == 0 else None
    return Path(world.bcast(str(root) if root else None, root=0))


def _images(root: Path, split: str):
    files = sorted((root / split).glob("*/*.jpg"))
    return files, [int(p.parent.name.split("_")[1]) for p in files]


def _train(world, data, *extra):
    args = cli.parse_args(["--data", str(data), "--model", "tiny", "--image-size", "8", "--epochs", "1",
                             "--batch-schedule", "0:64", "--warmup-epochs", "0.5", "--verbose", "0", *extra])
    return trainer.Trainer(args, world, threads=1)


def _check_run(world, trainer, summary, train_count):
    """Steps follow from the whole data (folders: global batches) or the smallest shard (TFRecords); weights
    are the same on every rank; metrics are finite."""
    size = world.Get_size()
    smallest = world.allreduce(trainer.train_split.count, op=MPI.MIN)
    assert world.allreduce(trainer.train_split.count) == train_count
    shared = trainer.train_data.shared
    assert shared == (trainer.train_split.kind == "folder")
    assert summary["history"][0]["steps"] == (train_count // 64 if shared else smallest // (64 // size))
    assert np.isfinite(summary["history"][0]["loss"])
    assert 0 <= summary["val_top1"] <= summary["val_top5"] <= 1
    weights = np.concatenate([np.ravel(v.numpy()) for v in trainer.model.weights])
    assert all(np.array_equal(weights, w) for w in world.allgather(weights))


def _write_tfrecords(files, labels, prefix: Path, shards: int) -> None:
    """ImageNet-style shards written with TensorFlow's own writer: image/encoded, 1-based image/class/label."""
    for shard in range(shards):
        with tf.io.TFRecordWriter(f"{prefix}-{shard:05d}-of-{shards:05d}") as writer:
            for path, label in zip(files[shard::shards], labels[shard::shards]):
                feature = {"image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[path.read_bytes()])),
                           "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label + 1]))}
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())


def test_train_from_tfrecords(world, digits8, shared_tmp):
    folder = shared_tmp / "records"
    train_files, train_labels = _images(digits8, "train")
    if world.Get_rank() == 0:
        folder.mkdir()
        _write_tfrecords(train_files, train_labels, folder / "train", 3)  # >= size: whole files per rank
        val_files, val_labels = _images(digits8, "val")
        _write_tfrecords(val_files, val_labels, folder / "validation", 1)  # < size at 2 ranks: records dealt
    world.Barrier()
    trainer = _train(world, folder)
    assert trainer.train_split.kind == "tfrecord" and trainer.num_classes == 10
    _check_run(world, trainer, trainer.run(), len(train_files))


def test_train_from_folders_with_every_augmentation_custom_loop(world, digits8):
    trainer = _train(world, digits8, "--augment", "crop=0.5,flip,rotate=15,color=0.1,noise=0.02",
                     "--trainer", "loop")
    assert trainer.train_split.kind == "folder"
    _check_run(world, trainer, trainer.run(), len(_images(digits8, "train")[0]))


@pytest.fixture(scope="module")
def corrupt(world, digits8, shared_tmp):
    """A copy of the digits set with one truncated JPEG and one non-image in train/."""
    root = shared_tmp / "corrupt"
    bad = [root / "train" / "digit_3" / "truncated.jpg", root / "train" / "digit_7" / "not-an-image.jpg"]
    if world.Get_rank() == 0:
        shutil.copytree(digits8, root)
        good = next((root / "train" / "digit_3").glob("*.jpg")).read_bytes()
        bad[0].write_bytes(good[: len(good) // 2])
        bad[1].write_text("this is not a JPEG")
    world.Barrier()
    return root, bad


def test_corrupt_image_fails_with_its_path(world, corrupt):
    root, bad = corrupt
    with pytest.raises(DataError) as info:
        _train(world, root, "--on-bad-image", "fail")
    for path in bad:  # every rank's error names both files, whichever rank holds them
        assert str(path) in str(info.value)


def test_corrupt_image_skipped_with_warning(world, corrupt, digits8, capfd):
    root, bad = corrupt
    trainer = _train(world, root)
    err = capfd.readouterr().err
    reported = [str(p) for p in bad if str(p) in err]
    assert sorted(sum(world.allgather(reported), [])) == sorted(map(str, bad)), err
    assert world.allreduce(len(trainer.train_split.bad)) == 2
    _check_run(world, trainer, trainer.run(), len(_images(digits8, "train")[0]))


def test_missing_and_empty_folders_are_clear_errors(world, shared_tmp):
    missing = shared_tmp / "no-such-folder"
    with pytest.raises(DataError, match=f"data folder {missing} does not exist"):
        _train(world, missing)
    empty = shared_tmp / "empty"
    if world.Get_rank() == 0:
        (empty / "train" / "class_a").mkdir(parents=True)
    world.Barrier()
    with pytest.raises(DataError, match="holds no images"):
        _train(world, empty)
