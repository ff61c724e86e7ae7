"""Fashion-MNIST's idx reader (app/idx.py), its in-memory split (data.open_idx) and ResNet-20 (app/resnet.py), in
one process. The reader is checked against idx files written here byte by byte, against the packaged files read
independently with gzip and struct, and against published facts of the data set (Xiao et al. 2017: 60,000
training and 10,000 test images of 28x28, 6,000 and 1,000 of each of the 10 classes); bad files are named with
what is wrong. ResNet-20's parameter count is checked against the closed form of He et al. 2016, section 4.2.
Budget: about 15 s (reading the packaged files, TensorFlow start-up, one small model).
"""
from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from torus.integrations.keras.app import idx

PACKAGED = idx.FASHION_MNIST_DIR
needs_package = pytest.mark.skipif(not PACKAGED.is_dir(), reason=f"{PACKAGED} absent: apt-get install "
                                   "dataset-fashion-mnist")


def _idx_bytes(type_code: int, dims: tuple, payload: bytes) -> bytes:
    """An idx file written from the format's description, not with the reader's code."""
    return bytes([0, 0, type_code, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + payload


def _write_set(folder: Path, train: int = 6, test: int = 4, side: int = 3, gz: bool = True) -> dict:
    """The four files of a tiny data set with known pixels (image i holds i + its pixel index) and labels
    (i % 10); returns the arrays written."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, count in (("train", train), ("test", test)):
        images = (np.arange(count)[:, None, None] + np.arange(side * side).reshape(side, side)).astype(np.uint8)
        labels = (np.arange(count) % 10).astype(np.uint8)
        arrays[split] = images, labels
        for kind, array, code in (("images", images, 0x08), ("labels", labels, 0x08)):
            raw = _idx_bytes(code, array.shape, array.tobytes())
            name = idx.FILES[split, kind]
            if gz:
                (folder / f"{name}.gz").write_bytes(gzip.compress(raw))
            else:
                (folder / name).write_bytes(raw)
    return arrays


def test_hand_written_files_read_back(tmp_path):
    pixels = bytes([0, 1, 2, 3, 4, 5, 250, 251, 252, 253, 254, 255])
    got = idx.parse(_idx_bytes(0x08, (2, 3, 2), pixels))
    assert got.dtype == np.uint8 and got.shape == (2, 3, 2)
    assert got[1, 0, 0] == 250 and got[0, 2, 1] == 5 and got[1, 2, 1] == 255
    wide = idx.parse(_idx_bytes(0x0B, (3,), struct.pack(">hhh", -2, 300, 7)))  # big-endian int16
    assert wide.dtype == np.int16 and wide.tolist() == [-2, 300, 7]
    arrays = _write_set(tmp_path / "gz")
    _write_set(tmp_path / "plain", gz=False)
    for folder in ("gz", "plain"):
        assert idx.locate(str(tmp_path / folder)) == tmp_path / folder
        for split in ("train", "test"):
            images, labels = idx.load_split(tmp_path / folder, split)
            np.testing.assert_array_equal(images, arrays[split][0])
            np.testing.assert_array_equal(labels, arrays[split][1])


@pytest.mark.parametrize("raw, problem", [
    (b"\x00\x00", "truncated: 2 bytes, shorter than the 4-byte magic number"),
    (b"\x1f\x8b\x08\x03" + bytes(20), "bad magic number 0x1f8b0803"),
    (b"\x00\x00\x07\x01" + bytes(8), "bad magic number 0x00000701"),
    (_idx_bytes(0x08, (5, 28, 28), b"")[:10], "truncated header: 3 dimensions need 16 bytes, the file has 10"),
    (_idx_bytes(0x08, (5, 2, 2), bytes(19)), "truncated: dimensions (5, 2, 2) need 20 bytes of data, the file "
                                             "holds 19"),
    (_idx_bytes(0x0C, (2,), bytes(7)), "truncated: dimensions (2,) need 8 bytes"),
    (_idx_bytes(0x08, (2,), bytes(3)), "trailing bytes: dimensions (2,) need 2 bytes of data, the file holds 3"),
])
def test_bad_bytes_are_named_with_the_problem(tmp_path, raw, problem):
    path = tmp_path / "train-labels-idx1-ubyte"
    path.write_bytes(raw)
    with pytest.raises(idx.IdxError) as info:
        idx.read(path)
    assert str(info.value).startswith(f"{path}: ") and problem in str(info.value)


def test_truncated_files_in_a_set_are_named(tmp_path):
    _write_set(tmp_path)
    images = tmp_path / "train-images-idx3-ubyte.gz"
    whole = images.read_bytes()
    images.write_bytes(whole[: len(whole) - 9])  # the gzip trailer and a little data gone
    with pytest.raises(idx.IdxError, match=f"^{images}: truncated or corrupt gzip stream"):
        idx.load_split(tmp_path, "train")
    raw = gzip.decompress(whole)
    images.write_bytes(gzip.compress(raw[:-5]))  # a complete gzip stream of a short idx file
    with pytest.raises(idx.IdxError, match=rf"^{images}: truncated: dimensions \(6, 3, 3\) need 54 bytes of "
                                           "data, the file holds 49"):
        idx.load_split(tmp_path, "train")


def test_inconsistent_sets_are_named(tmp_path):
    _write_set(tmp_path, train=6)
    labels = tmp_path / "train-labels-idx1-ubyte.gz"
    labels.write_bytes(gzip.compress(_idx_bytes(0x08, (5,), bytes(5))))
    with pytest.raises(idx.IdxError, match="5 labels for the 6 images"):
        idx.load_split(tmp_path, "train")
    labels.write_bytes(gzip.compress(_idx_bytes(0x08, (6,), bytes([0, 1, 2, 10, 4, 5]))))
    with pytest.raises(idx.IdxError, match=r"label 10 is outside \[0, 10\)"):
        idx.load_split(tmp_path, "train")
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(idx.MissingData, match=rf"^--data {tmp_path} lacks t10k-labels-idx1-ubyte\[\.gz\]; "
                                              "apt-get install dataset-fashion-mnist, or --data DIR"):
        idx.locate(str(tmp_path))
    assert idx.locate(str(tmp_path / "no-such-folder")) is None  # another layout's problem (data.open_split)


@needs_package
def test_packaged_files_against_independent_reads_and_published_facts():
    def raw(name: str) -> bytes:
        with gzip.open(PACKAGED / f"{name}.gz", "rb") as f:
            return f.read()
    images, labels = raw("train-images-idx3-ubyte"), raw("train-labels-idx1-ubyte")
    assert struct.unpack(">IIII", images[:16]) == (0x803, 60000, 28, 28)
    assert struct.unpack(">II", labels[:8]) == (0x801, 60000)
    train_x, train_y = idx.load_split(PACKAGED, "train")
    test_x, test_y = idx.load_split(PACKAGED, "test")
    assert train_x.shape == (60000, 28, 28) and test_x.shape == (10000, 28, 28)
    for i in (0, 1, 31337, 59999):
        assert train_y[i] == labels[8 + i]
        for r, c in ((0, 0), (14, 14), (27, 27), (10, 20)):
            assert train_x[i, r, c] == images[16 + i * 784 + r * 28 + c], (i, r, c)
    assert np.bincount(train_y).tolist() == [6000] * 10  # published: 6,000 per class in training
    assert np.bincount(test_y).tolist() == [1000] * 10  # and 1,000 per class in the test set
    assert idx.locate("fashion-mnist") == PACKAGED


def test_open_idx_global_batches_and_test_slices(tmp_path):
    """Global batch b is the same images at 1 and 2 ranks (the ranks' slices, in rank order); the test split's
    rank slices together are the whole test split, each image once."""
    pytest.importorskip("tensorflow")
    from torus.integrations.keras.app import data
    arrays = _write_set(tmp_path, train=40, test=9, side=4)

    def epoch(size):
        per_rank = []
        for rank in range(size):
            train, _ = data.open_idx(tmp_path, rank=rank, size=size)
            per_rank.append([(x.numpy(), y.numpy()) for x, y in data.train_dataset(
                train, epoch=1, batch_size=8 // size, steps=4, image_size=4, seed=5, rank=rank, size=size)])
        return [(np.concatenate([b[0] for b in batch]), np.concatenate([b[1] for b in batch]))
                for batch in zip(*per_rank)]
    one, two = epoch(1), epoch(2)
    assert len(one) == len(two) == 4 and one[0][0].shape == (8, 4, 4, 1) and one[0][0].dtype == np.float32
    for (x, y), (x2, y2) in zip(one, two):
        np.testing.assert_array_equal(y, y2)
        np.testing.assert_array_equal(x, x2)
    seen = np.concatenate([y for _, y in one])
    assert len(set(seen.tolist())) > 1 and len(seen) == 32
    train, _ = data.open_idx(tmp_path)
    pixels = arrays["train"][0].astype(np.float64) / 255
    assert np.allclose(train.norm, ((pixels.mean(),), (pixels.std(),)), rtol=1e-6)
    # normalised pixels map back to the stored ones; an image's first pixel is its index (see _write_set)
    firsts = np.rint((one[0][0][:, 0, 0, 0] * train.norm[1][0] + train.norm[0][0]) * 255)
    np.testing.assert_array_equal(firsts % 10, one[0][1])
    tests = [data.open_idx(tmp_path, rank=r, size=2)[1] for r in range(2)]
    assert [t.count for t in tests] == [5, 4]
    both = np.concatenate([t.labels for t in tests])
    assert sorted(both.tolist()) == sorted(arrays["test"][1].tolist())


def test_subset_is_fixed_and_refuses_too_many(tmp_path):
    pytest.importorskip("tensorflow")
    from torus.integrations.keras.app import data
    _write_set(tmp_path, train=30)
    train, _ = data.open_idx(tmp_path)
    small = data.subset(train, 12)
    assert small.count == 12 and small.items.shape == (12, 3, 3, 1)
    again = data.subset(data.open_idx(tmp_path)[0], 12)
    np.testing.assert_array_equal(small.items, again.items)
    firsts = small.items[:, 0, 0, 0].astype(int)  # image i's first pixel is i
    assert list(firsts) == sorted(set(firsts)) and np.array_equal(small.labels, firsts % 10)
    with pytest.raises(data.DataError, match="--train-images 31: the training data holds only 30 images"):
        data.subset(train, 31)


def _resnet20_parameters(channels: int, classes: int) -> tuple[int, int]:
    """(trainable, all) of He et al.'s ResNet-20 with option-A shortcuts, counted layer by layer from the
    paper's description: a 3x3 conv to 16 filters, 3 stages x 3 blocks x 2 3x3 convs of 16, 32, 64 filters
    (no bias), a batch norm (2 trained + 2 moving per channel) after each conv, a dense layer."""
    convs = [(channels, 16)] + [(16, 16)] * 6 + [(16, 32)] + [(32, 32)] * 5 + [(32, 64)] + [(64, 64)] * 5
    kernels = sum(9 * c_in * c_out for c_in, c_out in convs)
    bn_channels = sum(c_out for _, c_out in convs)
    dense = 64 * classes + classes
    return kernels + 2 * bn_channels + dense, kernels + 4 * bn_channels + dense


def test_resnet20_parameters_and_shapes():
    keras = pytest.importorskip("keras")
    from torus.integrations.keras.app.resnet import ZeroPadShortcut
    from torus.integrations.keras.app.trainer import build_model
    for channels, side in ((1, 28), (3, 32)):
        model = build_model("resnet20", side, 10, 0.9, channels)
        trainable, total = _resnet20_parameters(channels, 10)
        assert sum(int(np.prod(v.shape)) for v in model.trainable_weights) == trainable
        assert model.count_params() == total
        assert all(layer.momentum == 0.9 for layer in model.layers
                   if isinstance(layer, keras.layers.BatchNormalization))
    assert _resnet20_parameters(1, 10) == (269434, 270810)  # "0.27M" in He et al.'s table 6
    x = np.random.default_rng(0).standard_normal((2, 28, 28, 1)).astype(np.float32)
    assert tuple(model.output_shape) == (None, 10)
    assert tuple(build_model("resnet20", 28, 10, 0.9, 1)(x).shape) == (2, 10)
    strides = [layer.output.shape[1] for layer in model.layers if isinstance(layer, keras.layers.Add)]
    assert strides == [32] * 3 + [16] * 3 + [8] * 3
    y = np.arange(2 * 5 * 5 * 3, dtype=np.float32).reshape(2, 5, 5, 3)
    got = np.asarray(ZeroPadShortcut(2)(y))
    np.testing.assert_array_equal(got[..., :3], y[:, ::2, ::2, :])
    assert got.shape == (2, 3, 3, 5) and not got[..., 3:].any()


def test_missing_package_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(idx, "FASHION_MNIST_DIR", tmp_path / "absent")
    with pytest.raises(idx.MissingData, match=rf"^--data fashion-mnist: {tmp_path}/absent does not exist; apt-get "
                                              r"install dataset-fashion-mnist, or --data DIR holding "
                                              r"train-images-idx3-ubyte\[\.gz\], "):
        idx.locate("fashion-mnist")
    (tmp_path / "absent").mkdir()
    with pytest.raises(idx.MissingData, match="holds none of its idx files; apt-get install"):
        idx.locate("fashion-mnist")


def test_optimizer_choices():
    keras = pytest.importorskip("keras")
    from torus.integrations.keras.app import cli, trainer
    nesterov = trainer.build_optimizer(cli.parse_args(["--optimizer", "nesterov", "--momentum", "0.8"]))
    assert isinstance(nesterov, keras.optimizers.SGD) and nesterov.nesterov and nesterov.momentum == 0.8
    adam = trainer.build_optimizer(cli.parse_args(["--optimizer", "adam", "--momentum", "0.85",
                                                   "--weight-decay", "0.001"]))
    assert isinstance(adam, keras.optimizers.Adam) and adam.beta_1 == 0.85 and adam.weight_decay == 0.001
    sgd = trainer.build_optimizer(cli.parse_args(["--optimizer", "sgd"]))
    assert isinstance(sgd, keras.optimizers.SGD) and not sgd.nesterov
