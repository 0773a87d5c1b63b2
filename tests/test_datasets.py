"""Tests of concatfl.data.datasets on tiny fixture files written in each dataset's real format."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import struct
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
from PIL import Image

from concatfl.data import datasets
from concatfl.data.datasets import (
    DATASETS,
    DOWNLOAD_URLS,
    DatasetNotFoundError,
    LoadedData,
    load_dataset,
)

CIFAR10_CLASSES = [
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"
]
IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte")
IDX_FILES = "{" + ",".join(IDX_NAMES) + "}"
CIFAR10_PICKLES = "{data_batch_1,data_batch_2,data_batch_3,data_batch_4,data_batch_5,test_batch}"


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Decoded-image cache under tmp_path, and a cold in-process cache for every test."""
    monkeypatch.setenv("CONCATFL_CACHE", str(tmp_path / "cache"))
    datasets._load_cached.cache_clear()
    yield
    datasets._load_cached.cache_clear()


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _scaled(u8: np.ndarray) -> np.ndarray:
    return u8.astype(np.float32) / 255


def _assert_images(x: torch.Tensor, shape: tuple[int, ...]) -> None:
    assert x.dtype == torch.float32
    assert tuple(x.shape) == shape
    assert x.is_contiguous()
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0


def _assert_labels(y: torch.Tensor, expected: np.ndarray) -> None:
    assert y.dtype == torch.int64
    assert y.tolist() == list(expected)


# --------------------------------------------------------------------------- writers


def _idx_bytes(arr: np.ndarray) -> bytes:
    arr = np.asarray(arr, dtype=np.uint8)
    header = struct.pack(">I", 0x0800 | arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.tobytes()


def _write_idx_set(
    folder: Path, gz: bool, n_train: int = 5, n_test: int = 3
) -> dict[str, np.ndarray]:
    rng = _rng()
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, arr in arrays.items():
        data = _idx_bytes(arr)
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / name).write_bytes(data)
    return arrays


def _cifar_batch(n: int, rng: np.random.Generator, **labels: list[int]) -> dict[bytes, object]:
    batch: dict[bytes, object] = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8)}
    batch.update({k.encode(): v for k, v in labels.items()})
    return batch


def _write_cifar10_pickles(root: Path) -> dict[str, dict[bytes, object]]:
    rng = _rng(1)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batches[name] = _cifar_batch(2, rng, labels=rng.integers(0, 10, 2).tolist())
        (folder / name).write_bytes(pickle.dumps(batches[name]))
    return batches


def _write_cifar100_pickles(root: Path) -> dict[str, dict[bytes, object]]:
    rng = _rng(2)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    batches = {
        "train": _cifar_batch(4, rng, fine_labels=[0, 57, 99, 3], coarse_labels=[4, 19, 0, 7]),
        "test": _cifar_batch(2, rng, fine_labels=[42, 99], coarse_labels=[19, 1]),
    }
    for name, batch in batches.items():
        (folder / name).write_bytes(pickle.dumps(batch))
    return batches


def _png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _image_tree_files() -> dict[str, np.ndarray]:
    """Relative path → RGB image: 2 train + 1 test image per class."""
    rng = _rng(3)
    files = {}
    for cls in CIFAR10_CLASSES:
        for split, names in (("train", ["b.png", "a.png"]), ("test", ["0.png"])):
            for name in names:
                files[f"{split}/{cls}/{name}"] = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    return files


def _expected_tree(files: dict[str, np.ndarray], split: str) -> tuple[np.ndarray, list[int]]:
    keys = sorted(k for k in files if k.startswith(f"{split}/"))
    x = _scaled(np.stack([files[k] for k in keys]).transpose(0, 3, 1, 2))
    y = [CIFAR10_CLASSES.index(k.split("/")[1]) for k in keys]
    return x, y


def _write_image_tree(root: Path, files: dict[str, np.ndarray]) -> None:
    for rel, img in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_png(img))


