"""Tests for concatfl.models: the encoder/classifier split, shapes, sizes and errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from concatfl.models import (
    DEFAULT_MODEL,
    MODELS,
    build_model,
    fc_layer_names,
    resolve_model_name,
)

NUM_CLASSES = 10
DIGITS, MNIST, CIFAR = (1, 8, 8), (1, 28, 28), (3, 32, 32)

CASES = [
    ("mlp", DIGITS),
    ("mlp", MNIST),
    ("mlp", CIFAR),
    ("mcmahan-cnn", DIGITS),
    ("mcmahan-cnn", MNIST),
    ("mcmahan-cnn", CIFAR),
    ("simple-cnn", MNIST),
    ("simple-cnn", CIFAR),
    ("lenet5", MNIST),
    ("lenet5", CIFAR),
    ("vgg9", MNIST),
    ("vgg9", CIFAR),
    ("resnet18", MNIST),
    ("resnet18", CIFAR),
]

EXPECTED_FC = {
    "mlp": ["encoder.fc1", "encoder.fc2", "classifier"],
    "mcmahan-cnn": ["encoder.fc1", "classifier"],
    "simple-cnn": ["encoder.fc1", "encoder.fc2", "classifier"],
    "lenet5": ["encoder.fc1", "encoder.fc2", "classifier"],
    "vgg9": ["encoder.fc1", "encoder.fc2", "classifier"],
    "resnet18": ["classifier"],
}

EXPECTED_FEATURE_DIM = {
    "mlp": 200,
    "mcmahan-cnn": 512,
    "simple-cnn": 84,
    "lenet5": 192,
    "vgg9": 512,
    "resnet18": 512,
}


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_split_is_exact(name: str, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    model = build_model(name, shape, NUM_CLASSES)
    x = torch.randn(2, *shape)
    with torch.no_grad():
        logits = model(x)
        features = model.encoder(x)
        recomposed = model.classifier(model.encoder(x))
    assert logits.shape == (2, NUM_CLASSES)
    assert torch.equal(logits, recomposed)
    assert model.feature_dim == EXPECTED_FEATURE_DIM[name]
    assert features.shape == (2, model.feature_dim)
    assert type(model.classifier) is nn.Linear
    assert model.classifier.in_features == model.feature_dim
    assert model.classifier.out_features == NUM_CLASSES
    assert all(k.startswith(("encoder.", "classifier.")) for k in model.state_dict())
    assert fc_layer_names(model) == EXPECTED_FC[name]


def test_parameter_counts() -> None:
    # conv1 5*5*1*32+32 = 832; conv2 5*5*32*64+64 = 51,264; fc1 7*7*64*512+512 = 1,606,144;
    # classifier 512*10+10 = 5,130; total 1,663,370.
    assert _num_params(build_model("mcmahan-cnn", MNIST, 10)) == 1_663_370
    # conv1 5*5*3*6+6 = 456; conv2 5*5*6*16+16 = 2,416; fc1 16*5*5*120+120 = 48,120;
    # fc2 120*84+84 = 10,164; classifier 84*10+10 = 850; total 62,006.
    assert _num_params(build_model("simple-cnn", CIFAR, 10)) == 62_006


def test_fc_weights_reachable_in_state_dict() -> None:
    model = build_model("lenet5", CIFAR, 7)
    state = model.state_dict()
    shapes = [tuple(state[f"{prefix}.weight"].shape) for prefix in fc_layer_names(model)]
    assert shapes == [(384, 64 * 5 * 5), (192, 384), (7, 192)]


def test_resnet18_batchnorm_buffers_untouched_by_construction() -> None:
    model = build_model("resnet18", CIFAR, 100)
    assert model.training
    state = model.state_dict()
    assert state["encoder.bn1.num_batches_tracked"].dtype == torch.int64
    assert int(state["encoder.bn1.num_batches_tracked"]) == 0
    assert torch.equal(state["encoder.bn1.running_var"], torch.ones(64))
    assert torch.equal(state["encoder.bn1.running_mean"], torch.zeros(64))


def test_same_seed_same_weights() -> None:
    torch.manual_seed(3)
    first = build_model("mcmahan-cnn", DIGITS, 10).state_dict()
    torch.manual_seed(3)
    second = build_model("mcmahan-cnn", DIGITS, 10).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(ValueError, match="unknown model") as info:
        build_model("alexnet", CIFAR, 10)
    assert all(name in str(info.value) for name in MODELS)


@pytest.mark.parametrize("name", ["simple-cnn", "lenet5"])
def test_too_small_input_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="at least 16x16"):
        build_model(name, DIGITS, 10)


def test_mcmahan_cnn_needs_multiple_of_four() -> None:
    with pytest.raises(ValueError, match="divisible by 4"):
        build_model("mcmahan-cnn", (1, 10, 10), 10)


def test_vgg9_too_small_rejected() -> None:
    with pytest.raises(ValueError, match="at least 8x8"):
        build_model("vgg9", (3, 4, 4), 10)


@pytest.mark.parametrize("shape", [(28, 28), (0, 28, 28), (1, 28, 28, 1)])
def test_malformed_shape_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="input_shape"):
        build_model("mlp", shape, 10)  # type: ignore[arg-type]


def test_resolve_model_name() -> None:
    assert resolve_model_name("auto", "mnist") == "mcmahan-cnn"
    assert resolve_model_name("auto", "digits") == "mlp"
    assert resolve_model_name("auto", "cifar100") == "resnet18"
    assert resolve_model_name("vgg9", "mnist") == "vgg9"
    assert set(DEFAULT_MODEL.values()) <= set(MODELS)
    with pytest.raises(ValueError, match="no default model"):
        resolve_model_name("auto", "imagenet")
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model_name("alexnet", "mnist")
