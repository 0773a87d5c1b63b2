"""Dataset loaders: the public on-disk formats of each benchmark → float tensors in memory.

Every loader returns a :class:`LoadedData` with images as ``float32`` tensors of shape
``(N, C, H, W)`` scaled to ``[0, 1]`` and labels as ``int64``. Normalization is not applied here:
the per-channel constants travel with the data and :func:`concatfl.data.transforms.normalize`
applies them, so augmentation can run on raw pixels first.

Supported formats (see :func:`load_dataset` for where each is searched):

* ``digits``   scikit-learn's embedded 8×8 digits, with a fixed stratified train/test split.
* ``mnist``, ``fmnist``  IDX files, gzipped or not.
* ``cifar10``  the python pickles, an image-folder tree ``train|test/<class>/*.png|jpg``, or such
  a tree inside a tar archive (decoded images are cached as ``.npz``).
* ``cifar100`` the python pickles, fine or coarse labels.
* ``svhn``     the cropped-digits ``.mat`` files.
* ``femnist``  LEAF json shards, with the writer of every sample.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import io
import json
import os
import pickle
import shutil
import struct
import tarfile
import tempfile
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from .cache import cache_path, computed_once, read_cache, write_cache

__all__ = [
    "DATASETS",
    "DOWNLOAD_URLS",
    "DatasetNotFoundError",
    "LoadedData",
    "load_dataset",
]

DATASETS = ("digits", "mnist", "fmnist", "cifar10", "cifar100", "svhn", "femnist")

# Base URLs of the standard public files; a module-level dict so tests (and users behind a mirror)
# can redirect them.
DOWNLOAD_URLS: dict[str, str] = {
    "mnist": "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "fmnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "cifar10": "https://www.cs.toronto.edu/~kriz/",
    "cifar100": "https://www.cs.toronto.edu/~kriz/",
    "svhn": "http://ufldl.stanford.edu/housenumbers/",
}

_MEAN_STD: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fmnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}

_IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
# (torchvision-style folder, conventional lowercase folder) under data-dir.
_IDX_FOLDERS = {"mnist": ("MNIST", "mnist"), "fmnist": ("FashionMNIST", "fashion-mnist")}
_IDX_IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dimensions
_IDX_LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dimension

_CIFAR10_PICKLE_DIR = "cifar-10-batches-py"
_CIFAR10_PICKLES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
_CIFAR100_PICKLE_DIR = "cifar-100-python"
_CIFAR_ARCHIVES = {"cifar10": "cifar-10-python.tar.gz", "cifar100": "cifar-100-python.tar.gz"}
_CIFAR10_TREE_DIRS = ("", "cifar10", "cifar-10")
_CIFAR10_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_SPLITS = ("train", "test")

_SVHN_FILES = ("train_32x32.mat", "test_32x32.mat")
_FEMNIST_DIRS = ("femnist", "femnist/data", "")
_FEMNIST_CLASSES = 62
_FEMNIST_SIDE = 28


@dataclass(frozen=True)
class LoadedData:
    """A dataset in memory.

    The tensors are shared by every caller of :func:`load_dataset` with the same arguments (the
    result is cached in-process), so callers must not modify them in place.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    train_writers: np.ndarray | None = None
    test_writers: np.ndarray | None = None

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        c, h, w = self.x_train.shape[1:]
        return int(c), int(h), int(w)


class DatasetNotFoundError(FileNotFoundError):
    """The files of a dataset are not under the data-dir.

    The message names the dataset, the data-dir, every file or layout searched, and how to get it.
    """


