"""The model, the data and the training loops, as in Flower's quickstart's task.py.

Data: scikit-learn's 8×8 digits as flat 64-feature vectors scaled to [0, 1], split once into a
fixed train/test set. Partition i of N holds the training samples of the two classes
{2g, 2g+1}, g = i mod 5 (shared with the other partitions of its group), so the federation is
label-skewed the way FedConcat expects.

Images (run config `dataset` "cifar10" from `data-dir`/cifar-10-batches-py, the original
python pickles, or "fmnist" from the four IDX files in `data-dir`): Flower's quickstart-pytorch
CNN (`ImageNet`) on images scaled to [-1, 1], partitioned by flwr-datasets: `partition` "classes"
(`PathologicalPartitioner`, `classes-per-client` each) or "dirichlet" (`DirichletPartitioner`,
`alpha`).
"""

from __future__ import annotations

import functools
import gzip
import pickle
import struct
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

NUM_FEATURES = 64
NUM_CLASSES = 10
GROUPS = 5


class Net(nn.Module):
    """A small fully-connected network; its last layer `fc3` is the head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(NUM_FEATURES, 64)
        self.fc2 = nn.Linear(64, 32)
        self.fc3 = nn.Linear(32, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class ImageNet(nn.Module):
    """Flower's quickstart-pytorch CNN (conv 6, conv 16, fc 120, fc 84, fc 10), for C×H×W images."""

    def __init__(self, channels: int = 3, side: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        flat = 16 * (((side - 4) // 2 - 4) // 2) ** 2
        self.fc1 = nn.Linear(flat, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file of unsigned bytes (MNIST's format), gzipped or not."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    dims = data[3]
    shape = struct.unpack(f">{dims}I", data[4 : 4 + 4 * dims])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def _raw_images(dataset: str, data_dir: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test) as stored: uint8 images N×C×H×W and their labels."""
    root = Path(data_dir)
    if dataset == "cifar10":
        batches = []
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            with open(root / "cifar-10-batches-py" / name, "rb") as handle:
                batch = pickle.load(handle, encoding="bytes")
            batches.append((np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32), np.asarray(batch[b"labels"])))
        return (np.concatenate([x for x, _ in batches[:5]]), np.concatenate([y for _, y in batches[:5]]), *batches[5])
    found = [next(root.glob(name + "*")) for name in IDX_FILES]
    x_train, y_train, x_test, y_test = (_read_idx(path) for path in found)
    return x_train[:, None], y_train, x_test[:, None], y_test


@lru_cache(maxsize=1)
def _images(dataset: str, data_dir: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The train and test splits, images scaled to [-1, 1] (as quickstart-pytorch's Normalize(0.5, 0.5))."""
    x_train, y_train, x_test, y_test = _raw_images(dataset, data_dir)
    scaled = [torch.from_numpy(x.astype(np.float32)).div_(127.5).sub_(1.0) for x in (x_train, x_test)]
    return scaled[0], torch.from_numpy(y_train.astype(np.int64)), scaled[1], torch.from_numpy(y_test.astype(np.int64))


@lru_cache(maxsize=4)
def _image_partitions(
    dataset: str, data_dir: str, num_partitions: int, partition: str, amount: float, seed: int
) -> list[np.ndarray]:
    """Each partition's training indices, by flwr-datasets' partitioners over the labels."""
    # pylint: disable=import-outside-toplevel
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, PathologicalPartitioner

    labels = _images(dataset, data_dir)[1].numpy()
    if partition == "dirichlet":
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions, partition_by="label", alpha=amount,
            min_partition_size=min(10, len(labels) // (2 * num_partitions)), self_balancing=True, seed=seed,
        )
    else:
        partitioner = PathologicalPartitioner(
            num_partitions=num_partitions, partition_by="label", num_classes_per_partition=int(amount),
            class_assignment_mode="first-deterministic", seed=seed,
        )
    partitioner.dataset = Dataset.from_dict({"label": labels, "index": np.arange(len(labels))})
    return [np.asarray(partitioner.load_partition(i)["index"]) for i in range(num_partitions)]


def load_image_data(config, partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of partition `partition_id` of the run config's image data."""
    source = (str(config["dataset"]), str(config["data-dir"]))
    partition = str(config["partition"])
    amount = float(config["alpha"]) if partition == "dirichlet" else float(config["classes-per-client"])
    parts = _image_partitions(*source, num_partitions, partition, amount, int(config["partition-seed"]))
    indices = torch.from_numpy(parts[partition_id])
    x_train, y_train, _, _ = _images(*source)
    return x_train[indices], y_train[indices]


def load_image_test_data(config) -> tuple[torch.Tensor, torch.Tensor]:
    """The central test set of the run config's image data."""
    _, _, x_test, y_test = _images(str(config["dataset"]), str(config["data-dir"]))
    return x_test, y_test


def model_of(config) -> tuple[type[nn.Module] | functools.partial, tuple[int, ...]]:
    """The run's model factory and one input's shape: `Net` on digits, `ImageNet` on images."""
    if config["dataset"] == "digits":
        return Net, (NUM_FEATURES,)
    x_test = load_image_test_data(config)[0]
    channels, side = int(x_test.shape[1]), int(x_test.shape[2])
    return functools.partial(ImageNet, channels, side), (channels, side, side)


@lru_cache(maxsize=1)
def _split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, stratify=digits.target, random_state=0
    )
    return (
        torch.from_numpy(x_train),
        torch.from_numpy(y_train).long(),
        torch.from_numpy(x_test),
        torch.from_numpy(y_test).long(),
    )


def load_data(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of partition `partition_id`: its group's two classes, shared with the group."""
    x_train, y_train, _, _ = _split()
    group = partition_id % GROUPS
    members = list(range(group, num_partitions, GROUPS))
    indices = torch.nonzero((y_train == 2 * group) | (y_train == 2 * group + 1)).flatten()
    mine = indices[members.index(partition_id) :: len(members)]
    return x_train[mine], y_train[mine]


def load_test_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The central test set (all ten classes)."""
    _, _, x_test, y_test = _split()
    return x_test, y_test


# pylint: disable=too-many-arguments
def train(
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    lr: float,
    seed: int,
    momentum: float = 0.0,
    batch_size: int = 32,
    optimizer_name: str = "sgd",
) -> float:
    """Mini-batch SGD (or Adam); returns the mean loss of the last epoch."""
    generator = torch.Generator().manual_seed(seed)
    if optimizer_name == "adam":
        optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    else:
        optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    net.train()
    losses = []
    for _ in range(epochs):
        losses = []
        for batch in torch.randperm(len(y), generator=generator).split(batch_size):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    return sum(losses) / len(losses)


def test(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(loss, accuracy) of `net` on (x, y)."""
    net.eval()
    with torch.no_grad():
        logits = net(x)
    return float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(dim=1) == y).float().mean())
