"""Tests of concatfl.data.transforms: exact values, shapes, and determinism under a seed."""

from __future__ import annotations

import pickle

import pytest
import torch

from concatfl.data.datasets import DATASETS
from concatfl.data.transforms import (
    normalize,
    random_crop,
    random_horizontal_flip,
    train_augmentation,
)


def _batch(b: int = 8, c: int = 3, h: int = 6, w: int = 5) -> torch.Tensor:
    # Strictly positive, distinct values: any zero in a crop must come from the padding.
    n = b * c * h * w
    return torch.arange(1, n + 1, dtype=torch.float32).view(b, c, h, w) / n


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_normalize_exact_values() -> None:
    x = torch.tensor([[[[0.0, 1.0]], [[0.5, 0.25]]]])  # (1, 2, 1, 2)
    out = normalize(x, (0.5, 0.25), (0.5, 0.25))
    assert torch.equal(out, torch.tensor([[[[-1.0, 1.0]], [[1.0, 0.0]]]]))
    assert out.dtype == torch.float32 and out.shape == x.shape


def test_normalize_flat_features_per_feature() -> None:
    x = torch.tensor([[0.0, 1.0, 0.5], [1.0, 0.0, 0.5]])  # (B, F)
    out = normalize(x, (0.5, 0.5, 0.0), (0.5, 0.25, 1.0))
    assert torch.equal(out, torch.tensor([[-1.0, 2.0, 0.5], [1.0, -2.0, 0.5]]))
    with pytest.raises(ValueError, match=r"\(B, C, \.\.\.\)"):
        normalize(torch.zeros(3), (0.5,), (0.5,))


def test_normalize_rejects_wrong_channel_count() -> None:
    with pytest.raises(ValueError, match="channels"):
        normalize(torch.zeros(2, 3, 4, 4), (0.5,), (0.5,))


def test_random_crop_is_a_shifted_copy_with_zero_border() -> None:
    x = _batch()
    pad = 2
    out = random_crop(x, pad, _gen())
    assert out.shape == x.shape and out.dtype == x.dtype
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    h, w = x.shape[2:]
    offsets_seen = set()
    for i in range(x.shape[0]):
        windows = [
            (dy, dx)
            for dy in range(2 * pad + 1)
            for dx in range(2 * pad + 1)
            if torch.equal(out[i], padded[i, :, dy : dy + h, dx : dx + w])
        ]
        assert len(windows) == 1, f"image {i} is not a window of its padded input"
        offsets_seen.add(windows[0])
        dy, dx = windows[0]
        # Shift by (pad - dy, pad - dx): rows/cols that fell into the padding are exactly zero.
        zero_rows = max(pad - dy, 0) + max(dy - pad, 0)
        zero_cols = max(pad - dx, 0) + max(dx - pad, 0)
        assert int((out[i] == 0).all(dim=2).all(dim=0).sum()) == zero_rows
        assert int((out[i] == 0).all(dim=1).all(dim=0).sum()) == zero_cols
    assert len(offsets_seen) > 1, "every image got the same offset"


def test_random_crop_padding_zero_is_identity_and_negative_rejected() -> None:
    x = _batch()
    assert torch.equal(random_crop(x, 0, _gen()), x)
    with pytest.raises(ValueError, match="padding"):
        random_crop(x, -1)


def test_flip_p1_and_p0() -> None:
    x = _batch()
    assert torch.equal(random_horizontal_flip(x, p=1.0, generator=_gen()), torch.flip(x, dims=[3]))
    assert torch.equal(random_horizontal_flip(x, p=0.0, generator=_gen()), x)
    with pytest.raises(ValueError, match="p must be"):
        random_horizontal_flip(x, p=1.5)


def test_flip_is_per_image() -> None:
    x = _batch(b=64)
    out = random_horizontal_flip(x, p=0.5, generator=_gen())
    flipped = [torch.equal(out[i], x[i].flip(2)) for i in range(len(x))]
    kept = [torch.equal(out[i], x[i]) for i in range(len(x))]
    assert all(f != k for f, k in zip(flipped, kept))
    assert 0 < sum(flipped) < len(x)


def test_seeded_generator_is_deterministic() -> None:
    x = _batch(b=32)
    assert torch.equal(random_crop(x, 4, _gen(7)), random_crop(x, 4, _gen(7)))
    flipped = random_horizontal_flip(x, generator=_gen(7))
    assert torch.equal(flipped, random_horizontal_flip(x, generator=_gen(7)))
    assert not torch.equal(random_crop(x, 4, _gen(7)), random_crop(x, 4, _gen(8)))


def test_transforms_reject_non_batches() -> None:
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        random_crop(torch.zeros(3, 4, 4), 1)


@pytest.mark.parametrize("name", DATASETS)
def test_train_augmentation_by_dataset(name: str) -> None:
    aug = train_augmentation(name)
    if name not in ("cifar10", "cifar100", "svhn"):
        assert aug is None
        return
    assert aug is not None
    x = _batch(b=16, h=8, w=8)
    out = aug(x, _gen(3))
    assert out.shape == x.shape
    assert torch.equal(out, aug(x, _gen(3)))
    assert pickle.loads(pickle.dumps(aug)) is aug  # Ray ships it to workers


def test_svhn_augmentation_never_flips() -> None:
    aug = train_augmentation("svhn")
    assert aug is not None
    x = _batch(b=16, h=8, w=8)
    assert torch.equal(aug(x, _gen(5)), random_crop(x, 4, _gen(5)))


def test_cifar_augmentation_is_crop_then_flip() -> None:
    aug = train_augmentation("cifar10")
    assert aug is not None
    x = _batch(b=16, h=8, w=8)
    g = _gen(5)
    expected = random_horizontal_flip(random_crop(x, 4, g), 0.5, g)
    assert torch.equal(aug(x, _gen(5)), expected)


def test_train_augmentation_unknown_dataset() -> None:
    with pytest.raises(ValueError, match="cifar10"):
        train_augmentation("imagenet")