def load_dataset(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    cifar100_labels: str = "fine",
    download: bool = False,
) -> LoadedData:
    """Load dataset ``name`` (one of :data:`DATASETS`) from ``data_dir``.

    ``data_dir`` defaults to ``./data`` (ignored for ``digits``). Where each dataset is searched:

    * ``mnist``/``fmnist``: the four IDX files (``.gz`` or plain) in ``MNIST/raw/``
      (``FashionMNIST/raw/``), then ``mnist/`` (``fashion-mnist/``), then ``data_dir`` itself.
    * ``cifar10``: ``cifar-10-batches-py/``; else ``train/<class>/`` + ``test/<class>/`` image
      trees in ``data_dir``, ``cifar10/`` or ``cifar-10/``; else a ``*.tar``/``*.tar.gz``/``*.tgz``
      in ``data_dir`` whose name contains ``cifar10`` or ``cifar-10`` holding such a tree.
    * ``cifar100``: ``cifar-100-python/{train,test}``; ``cifar100_labels`` is ``"fine"`` (100
      classes) or ``"coarse"`` (20 classes).
    * ``svhn``: ``train_32x32.mat`` and ``test_32x32.mat`` in ``data_dir`` or ``svhn/``.
    * ``femnist``: LEAF json shards in ``femnist/{train,test}/``, ``femnist/data/{train,test}/``
      or ``{train,test}/``.

    With ``download=True``, missing mnist/fmnist/cifar10/cifar100/svhn files are fetched from
    :data:`DOWNLOAD_URLS` into ``data_dir`` first. Results are cached per process.

    Raises:
        ValueError: unknown ``name`` or ``cifar100_labels``, or a malformed file.
        DatasetNotFoundError: the files are not there (and were not downloaded).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    if cifar100_labels not in ("fine", "coarse"):
        raise ValueError(f"cifar100-labels must be 'fine' or 'coarse', got {cifar100_labels!r}")
    if name == "digits":
        root = None
    else:
        root = Path(data_dir or "data").expanduser().resolve()
    return _load_cached(name, root, cifar100_labels if name == "cifar100" else "fine", download)


@functools.lru_cache(maxsize=8)
def _load_cached(name: str, root: Path | None, cifar100_labels: str, download: bool) -> LoadedData:
    if root is None:
        return _load_digits()
    loaders: dict[str, Callable[[Path], LoadedData]] = {
        "mnist": functools.partial(_load_idx_dataset, "mnist"),
        "fmnist": functools.partial(_load_idx_dataset, "fmnist"),
        "cifar10": _load_cifar10,
        "cifar100": functools.partial(_load_cifar100, labels=cifar100_labels),
        "svhn": _load_svhn,
        "femnist": _load_femnist,
    }
    try:
        return loaders[name](root)
    except DatasetNotFoundError:
        if not download or name not in DOWNLOAD_URLS:
            raise
    _download(name, root)
    return loaders[name](root)


def _not_found(name: str, root: Path, searched: Iterable[str], how: str) -> DatasetNotFoundError:
    looked = "\n".join(f"  - {s}" for s in searched)
    return DatasetNotFoundError(
        f"dataset {name!r} not found under data-dir '{root}'. Looked for:\n{looked}\n{how}"
    )


def _download_hint(name: str) -> str:
    return (
        f"Set download=True (run-config `download = true`) on a machine that is online to fetch "
        f"it from {DOWNLOAD_URLS[name]}, or place the files in one of the locations above."
    )


def _as_tensors(
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 (N, C, H, W) images and integer labels → float32 in [0, 1] and int64 tensors."""

    # Converting in numpy copies out of read-only buffers (np.frombuffer, npz) before torch.
    def images(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).div_(255.0)

    def labels(y: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(y, dtype=np.int64).reshape(-1))

    return images(x_train), labels(y_train), images(x_test), labels(y_test)


def _check_labels(name: str, y: np.ndarray, num_classes: int, source: object) -> None:
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(
            f"{name}: labels in {source} span [{y.min()}, {y.max()}], expected [0, {num_classes})"
        )


# --------------------------------------------------------------------------- digits


def _load_digits() -> LoadedData:
    """scikit-learn's 8×8 digits with a fixed stratified 80/20 split, computed once per machine
    (`concatfl.data.cache`): a process that finds the split there does not import scikit-learn."""
    split = computed_once(cache_path("digits", f"digits\0{_digits_file_signature()}\0split 0.2 stratified 0"), _split_digits)
    x_tr, y_tr = split["x_train"], split["y_train"]
    return LoadedData(
        x_train=torch.from_numpy(x_tr),
        y_train=torch.from_numpy(y_tr),
        x_test=torch.from_numpy(split["x_test"]),
        y_test=torch.from_numpy(split["y_test"]),
        num_classes=10,
        mean=(float(x_tr.mean()),),
        std=(float(x_tr.std()),),
    )


