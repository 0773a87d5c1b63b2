"""The model, the data and the training loop: plain PyTorch, nothing from concatfl.

Data: scikit-learn's embedded 8×8 digits (no download). Every client gets two shards of the
label-sorted training set, so most clients hold two or three digits (label skew, the setting
concatfl's strategies are built for).
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """A two-layer perceptron on the 64 pixels of a digit."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y, test_size=0.25, stratify=y, random_state=0)


def load_partition(partition_id: int, num_partitions: int, batch_size: int = 16) -> DataLoader:
    """Client `partition_id`'s training data: shards `partition_id` and `partition_id + n` of
    the label-sorted training set cut into 2n shards."""
    x_train, _, y_train, _ = _split()
    order = np.argsort(y_train, kind="stable")
    shards = np.array_split(order, 2 * num_partitions)
    mine = np.concatenate([shards[partition_id], shards[partition_id + num_partitions]])
    dataset = TensorDataset(torch.from_numpy(x_train[mine]), torch.from_numpy(y_train[mine]))
    return DataLoader(dataset, batch_size=batch_size, shuffle=True)


def load_test() -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out test set the server evaluates on."""
    _, x_test, _, y_test = _split()
    return torch.from_numpy(x_test), torch.from_numpy(y_test)


def train(net: Net, loader: DataLoader, epochs: int, lr: float) -> float:
    """SGD with momentum 0.9 for `epochs` epochs; returns the mean loss of the last epoch."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    net.train()
    total = 0.0
    for _ in range(epochs):
        total = 0.0
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(net(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(y)
    return total / len(loader.dataset)


def test(net: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(loss, accuracy) of `net` on (x, y)."""
    net.eval()
    with torch.no_grad():
        logits = net(x)
    return nn.functional.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()