def _write_tar(archive: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(archive, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def _write_svhn(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = _rng(4)
    folder.mkdir(parents=True, exist_ok=True)
    mats = {
        "train_32x32.mat": (
            rng.integers(0, 256, (32, 32, 3, 4), dtype=np.uint8),
            np.array([[10], [1], [9], [10]], dtype=np.uint8),
        ),
        "test_32x32.mat": (
            rng.integers(0, 256, (32, 32, 3, 2), dtype=np.uint8),
            np.array([[3], [10]], dtype=np.uint8),
        ),
    }
    for name, (x, y) in mats.items():
        scipy.io.savemat(folder / name, {"X": x, "y": y})
    return mats


def _leaf_shard(users: dict[str, list[int]], rng: np.random.Generator) -> dict[str, object]:
    return {
        "users": list(users),
        "num_samples": [len(y) for y in users.values()],
        "user_data": {
            uid: {"x": rng.random((len(y), 784)).round(3).tolist(), "y": y}
            for uid, y in users.items()
        },
    }


def _write_femnist(folder: Path) -> dict[str, list[dict[str, object]]]:
    rng = _rng(5)
    shards = {
        "train": [
            _leaf_shard({"f0001_41": [0, 61, 5]}, rng),
            _leaf_shard({"f0002_07": [36, 9]}, rng),
        ],
        "test": [_leaf_shard({"f0001_41": [1], "f0002_07": [61, 2]}, rng)],
    }
    for split, items in shards.items():
        (folder / split).mkdir(parents=True)
        for i, shard in enumerate(items):
            shard_file = folder / split / f"all_data_{i}_niid_0_keep_0_{split}_9.json"
            shard_file.write_text(json.dumps(shard))
    return shards


# --------------------------------------------------------------------------- digits and API


def test_digits_fixed_stratified_split() -> None:
    d = load_dataset("digits")
    assert isinstance(d, LoadedData)
    _assert_images(d.x_train, (1437, 1, 8, 8))
    _assert_images(d.x_test, (360, 1, 8, 8))
    assert float(d.x_train.max()) == 1.0
    assert d.y_train.dtype == torch.int64 and d.num_classes == 10 and d.input_shape == (1, 8, 8)
    # Stratified: every class holds ~20% of its samples in the test split.
    train_counts, test_counts = np.bincount(d.y_train.numpy()), np.bincount(d.y_test.numpy())
    assert np.all(np.abs(test_counts / (train_counts + test_counts) - 0.2) < 0.02)
    assert d.mean == pytest.approx((float(d.x_train.mean()),), rel=1e-5)
    assert d.std == pytest.approx((float(d.x_train.std(unbiased=False)),), rel=1e-5)
    assert d.train_writers is None and d.test_writers is None
    datasets._load_cached.cache_clear()
    again = load_dataset("digits", "/ignored")
    assert again is not d
    assert torch.equal(again.x_test, d.x_test) and torch.equal(again.y_train, d.y_train)


def test_results_are_cached_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_idx_set(tmp_path / "MNIST" / "raw", gz=True)
    first = load_dataset("mnist", tmp_path)
    monkeypatch.chdir(tmp_path.parent)
    assert load_dataset("mnist", os.path.join(tmp_path.name, ".")) is first
    assert load_dataset("digits") is load_dataset("digits", "anything")


def test_unknown_dataset_and_bad_cifar100_labels() -> None:
    with pytest.raises(ValueError) as err:
        load_dataset("imagenet")
    for name in DATASETS:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="cifar100-labels"):
        load_dataset("cifar100", cifar100_labels="medium")


# --------------------------------------------------------------------------- MNIST / FMNIST


@pytest.mark.parametrize(
    ("name", "sub", "gz"),
    [
        ("mnist", "MNIST/raw", True),
        ("mnist", "mnist", False),
        ("mnist", "", True),
        ("fmnist", "FashionMNIST/raw", False),
        ("fmnist", "fashion-mnist", True),
        ("fmnist", "", False),
    ],
)
def test_idx_layouts(tmp_path: Path, name: str, sub: str, gz: bool) -> None:
    arrays = _write_idx_set(tmp_path / sub, gz=gz)
    d = load_dataset(name, tmp_path)
    _assert_images(d.x_train, (5, 1, 28, 28))
    _assert_images(d.x_test, (3, 1, 28, 28))
    train_images, test_images = arrays["train-images-idx3-ubyte"], arrays["t10k-images-idx3-ubyte"]
    np.testing.assert_array_equal(d.x_train.numpy()[:, 0], _scaled(train_images))
    np.testing.assert_array_equal(d.x_test.numpy()[:, 0], _scaled(test_images))
    _assert_labels(d.y_train, arrays["train-labels-idx1-ubyte"])
    _assert_labels(d.y_test, arrays["t10k-labels-idx1-ubyte"])
    assert d.num_classes == 10 and d.input_shape == (1, 28, 28)
    expected = ((0.1307,), (0.3081,)) if name == "mnist" else ((0.2860,), (0.3530,))
    assert (d.mean, d.std) == expected


def test_idx_bad_magic(tmp_path: Path) -> None:
    arrays = _write_idx_set(tmp_path, gz=False)
    # A labels file where the images belong.
    labels = _idx_bytes(arrays["train-labels-idx1-ubyte"])
    (tmp_path / "train-images-idx3-ubyte").write_bytes(labels)
    expected = r"train-images-idx3-ubyte: bad IDX magic number 0x00000801, expected 0x00000803"
    with pytest.raises(ValueError, match=expected):
        load_dataset("mnist", tmp_path)


def test_idx_truncated_file(tmp_path: Path) -> None:
    _write_idx_set(tmp_path, gz=True)
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes())[:-1]))
    expected = r"declares dims \(3,\) \(11 bytes in all\) but the file holds 10 bytes"
    with pytest.raises(ValueError, match=expected):
        load_dataset("mnist", tmp_path)