def _digits_file_signature() -> str:
    """Where scikit-learn keeps the digits (found without importing it), with its size and time."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            st = path.stat()
            return f"{path}\0{st.st_size}\0{st.st_mtime_ns}"
    return "scikit-learn's digits file not found"  # computing the split will say why


def _split_digits() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
    from sklearn.model_selection import train_test_split  # pylint: disable=import-outside-toplevel

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    # Fixed split: the test set must not move with the run seed, so results stay comparable.
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    return {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te}


# --------------------------------------------------------------------------- MNIST / FMNIST


def _read_idx(path: Path, magic: int) -> np.ndarray:
    """Parse an unsigned-byte IDX file (gzipped if its name ends in ``.gz``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except gzip.BadGzipFile as e:
        raise ValueError(f"{path}: not a valid gzip file ({e})") from e
    if len(raw) < 4:
        raise ValueError(f"{path}: too short to be an IDX file ({len(raw)} bytes)")
    (found,) = struct.unpack(">I", raw[:4])
    if found != magic:
        raise ValueError(
            f"{path}: bad IDX magic number 0x{found:08x}, expected 0x{magic:08x} "
            f"(unsigned byte, {magic & 0xFF} dimension(s)); is this the right file?"
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes)")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + int(np.prod(dims))
    if len(raw) != expected:
        raise ValueError(
            f"{path}: IDX header declares dims {dims} ({expected} bytes in all) "
            f"but the file holds {len(raw)} bytes"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find_idx_files(name: str, root: Path) -> tuple[list[Path] | None, list[str]]:
    """The four IDX files of the first folder that has all of them, and what was searched."""
    torchvision_dir, plain_dir = _IDX_FOLDERS[name]
    searched = []
    for folder in (root / torchvision_dir / "raw", root / plain_dir, root):
        found = []
        for base in _IDX_FILES:
            # A plain file is preferred: no decompression.
            candidates = [folder / base, folder / f"{base}.gz"]
            hit = next((c for c in candidates if c.is_file()), None)
            if hit is not None:
                found.append(hit)
        searched.append(f"{folder}/{{{','.join(_IDX_FILES)}}}[.gz]")
        if len(found) == len(_IDX_FILES):
            return found, searched
    return None, searched


def _load_idx_dataset(name: str, root: Path) -> LoadedData:
    files, searched = _find_idx_files(name, root)
    if files is None:
        raise _not_found(name, root, searched, _download_hint(name))
    tr_x, tr_y, te_x, te_y = files
    x_train = _read_idx(tr_x, _IDX_IMAGES_MAGIC)
    y_train = _read_idx(tr_y, _IDX_LABELS_MAGIC)
    x_test = _read_idx(te_x, _IDX_IMAGES_MAGIC)
    y_test = _read_idx(te_y, _IDX_LABELS_MAGIC)
    for xs, ys, xp, yp in ((x_train, y_train, tr_x, tr_y), (x_test, y_test, te_x, te_y)):
        if len(xs) != len(ys):
            raise ValueError(f"{name}: {xp} holds {len(xs)} images but {yp} {len(ys)} labels")
        _check_labels(name, ys, 10, yp)
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"{name}: train images are {x_train.shape[1:]}, test {x_test.shape[1:]}")
    tensors = _as_tensors(x_train[:, None], y_train, x_test[:, None], y_test)
    mean, std = _MEAN_STD[name]
    return LoadedData(*tensors, num_classes=10, mean=mean, std=std)


# --------------------------------------------------------------------------- CIFAR pickles


def _unpickle(path: Path) -> dict[bytes, object]:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def _pickle_images(batch: dict[bytes, object], path: Path) -> np.ndarray:
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path}: b'data' has shape {data.shape}, expected (N, 3072)")
    return data.reshape(-1, 3, 32, 32)


def _load_cifar10_pickles(folder: Path) -> LoadedData:
    parts: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {s: ([], []) for s in _SPLITS}
    for file in _CIFAR10_PICKLES:
        path = folder / file
        batch = _unpickle(path)
        xs, ys = parts["test" if file == "test_batch" else "train"]
        xs.append(_pickle_images(batch, path))
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
        _check_labels("cifar10", labels, 10, path)
        ys.append(labels)
    tensors = _as_tensors(
        np.concatenate(parts["train"][0]),
        np.concatenate(parts["train"][1]),
        np.concatenate(parts["test"][0]),
        np.concatenate(parts["test"][1]),
    )
    mean, std = _MEAN_STD["cifar10"]
    return LoadedData(*tensors, num_classes=10, mean=mean, std=std)


