"""Local training and evaluation loops (plain PyTorch), and the device choice.

Inputs are kept in [0, 1]; each batch is augmented (if the dataset has an augmentation) and
normalized on the fly, so the same tensors serve training, evaluation and FedConcat-ID's
random-input probing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .config import OPTIMIZERS
from .core.sgd import SGD
from .data.transforms import normalize

Regularizer = Callable[[nn.Module], torch.Tensor]
# (model, inputs, targets) -> the batch loss; cross-entropy of model(inputs) when none is given.
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
Augmentation = Callable[[torch.Tensor, torch.Generator | None], torch.Tensor]


@dataclass(frozen=True)
class Normalization:
    """Per-channel mean and std applied to every batch."""

    mean: Sequence[float]
    std: Sequence[float]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(x, self.mean, self.std)


def pick_device(name: str) -> torch.device:
    """`auto` → CUDA when available, else CPU; `cuda` fails clearly when there is no GPU."""
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was requested but no CUDA GPU is available")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def proximal_regularizer(reference: nn.Module, mu: float) -> Regularizer:
    """FedProx's μ/2·‖θ − θ_ref‖² toward a frozen copy of the received model."""
    anchors = [p.detach().clone() for p in reference.parameters()]

    def term(model: nn.Module) -> torch.Tensor:
        squared = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchors))
        return 0.5 * mu * squared

    return term


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    normalization: Normalization,
    device: torch.device,
    generator: torch.Generator,
    augmentation: Augmentation | None = None,
    regularizer: Regularizer | None = None,
    loss_fn: LossFn | None = None,
    optimizer: str = "sgd",
) -> float:
    """Mini-batch training for `epochs` epochs over (x, y); returns the mean training loss.

    `optimizer`: "sgd" (with `momentum`) or "adam" (PyTorch's defaults but `lr`; momentum
    unused), each with `weight_decay`; a fresh optimizer per call, as a ClientApp makes one per
    message.

    `loss_fn(model, inputs, targets)` replaces the cross-entropy batch loss (the local
    objectives of `concatfl.objectives`: MOON, FedRS, FedLC) and `regularizer(model)` is added
    to every batch loss (FedProx's proximal term, FedDyn's and SCAFFOLD's linear terms, …).
    """
    model.to(device).train()
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    step = (
        torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
        if optimizer == "adam"
        else SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    )
    criterion = nn.CrossEntropyLoss()
    total, batches = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), batch_size):
            idx = order[start : start + batch_size]
            inputs = x[idx]
            if augmentation is not None:
                inputs = augmentation(inputs, generator)
            inputs, targets = normalization(inputs).to(device), y[idx].to(device)
            step.zero_grad()
            loss = criterion(model(inputs), targets) if loss_fn is None else loss_fn(model, inputs, targets)
            if regularizer is not None:
                loss = loss + regularizer(model)
            loss.backward()
            step.step()
            total += float(loss.detach())
            batches += 1
    return total / max(batches, 1)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    normalization: Normalization | None,
    device: torch.device,
    batch_size: int = 512,
) -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy) of `model` on (x, y); (0, 0) on an empty set.

    `normalization` None feeds `x` as it is (e.g. features computed earlier).
    """
    if len(x) == 0:
        return 0.0, 0.0
    model.to(device).eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(x), batch_size):
        inputs = x[start : start + batch_size]
        inputs = (inputs if normalization is None else normalization(inputs)).to(device)
        targets = y[start : start + batch_size].to(device)
        logits = model(inputs)
        loss_sum += float(nn.functional.cross_entropy(logits, targets, reduction="sum"))
        correct += int((logits.argmax(dim=1) == targets).sum())
    return loss_sum / len(x), correct / len(x)