def test_idx_count_mismatch(tmp_path: Path) -> None:
    _write_idx_set(tmp_path, gz=False)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(np.zeros(4, dtype=np.uint8)))
    with pytest.raises(ValueError, match="5 images but .* 4 labels"):
        load_dataset("mnist", tmp_path)


def test_missing_data_error_names_data_dir_and_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("fmnist", tmp_path)
    assert isinstance(err.value, FileNotFoundError)
    msg = str(err.value)
    assert "'fmnist'" in msg and f"data-dir '{tmp_path}'" in msg
    for where in (tmp_path / "FashionMNIST" / "raw", tmp_path / "fashion-mnist"):
        assert f"{where}/{IDX_FILES}[.gz]" in msg
    assert "download=True" in msg


def test_incomplete_idx_set_is_not_found(tmp_path: Path) -> None:
    _write_idx_set(tmp_path / "MNIST" / "raw", gz=True)
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetNotFoundError, match="MNIST/raw"):
        load_dataset("mnist", tmp_path)


# --------------------------------------------------------------------------- CIFAR-10 / CIFAR-100


def test_cifar10_pickles(tmp_path: Path) -> None:
    batches = _write_cifar10_pickles(tmp_path)
    d = load_dataset("cifar10", tmp_path)
    _assert_images(d.x_train, (10, 3, 32, 32))
    _assert_images(d.x_test, (2, 3, 32, 32))
    train = [batches[f"data_batch_{i}"] for i in range(1, 6)]
    expected = _scaled(np.concatenate([b[b"data"] for b in train]).reshape(-1, 3, 32, 32))
    np.testing.assert_array_equal(d.x_train.numpy(), expected)
    _assert_labels(d.y_train, np.concatenate([b[b"labels"] for b in train]))
    _assert_labels(d.y_test, batches["test_batch"][b"labels"])
    assert d.num_classes == 10
    assert d.mean == (0.4914, 0.4822, 0.4465) and d.std == (0.2470, 0.2435, 0.2616)