def _load_cifar100(root: Path, labels: str) -> LoadedData:
    folder = root / _CIFAR100_PICKLE_DIR
    if not all((folder / s).is_file() for s in _SPLITS):
        raise _not_found("cifar100", root, [f"{folder}/{{train,test}}"], _download_hint("cifar100"))
    key, num_classes = (b"fine_labels", 100) if labels == "fine" else (b"coarse_labels", 20)
    arrays = []
    for split in _SPLITS:
        path = folder / split
        batch = _unpickle(path)
        y = np.asarray(batch[key], dtype=np.int64)
        _check_labels("cifar100", y, num_classes, path)
        arrays += [_pickle_images(batch, path), y]
    mean, std = _MEAN_STD["cifar100"]
    return LoadedData(*_as_tensors(*arrays), num_classes=num_classes, mean=mean, std=std)


# --------------------------------------------------------------------------- CIFAR image trees


def _decode_image(data: bytes) -> np.ndarray:
    """Encoded PNG/JPEG bytes → ``(H, W, 3)`` uint8 RGB."""
    from PIL import Image  # pylint: disable=import-outside-toplevel  # only image trees need it

    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"), dtype=np.uint8)


def _is_image_name(name: str) -> bool:
    # Skips hidden files such as macOS "._x.jpg" resource forks that archives often carry.
    return not name.startswith(".") and name.lower().endswith(_IMAGE_SUFFIXES)


def _assemble_tree(
    entries: Iterable[tuple[str, str, str, np.ndarray]], source: object
) -> dict[str, np.ndarray]:
    """(split, class, file name, image) → arrays ordered by (class, file name) per split."""
    by_split: dict[str, list[tuple[str, str, np.ndarray]]] = {s: [] for s in _SPLITS}
    for split, cls, fname, img in entries:
        by_split[split].append((cls, fname, img))
    classes = sorted({cls for cls, _, _ in by_split["train"]})
    unknown = sorted({cls for cls, _, _ in by_split["test"]} - set(classes))
    if unknown:
        raise ValueError(f"{source}: test classes {unknown} have no train folder")
    if len(classes) != 10 or not by_split["test"]:
        raise ValueError(
            f"{source}: expected 10 class folders under train/ and a non-empty test/, "
            f"found train classes {classes} and {len(by_split['test'])} test images"
        )
    index = {cls: i for i, cls in enumerate(classes)}
    arrays: dict[str, np.ndarray] = {}
    for split in _SPLITS:
        items = sorted(by_split[split], key=lambda e: (e[0], e[1]))
        shapes = {img.shape for _, _, img in items}
        if len(shapes) != 1:
            raise ValueError(f"{source}: images of different sizes in {split}/: {sorted(shapes)}")
        arrays[f"x_{split}"] = np.stack([img for _, _, img in items]).transpose(0, 3, 1, 2)
        arrays[f"y_{split}"] = np.asarray([index[cls] for cls, _, _ in items], dtype=np.int64)
    return arrays


def _tree_files(root: Path) -> list[tuple[str, str, Path]]:
    """(split, class, path) of every image in ``root/{train,test}/<class>/``."""
    files = []
    for split in _SPLITS:
        for cls_dir in sorted(p for p in (root / split).iterdir() if p.is_dir()):
            files += [
                (split, cls_dir.name, f)
                for f in sorted(cls_dir.iterdir())
                if f.is_file() and _is_image_name(f.name)
            ]
    return files


def _load_folder_tree(root: Path) -> dict[str, np.ndarray]:
    files = _tree_files(root)
    lines = [f"tree:{root}"]
    for _, _, path in files:
        st = path.stat()
        lines.append(f"{path.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}")
    signature = "\n".join(lines)
    return computed_once(
        cache_path("cifar10-tree", signature),
        lambda: _assemble_tree(((split, cls, p.name, _decode_image(p.read_bytes())) for split, cls, p in files), root),
    )


def _tar_images(archive: Path) -> Iterator[tuple[str, str, str, np.ndarray]]:
    # Stream mode: one sequential pass, no random access into a compressed archive.
    with tarfile.open(archive, "r|*") as tf:
        for member in tf:
            parts = PurePosixPath(member.name).parts
            if not member.isfile() or len(parts) < 3 or parts[-3] not in _SPLITS:
                continue
            if not _is_image_name(parts[-1]):
                continue
            f = tf.extractfile(member)
            assert f is not None  # a regular file always has a reader
            yield parts[-3], parts[-2], parts[-1], _decode_image(f.read())


def _load_tar_tree(archive: Path) -> dict[str, np.ndarray] | None:
    """Arrays of the image tree inside ``archive``, or None if it holds no such tree."""
    st = archive.stat()
    cache = cache_path("cifar10-tar", f"tar:{archive}\0{st.st_size}\0{st.st_mtime_ns}")
    if (cached := read_cache(cache)) is not None:
        return cached
    entries = list(_tar_images(archive))
    if not entries:
        return None
    arrays = _assemble_tree(entries, archive)
    write_cache(cache, arrays)
    return arrays


