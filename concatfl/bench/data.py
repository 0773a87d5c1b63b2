"""Real data for the benchmark suites: checking it is there, subsampling it, saying what it is.

A `small`-scale suite trains on a stratified subsample of the real dataset. The harness writes
that subsample once, in the dataset's own on-disk format (IDX files for MNIST/Fashion-MNIST, the
python pickles for CIFAR-10), and points the runs' `data-dir` at it, so concatfl's ClientApp and
ServerApp read it like any other copy. A `NOTE_FILE` next to it says where it came from; the
table's header repeats it.
"""

from __future__ import annotations

import os
import pickle
import shutil
import struct
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.model_selection import train_test_split

from .. import PROJECT_DIR
from ..data.datasets import LoadedData, load_dataset

NOTE_FILE = "SOURCE.txt"
SUBSAMPLE_SEED = 0  # one subsample for every run seed: only the partition moves with the seed
LABELS = {"digits": "digits", "mnist": "MNIST", "fmnist": "Fashion-MNIST", "cifar10": "CIFAR-10"}
_IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_CIFAR_TREE_DIRS = ("", "cifar10", "cifar-10")


@dataclass(frozen=True)
class Subsample:
    """How many train and test images a scaled-down suite keeps of each dataset."""

    train: int
    test: int


def shown_path(path: str | Path) -> str:
    """`path` as a report shows it: relative to the repository when it lies in the repository's
    folder or beside it (`results/overhead/…`, `../shared/data`), so no report names the
    measuring machine's folders; a system path (`/usr/share/datasets/…`) as it is."""
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(PROJECT_DIR.parent):
        return str(resolved)
    return os.path.relpath(resolved, PROJECT_DIR)


def describe(dataset: str, data_dir: str | Path) -> str | None:
    """One line on where a run's data came from (None for the embedded digits).

    A subsample written by `write_subsample` carries its own note; otherwise the source is
    described from what lies in `data_dir`. CIFAR-10 that is not the original python pickles is
    called out as a lossy JPEG copy when its images are JPEGs (as the offline copy here is).
    """
    if dataset == "digits":
        return None
    root = Path(data_dir)
    shown = shown_path(root)
    if (root / NOTE_FILE).is_file():
        return (root / NOTE_FILE).read_text().strip()
    label = LABELS.get(dataset, dataset)
    if dataset != "cifar10":
        return f"{label}: files under {shown}"
    if (root / "cifar-10-batches-py").is_dir():
        return f"{label}: the original python pickles under {shown}"
    if _holds_jpeg(root):
        return (
            f"{label}: a LOSSY JPEG copy under {shown}, not the original pixels (the offline copy "
            "cifar10-jpeg-q75.tar.gz is JPEG quality 75: channel std 0.245/0.243/0.261 instead of "
            "0.247/0.244/0.262, original sample order lost); accuracies are not strictly comparable "
            "with results on the original CIFAR-10"
        )
    return f"{label}: an image tree or archive under {shown}"


def ensure_available(dataset: str, data_dir: Path) -> LoadedData:
    """Load the dataset once here, so a missing file fails before any simulation starts.

    The loader's errors name every path it searched. Loading also fills concatfl's decoded-image
    cache, which spares the simulated clients from each decoding a JPEG archive themselves.
    """
    return load_dataset(dataset, data_dir)


def write_subsample(dataset: str, source: Path, subsample: Subsample, cache: Path) -> Path:
    """A stratified subsample of `dataset` in its own file format under `cache`; returns its folder.

    Written once (to a temporary folder renamed into place) and reused by later runs.
    """
    target = cache / f"{dataset}-train{subsample.train}-test{subsample.test}-seed{SUBSAMPLE_SEED}"
    if target.is_dir():
        return target
    data = ensure_available(dataset, source)
    train = _stratified(data.y_train, subsample.train)
    test = _stratified(data.y_test, subsample.test)
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=f".{target.name}-"))
    try:
        images = [_to_uint8(data.x_train[train]), _to_uint8(data.x_test[test])]
        labels = [data.y_train[train].numpy(), data.y_test[test].numpy()]
        if dataset == "cifar10":
            _write_cifar10_pickles(staging / "cifar-10-batches-py", images, labels)
        else:
            _write_idx(staging, images, labels)
        (staging / NOTE_FILE).write_text(
            f"{describe(dataset, source)}; here a stratified subsample (seed {SUBSAMPLE_SEED}) of "
            f"{subsample.train:,} of its {len(data.y_train):,} train and {subsample.test:,} of its "
            f"{len(data.y_test):,} test images, written to {target}\n"
        )
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _stratified(labels: torch.Tensor, size: int) -> np.ndarray:
    """`size` indices with the class proportions of `labels`, in their original order."""
    indices = np.arange(len(labels))
    if size >= len(labels):
        return indices
    chosen, _ = train_test_split(indices, train_size=size, stratify=labels.numpy(), random_state=SUBSAMPLE_SEED)
    return np.sort(chosen)


def _to_uint8(images: torch.Tensor) -> np.ndarray:
    """The loader's float images in [0, 1] back to the uint8 pixels they were read from."""
    return images.mul(255).round_().to(torch.uint8).numpy()


def _write_idx(folder: Path, images: list[np.ndarray], labels: list[np.ndarray]) -> None:
    """train/t10k IDX files (unsigned byte; images N×H×W, labels N) directly in `folder`."""
    arrays = [images[0][:, 0], labels[0], images[1][:, 0], labels[1]]
    for name, array in zip(_IDX_NAMES, arrays):
        array = np.ascontiguousarray(array, dtype=np.uint8)
        header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
        (folder / name).write_bytes(header + array.tobytes())


def _write_cifar10_pickles(folder: Path, images: list[np.ndarray], labels: list[np.ndarray]) -> None:
    """data_batch_1..5 and test_batch in the layout of the original cifar-10-batches-py."""
    folder.mkdir()
    batches = zip(np.array_split(images[0], 5), np.array_split(labels[0], 5))
    named = [(f"data_batch_{i}", batch) for i, batch in enumerate(batches, start=1)]
    for name, (x, y) in named + [("test_batch", (images[1], labels[1]))]:
        with open(folder / name, "wb") as handle:
            pickle.dump({b"data": x.reshape(len(x), -1), b"labels": y.tolist()}, handle)


def _holds_jpeg(root: Path) -> bool:
    """Whether the CIFAR-10 image tree or archive under `root` holds JPEG files."""
    for folder in (root / sub for sub in _CIFAR_TREE_DIRS):
        first = next((path for path in folder.glob("train/*/*") if path.is_file()), None)
        if first is not None:
            return first.suffix.lower() in (".jpg", ".jpeg")
    for archive in sorted(root.glob("*.t*")):
        name = archive.name.lower()
        if ("cifar10" in name or "cifar-10" in name) and name.endswith((".tar", ".tar.gz", ".tgz")):
            with tarfile.open(archive) as tar:
                for member in tar:
                    name = Path(member.name).name.lower()
                    if member.isfile() and not name.startswith(".") and name.endswith((".png", ".jpg", ".jpeg")):
                        return name.endswith((".jpg", ".jpeg"))
    return False