@pytest.mark.parametrize(("labels", "num_classes"), [("fine", 100), ("coarse", 20)])
def test_cifar100_pickles(tmp_path: Path, labels: str, num_classes: int) -> None:
    batches = _write_cifar100_pickles(tmp_path)
    d = load_dataset("cifar100", tmp_path, cifar100_labels=labels)
    _assert_images(d.x_train, (4, 3, 32, 32))
    _assert_images(d.x_test, (2, 3, 32, 32))
    np.testing.assert_array_equal(
        d.x_test.numpy(), _scaled(batches["test"][b"data"].reshape(-1, 3, 32, 32))
    )
    key = f"{labels}_labels".encode()
    _assert_labels(d.y_train, batches["train"][key])
    _assert_labels(d.y_test, batches["test"][key])
    assert d.num_classes == num_classes
    assert d.mean == (0.5071, 0.4865, 0.4409) and d.std == (0.2673, 0.2564, 0.2762)


@pytest.mark.parametrize("sub", ["", "cifar10", "cifar-10"])
def test_cifar10_image_folder(tmp_path: Path, sub: str) -> None:
    files = _image_tree_files()
    _write_image_tree(tmp_path / "data" / sub, files)
    (tmp_path / "data" / sub / "train" / "cat" / "notes.txt").write_text("not an image")
    d = load_dataset("cifar10", tmp_path / "data")
    _assert_images(d.x_train, (20, 3, 32, 32))
    _assert_images(d.x_test, (10, 3, 32, 32))
    for split, x, y in (("train", d.x_train, d.y_train), ("test", d.x_test, d.y_test)):
        expected_x, expected_y = _expected_tree(files, split)
        np.testing.assert_array_equal(x.numpy(), expected_x)
        _assert_labels(y, expected_y)
    assert d.num_classes == 10


def test_cifar10_tar_with_leading_folder(tmp_path: Path) -> None:
    files = _image_tree_files()
    members = {f"cifar10-png/{rel}": _png(img) for rel, img in files.items()}
    members["cifar10-png/README.txt"] = b"readme"
    members["cifar10-png/train/cat/._a.png"] = b"macOS resource fork, not a PNG"
    _write_tar(tmp_path / "my-cifar10-png.tar.gz", members)
    d = load_dataset("cifar10", tmp_path)
    for split, x, y in (("train", d.x_train, d.y_train), ("test", d.x_test, d.y_test)):
        expected_x, expected_y = _expected_tree(files, split)
        np.testing.assert_array_equal(x.numpy(), expected_x)
        _assert_labels(y, expected_y)