def _cifar10_archives(root: Path) -> list[Path]:
    def matches(name: str) -> bool:
        # "cifar-10" is a prefix of "cifar-100": CIFAR-100 archives must not be taken for CIFAR-10.
        return (
            ("cifar10" in name or "cifar-10" in name)
            and "cifar100" not in name
            and "cifar-100" not in name
            and name.endswith(_CIFAR10_ARCHIVE_SUFFIXES)
        )

    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_file() and matches(p.name.lower()))


def _find_cifar10_tree(root: Path, searched: list[str]) -> dict[str, np.ndarray] | None:
    """Arrays of the first CIFAR-10 image tree (folder, then archive); appends what it searched."""
    for sub in _CIFAR10_TREE_DIRS:
        tree = root / sub if sub else root
        searched.append(f"{tree}/{{train,test}}/<class>/*.{{png,jpg,jpeg}}")
        if all((tree / s).is_dir() for s in _SPLITS):
            return _load_folder_tree(tree)
    archives = _cifar10_archives(root)
    searched.append(
        f"{root}/*cifar10*.{{tar,tar.gz,tgz}} or *cifar-10*.{{tar,tar.gz,tgz}} holding "
        "[<folder>/]{train,test}/<class>/ images"
        + (f" (found {', '.join(p.name for p in archives)}: no such tree)" if archives else "")
    )
    for archive in archives:
        arrays = _load_tar_tree(archive)
        if arrays is not None:
            return arrays
    return None


