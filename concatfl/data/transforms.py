"""Batched image transforms in pure torch: normalization and the standard training augmentations.

The augmentations take a batch ``x`` of shape ``(B, C, H, W)``; `normalize` takes any batch
``(B, C, …)`` (``(B, F)`` for flat features, one value per feature). All work on any device.
Random draws come from the optional ``generator`` so that augmentation is reproducible under a
seed; without one the global torch RNG is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from concatfl.data.datasets import DATASETS

__all__ = ["normalize", "random_crop", "random_horizontal_flip", "train_augmentation"]

Augmentation = Callable[[torch.Tensor, torch.Generator | None], torch.Tensor]


def _check_batch(x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"expected a batch of shape (B, C, H, W), got {tuple(x.shape)}")


def _rng_device(generator: torch.Generator | None) -> torch.device:
    # Random numbers must be drawn on the generator's own device; CPU is the global default.
    return generator.device if generator is not None else torch.device("cpu")


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``(x - mean) / std`` per channel (axis 1); ``mean`` and ``std`` have one value per channel."""
    if x.dim() < 2:
        raise ValueError(f"expected a batch of shape (B, C, ...), got {tuple(x.shape)}")
    if len(mean) != x.shape[1] or len(std) != x.shape[1]:
        raise ValueError(
            f"mean/std have {len(mean)}/{len(std)} values for a batch with {x.shape[1]} channels"
        )
    shape = (1, -1) + (1,) * (x.dim() - 2)
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(shape)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(shape)
    return (x - m) / s


def random_crop(
    x: torch.Tensor, padding: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Zero-pad each side by ``padding``, then crop an ``H × W`` window at a random offset.

    Every image gets its own offset, drawn uniformly from ``[0, 2 * padding]`` on both axes.
    """
    _check_batch(x)
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    if padding == 0:
        return x.clone()
    b, c, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    offsets = torch.randint(
        0, 2 * padding + 1, (b, 2), generator=generator, device=_rng_device(generator)
    ).to(x.device)
    rows = offsets[:, 0, None] + torch.arange(h, device=x.device)  # (B, H)
    cols = offsets[:, 1, None] + torch.arange(w, device=x.device)  # (B, W)
    # Advanced indexing broadcasts these to (B, C, H, W): one gather for the whole batch.
    return padded[
        torch.arange(b, device=x.device)[:, None, None, None],
        torch.arange(c, device=x.device)[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]


def random_horizontal_flip(
    x: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Mirror each image left–right independently with probability ``p``."""
    _check_batch(x)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    flip = torch.rand(x.shape[0], generator=generator, device=_rng_device(generator)) < p
    return torch.where(flip.to(x.device)[:, None, None, None], x.flip(3), x)


def _crop_and_flip(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    return random_horizontal_flip(random_crop(x, 4, generator), 0.5, generator)


def _crop_only(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    return random_crop(x, 4, generator)


def train_augmentation(dataset: str) -> Augmentation | None:
    """The training augmentation of ``dataset``, or None where it uses none.

    CIFAR-10/100: random crop (padding 4) then horizontal flip. SVHN: random crop only, since
    mirrored digits are not digits. The returned callables are module-level functions, so they
    pickle (Ray ships them to workers).
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {', '.join(DATASETS)}")
    if dataset in ("cifar10", "cifar100"):
        return _crop_and_flip
    if dataset == "svhn":
        return _crop_only
    return None