def test_cifar10_jpeg_tree_in_plain_tar(tmp_path: Path) -> None:
    members = {}
    for rel, img in _image_tree_files().items():
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG")
        members[rel.replace(".png", ".jpg")] = buf.getvalue()
    with tarfile.open(tmp_path / "cifar-10-jpeg.tar", "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    d = load_dataset("cifar10", tmp_path)
    _assert_images(d.x_train, (20, 3, 32, 32))
    assert d.y_test.tolist() == list(range(10))


def test_decoded_images_cache_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _image_tree_files()
    _write_tar(tmp_path / "cifar-10.tgz", {rel: _png(img) for rel, img in files.items()})
    _write_image_tree(tmp_path / "tree" / "cifar10", files)
    first_tar = load_dataset("cifar10", tmp_path)
    first_tree = load_dataset("cifar10", tmp_path / "tree")
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2

    def no_decoding(data: bytes) -> np.ndarray:
        raise AssertionError("images decoded again despite the cache")

    datasets._load_cached.cache_clear()
    monkeypatch.setattr(datasets, "_decode_image", no_decoding)
    assert torch.equal(load_dataset("cifar10", tmp_path).x_train, first_tar.x_train)
    assert torch.equal(load_dataset("cifar10", tmp_path / "tree").y_test, first_tree.y_test)

    # A changed source invalidates its cache entry.
    datasets._load_cached.cache_clear()
    png = tmp_path / "tree" / "cifar10" / "test" / "dog" / "0.png"
    os.utime(png, ns=(png.stat().st_atime_ns, png.stat().st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="decoded again"):
        load_dataset("cifar10", tmp_path / "tree")


def test_unwritable_cache_only_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CONCATFL_CACHE", str(tmp_path / "a-file" / "cache"))
    _write_image_tree(tmp_path / "cifar10", _image_tree_files())
    with pytest.warns(UserWarning, match="could not write the cache file"):
        d = load_dataset("cifar10", tmp_path)
    assert d.x_train.shape == (20, 3, 32, 32)


def test_cifar10_tree_needs_ten_classes(tmp_path: Path) -> None:
    files = {k: v for k, v in _image_tree_files().items() if "/truck/" not in k}
    _write_image_tree(tmp_path, files)
    with pytest.raises(ValueError, match="expected 10 class folders"):
        load_dataset("cifar10", tmp_path)


def test_cifar10_missing_lists_every_layout(tmp_path: Path) -> None:
    _write_tar(tmp_path / "cifar-10-unrelated.tar.gz", {"x/readme.txt": b"nothing"})
    _write_tar(tmp_path / "cifar-100-python.tar.gz", {"cifar-100-python/meta": b"ignored"})
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("cifar10", tmp_path)
    msg = str(err.value)
    assert f"data-dir '{tmp_path}'" in msg
    assert f"{tmp_path}/cifar-10-batches-py/{CIFAR10_PICKLES}" in msg
    for tree in (tmp_path, tmp_path / "cifar10", tmp_path / "cifar-10"):
        assert f"{tree}/{{train,test}}/<class>/*.{{png,jpg,jpeg}}" in msg
    assert "found cifar-10-unrelated.tar.gz: no such tree" in msg
    assert "cifar-100-python" not in msg  # a CIFAR-100 archive is not a CIFAR-10 candidate


# --------------------------------------------------------------------------- SVHN


@pytest.mark.parametrize("sub", ["", "svhn"])
def test_svhn_mat(tmp_path: Path, sub: str) -> None:
    mats = _write_svhn(tmp_path / sub)
    d = load_dataset("svhn", tmp_path)
    _assert_images(d.x_train, (4, 3, 32, 32))
    _assert_images(d.x_test, (2, 3, 32, 32))
    x, _ = mats["train_32x32.mat"]
    np.testing.assert_array_equal(d.x_train.numpy(), _scaled(x.transpose(3, 2, 0, 1)))
    _assert_labels(d.y_train, [0, 1, 9, 0])
    _assert_labels(d.y_test, [3, 0])
    assert d.num_classes == 10
    assert d.mean == (0.4377, 0.4438, 0.4728) and d.std == (0.1980, 0.2010, 0.1970)


def test_svhn_missing(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("svhn", tmp_path)
    assert f"{tmp_path}/svhn/{{train_32x32.mat,test_32x32.mat}}" in str(err.value)


# --------------------------------------------------------------------------- FEMNIST


@pytest.mark.parametrize("sub", ["femnist", "femnist/data", ""])
def test_femnist_leaf(tmp_path: Path, sub: str) -> None:
    shards = _write_femnist(tmp_path / sub if sub else tmp_path)
    d = load_dataset("femnist", tmp_path)
    _assert_images(d.x_train, (5, 1, 28, 28))
    _assert_images(d.x_test, (3, 1, 28, 28))
    _assert_labels(d.y_train, [0, 61, 5, 36, 9])
    _assert_labels(d.y_test, [1, 61, 2])
    assert d.train_writers is not None and d.test_writers is not None
    assert d.train_writers.tolist() == ["f0001_41"] * 3 + ["f0002_07"] * 2
    assert d.test_writers.tolist() == ["f0001_41", "f0002_07", "f0002_07"]
    first_x = np.asarray(shards["train"][0]["user_data"]["f0001_41"]["x"], dtype=np.float32)
    np.testing.assert_array_equal(d.x_train.numpy()[:3].reshape(3, 784), first_x)
    assert d.num_classes == 62 and d.input_shape == (1, 28, 28)
    assert d.mean == pytest.approx((float(d.x_train.mean()),), rel=1e-5)
    assert d.std == pytest.approx((float(d.x_train.std(unbiased=False)),), rel=1e-5)


def test_femnist_missing_says_no_download(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("femnist", tmp_path, download=True)
    msg = str(err.value)
    assert f"{tmp_path}/femnist/{{train,test}}/*.json" in msg
    assert "no automatic download" in msg and "LEAF" in msg


# --------------------------------------------------------------------------- download


def _serve_mnist(server: Path) -> None:
    _write_idx_set(server, gz=True)


def _serve_cifar(server: Path, name: str) -> None:
    staging = server / "staging"
    writer = _write_cifar10_pickles if name == "cifar10" else _write_cifar100_pickles
    writer(staging)
    (folder,) = staging.iterdir()
    archive_name = "cifar-10-python" if name == "cifar10" else "cifar-100-python"
    archive = server / f"{archive_name}.tar.gz"
    _write_tar(archive, {f"{folder.name}/{f.name}": f.read_bytes() for f in folder.iterdir()})


@pytest.mark.parametrize(
    ("name", "expected_file"),
    [
        ("mnist", "MNIST/raw/train-images-idx3-ubyte.gz"),
        ("fmnist", "FashionMNIST/raw/t10k-labels-idx1-ubyte.gz"),
        ("cifar10", "cifar-10-batches-py/test_batch"),
        ("cifar100", "cifar-100-python/train"),
        ("svhn", "svhn/test_32x32.mat"),
    ],
)
def test_download_from_file_urls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, expected_file: str
) -> None:
    server = tmp_path / "server"
    if name in ("mnist", "fmnist"):
        _serve_mnist(server)
    elif name == "svhn":
        _write_svhn(server)
    else:
        _serve_cifar(server, name)
    monkeypatch.setitem(DOWNLOAD_URLS, name, server.as_uri())
    data_dir = tmp_path / "data"
    with pytest.raises(DatasetNotFoundError):
        load_dataset(name, data_dir)
    d = load_dataset(name, data_dir, download=True)
    assert (data_dir / expected_file).is_file()
    assert not list(data_dir.rglob("*.part")) and not list(data_dir.glob("*.tar.gz"))
    assert d.x_train.shape[0] > 0 and d.x_test.shape[0] > 0

    # Present files are not fetched again: the server is gone and loading still works.
    datasets._load_cached.cache_clear()
    monkeypatch.setitem(DOWNLOAD_URLS, name, (tmp_path / "nowhere").as_uri())
    again = load_dataset(name, data_dir, download=True)
    assert torch.equal(again.x_train, d.x_train) and torch.equal(again.y_test, d.y_test)


def test_download_fetches_only_missing_idx_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = tmp_path / "server"
    _serve_mnist(server)
    local = _write_idx_set(tmp_path / "data" / "MNIST" / "raw", gz=False, n_train=7)
    (tmp_path / "data" / "MNIST" / "raw" / "t10k-images-idx3-ubyte").unlink()
    monkeypatch.setitem(DOWNLOAD_URLS, "mnist", server.as_uri())
    d = load_dataset("mnist", tmp_path / "data", download=True)
    assert sorted(p.name for p in (tmp_path / "data" / "MNIST" / "raw").iterdir()) == [
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte",
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
    ]
    _assert_labels(d.y_train, local["train-labels-idx1-ubyte"])


def test_download_failure_names_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = (tmp_path / "empty-server").as_uri()
    monkeypatch.setitem(DOWNLOAD_URLS, "svhn", missing)
    with pytest.raises(OSError, match=f"could not download {missing}/train_32x32.mat"):
        load_dataset("svhn", tmp_path / "data", download=True)
    assert not list((tmp_path / "data").rglob("*.part"))