def _load_cifar10(root: Path) -> LoadedData:
    pickle_dir = root / _CIFAR10_PICKLE_DIR
    if all((pickle_dir / f).is_file() for f in _CIFAR10_PICKLES):
        return _load_cifar10_pickles(pickle_dir)
    searched = [f"{pickle_dir}/{{{','.join(_CIFAR10_PICKLES)}}}"]
    arrays = _find_cifar10_tree(root, searched)
    if arrays is None:
        raise _not_found("cifar10", root, searched, _download_hint("cifar10"))
    tensors = _as_tensors(arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"])
    mean, std = _MEAN_STD["cifar10"]
    return LoadedData(*tensors, num_classes=10, mean=mean, std=std)


# --------------------------------------------------------------------------- SVHN


def _load_svhn(root: Path) -> LoadedData:
    folders = (root, root / "svhn")
    folder = next((d for d in folders if all((d / f).is_file() for f in _SVHN_FILES)), None)
    if folder is None:
        searched = [f"{d}/{{{','.join(_SVHN_FILES)}}}" for d in folders]
        raise _not_found("svhn", root, searched, _download_hint("svhn"))
    import scipy.io  # pylint: disable=import-outside-toplevel  # only SVHN needs it

    arrays = []
    for file in _SVHN_FILES:
        path = folder / file
        mat = scipy.io.loadmat(path)
        x, y = np.asarray(mat["X"]), np.asarray(mat["y"]).reshape(-1).astype(np.int64)
        if x.ndim != 4 or x.shape[2] != 3 or x.shape[3] != len(y):
            raise ValueError(
                f"{path}: X has shape {x.shape} and y {len(y)} labels; expected X (H, W, 3, N)"
            )
        # SVHN stores digit 0 as label 10.
        y[y == 10] = 0
        _check_labels("svhn", y, 10, path)
        arrays += [x.astype(np.uint8).transpose(3, 2, 0, 1), y]
    mean, std = _MEAN_STD["svhn"]
    return LoadedData(*_as_tensors(*arrays), num_classes=10, mean=mean, std=std)


# --------------------------------------------------------------------------- FEMNIST


def _read_leaf_split(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Images (N, 784) float32, labels, and writer ids of every shard in ``folder``."""
    xs, ys, writers = [], [], []
    for shard in sorted(folder.glob("*.json")):
        with open(shard, encoding="utf-8") as f:
            content = json.load(f)
        for uid in content["users"]:
            record = content["user_data"][uid]
            x = np.asarray(record["x"], dtype=np.float32)
            y = np.asarray(record["y"], dtype=np.int64)
            if x.ndim != 2 or x.shape[1] != _FEMNIST_SIDE**2 or len(x) != len(y):
                raise ValueError(
                    f"{shard}: user {uid!r} has x of shape {x.shape} and {len(y)} labels; "
                    f"expected (n, {_FEMNIST_SIDE**2}) and n labels"
                )
            _check_labels("femnist", y, _FEMNIST_CLASSES, shard)
            xs.append(x)
            ys.append(y)
            writers += [str(uid)] * len(y)
    if not xs:
        raise ValueError(f"{folder}: the json shards hold no samples")
    return np.concatenate(xs), np.concatenate(ys), np.asarray(writers, dtype=np.str_)


def _load_femnist(root: Path) -> LoadedData:
    folders = [root / sub if sub else root for sub in _FEMNIST_DIRS]
    folder = next(
        (d for d in folders if all(any((d / s).glob("*.json")) for s in _SPLITS)), None
    )
    if folder is None:
        raise _not_found(
            "femnist",
            root,
            [f"{d}/{{train,test}}/*.json" for d in folders],
            "FEMNIST has no automatic download (download=True does not apply): LEAF's "
            "preprocessing pipeline builds the json shards (https://github.com/TalwalkarLab/leaf, "
            "data/femnist/preprocess.sh); put its data/train and data/test folders in "
            f"'{root / 'femnist'}'.",
        )
    x_tr, y_tr, w_tr = _read_leaf_split(folder / "train")
    x_te, y_te, w_te = _read_leaf_split(folder / "test")
    for split, x in (("train", x_tr), ("test", x_te)):
        if x.min() < 0.0 or x.max() > 1.0:
            raise ValueError(f"{folder / split}: pixel values outside [0, 1]")
    shape = (-1, 1, _FEMNIST_SIDE, _FEMNIST_SIDE)
    return LoadedData(
        x_train=torch.from_numpy(x_tr.reshape(shape)),
        y_train=torch.from_numpy(y_tr),
        x_test=torch.from_numpy(x_te.reshape(shape)),
        y_test=torch.from_numpy(y_te),
        num_classes=_FEMNIST_CLASSES,
        mean=(float(x_tr.mean()),),
        std=(float(x_tr.std()),),
        train_writers=w_tr,
        test_writers=w_te,
    )


# --------------------------------------------------------------------------- download


def _fetch(url: str, dest: Path) -> None:
    """Download ``url`` to ``dest`` via a temporary file, so a partial download never looks real."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=dest.parent, suffix=".part", delete=False) as tmp:
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                shutil.copyfileobj(response, tmp)
        except OSError as e:
            tmp.close()
            os.unlink(tmp.name)
            raise OSError(f"could not download {url}: {e}") from e
    os.replace(tmp.name, dest)


def _extract(archive: Path, dest: Path) -> None:
    """Extract the regular files of ``archive`` into ``dest``, refusing paths that leave it.

    Extraction goes to a temporary folder first and its top-level entries are then renamed into
    place, so concurrent loaders never see a half-extracted folder.
    """
    with tempfile.TemporaryDirectory(dir=dest) as staging_name:
        staging = Path(staging_name).resolve()
        with tarfile.open(archive) as tf:
            for member in tf:
                if not member.isfile():
                    continue
                target = (staging / member.name).resolve()
                if not target.is_relative_to(staging):
                    raise ValueError(f"{archive}: member {member.name!r} escapes the archive root")
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tf.extractfile(member)
                assert src is not None  # a regular file always has a reader
                with src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
        for entry in staging.iterdir():
            if not (dest / entry.name).exists():
                os.replace(entry, dest / entry.name)


def _download(name: str, root: Path) -> None:
    """Fetch the standard files of ``name`` into ``root`` in the layout its loader reads."""
    base = DOWNLOAD_URLS[name].rstrip("/") + "/"
    root.mkdir(parents=True, exist_ok=True)
    if name in _IDX_FOLDERS:
        folder = root / _IDX_FOLDERS[name][0] / "raw"
        for file in _IDX_FILES:
            if not (folder / file).is_file() and not (folder / f"{file}.gz").is_file():
                _fetch(f"{base}{file}.gz", folder / f"{file}.gz")
    elif name in _CIFAR_ARCHIVES:
        archive = root / _CIFAR_ARCHIVES[name]
        if not archive.is_file():
            _fetch(f"{base}{archive.name}", archive)
        _extract(archive, root)
        archive.unlink()
    else:
        for file in _SVHN_FILES:
            if not (root / "svhn" / file).is_file():
                _fetch(f"{base}{file}", root / "svhn" / file)
