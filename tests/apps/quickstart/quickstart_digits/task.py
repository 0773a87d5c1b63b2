"""The model, the data and the training loops, as in Flower's quickstart's task.py.

Data: scikit-learn's 8×8 digits as flat 64-feature vectors scaled to [0, 1], split once into a
fixed train/test set. Partition i of N holds the training samples of the two classes
{2g, 2g+1}, g = i mod 5 (shared with the other partitions of its group), so the federation is
label-skewed the way FedConcat expects.
"""

from __future__ import annotations

from functools import lru_cache

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
