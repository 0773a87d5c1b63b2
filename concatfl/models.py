"""Model zoo for concatfl, every model split into an encoder and a linear classifier.

Each model is a :class:`SplitModel`: ``encoder`` maps a batch ``(B, C, H, W)`` to flat
features ``(B, feature_dim)`` (the flatten is part of the encoder) and ``classifier`` is the
single last ``nn.Linear(feature_dim, num_classes)``, so ``forward(x) ==
classifier(encoder(x))``. FedConcat concatenates encoders and trains a head on the joined
features; FedSeq reads the fully-connected weights, which :func:`fc_layer_names` lists.
All state_dict keys start with ``encoder.`` or ``classifier.``. Parameters keep PyTorch's
default initialisation and nothing here seeds the random number generator: callers seed
torch before :func:`build_model`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import nn

MODELS: tuple[str, ...] = ("mlp", "mcmahan-cnn", "simple-cnn", "lenet5", "vgg9", "resnet18")

DEFAULT_MODEL: dict[str, str] = {
    "digits": "mlp",
    "mnist": "mcmahan-cnn",
    "fmnist": "mcmahan-cnn",
    "femnist": "mcmahan-cnn",
    "cifar10": "simple-cnn",
    "cifar100": "resnet18",
    "svhn": "simple-cnn",
}

InputShape = tuple[int, int, int]
_Layers = list[tuple[str, nn.Module]]

# Entries of a conv-stack spec: an int is a conv layer with that many output channels
# (followed by ReLU), _POOL is a 2x2 max-pool.
_POOL = "pool"


class SplitModel(nn.Module):
    """An ``encoder`` (to flat features) followed by one linear ``classifier``."""

    def __init__(self, encoder: nn.Module, input_shape: InputShape, num_classes: int) -> None:
        """Wrap ``encoder``; ``feature_dim`` is measured by a dry forward pass."""
        super().__init__()
        self.encoder = encoder
        self.feature_dim: int = _flat_output_dim(encoder, input_shape)
        self.classifier = nn.Linear(self.feature_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the logits ``classifier(encoder(x))``."""
        return self.classifier(self.encoder(x))


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs with BatchNorm and a residual shortcut)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        """Build the block; the shortcut is a 1x1 conv + BN when the shape changes."""
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def _flat_output_dim(module: nn.Module, input_shape: InputShape) -> int:
    """Size of ``module``'s flat output for one input, found by a dry forward pass.

    Runs in eval mode without gradients on zeros, so BatchNorm buffers and the random
    number generator are untouched; the module's training flag is restored afterwards.
    """
    was_training = module.training
    module.eval()
    with torch.no_grad():
        out = module(torch.zeros(1, *input_shape))
    module.train(was_training)
    return int(out.shape[1])


def _check_spatial(
    name: str, input_shape: InputShape, min_size: int = 1, multiple: int = 1
) -> None:
    """Raise ValueError unless H and W are at least ``min_size`` and divisible by ``multiple``."""
    _, height, width = input_shape
    if height < min_size or width < min_size:
        raise ValueError(
            f"model {name!r} needs inputs of at least {min_size}x{min_size}, got {height}x{width}"
        )
    if height % multiple or width % multiple:
        raise ValueError(
            f"model {name!r} needs input height and width divisible by {multiple}, "
            f"got {height}x{width}"
        )


def _conv_stack(
    in_channels: int, spec: Sequence[int | str], kernel_size: int, padding: int
) -> _Layers:
    """Named conv/ReLU/max-pool layers for ``spec`` (ints are conv widths, ``_POOL`` pools)."""
    layers: _Layers = []
    n_conv = n_pool = 0
    for entry in spec:
        if entry == _POOL:
            n_pool += 1
            layers.append((f"pool{n_pool}", nn.MaxPool2d(2)))
        else:
            n_conv += 1
            out_channels = int(entry)
            conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding)
            layers.append((f"conv{n_conv}", conv))
            layers.append((f"relu{n_conv}", nn.ReLU()))
            in_channels = out_channels
    return layers


def _fc_stack(in_features: int, widths: Sequence[int]) -> _Layers:
    """Named hidden Linear/ReLU layers ``fc1, relu_fc1, fc2, ...`` of the given widths."""
    layers: _Layers = []
    for i, width in enumerate(widths, start=1):
        layers.append((f"fc{i}", nn.Linear(in_features, width)))
        layers.append((f"relu_fc{i}", nn.ReLU()))
        in_features = width
    return layers


def _conv_fc_encoder(
    input_shape: InputShape,
    conv_spec: Sequence[int | str],
    kernel_size: int,
    padding: int,
    fc_widths: Sequence[int],
) -> nn.Sequential:
    """Conv stack, flatten, then hidden FC layers; the FC input size comes from a dry pass."""
    trunk = _conv_stack(input_shape[0], conv_spec, kernel_size, padding)
    trunk.append(("flatten", nn.Flatten()))
    flat_dim = _flat_output_dim(nn.Sequential(OrderedDict(trunk)), input_shape)
    return nn.Sequential(OrderedDict(trunk + _fc_stack(flat_dim, fc_widths)))


def _mlp(input_shape: InputShape) -> nn.Sequential:
    """Two-hidden-layer MLP 200-200 (McMahan et al. 2017, "2NN")."""
    flatten: _Layers = [("flatten", nn.Flatten())]
    return nn.Sequential(OrderedDict(flatten + _fc_stack(math.prod(input_shape), (200, 200))))


def _mcmahan_cnn(input_shape: InputShape) -> nn.Sequential:
    """The "CNN" of McMahan et al. 2017 (AISTATS, FedAvg): two 5x5 convs 32/64, fc 512."""
    _check_spatial("mcmahan-cnn", input_shape, multiple=4)
    return _conv_fc_encoder(input_shape, (32, _POOL, 64, _POOL), 5, 2, (512,))


def _simple_cnn(input_shape: InputShape) -> nn.Sequential:
    """The simple CNN of NIID-Bench (Li et al. 2022, ICDE): convs 6/16, fc 120-84."""
    _check_spatial("simple-cnn", input_shape, min_size=16)
    return _conv_fc_encoder(input_shape, (6, _POOL, 16, _POOL), 5, 0, (120, 84))


def _lenet5(input_shape: InputShape) -> nn.Sequential:
    """The LeNet-5 variant of Hsu et al. 2020 (ECCV) used by FedSeq: convs 64/64, fc 384-192."""
    _check_spatial("lenet5", input_shape, min_size=16)
    return _conv_fc_encoder(input_shape, (64, _POOL, 64, _POOL), 5, 0, (384, 192))


def _vgg9(input_shape: InputShape) -> nn.Sequential:
    """The federated VGG-9 of Wang et al. 2020 (ICLR, FedMA), also used by FedConcat."""
    _check_spatial("vgg9", input_shape, min_size=8)
    spec = (32, 64, _POOL, 128, 128, _POOL, 256, 256, _POOL)
    return _conv_fc_encoder(input_shape, spec, 3, 1, (512, 512))


def _resnet18(input_shape: InputShape) -> nn.Sequential:
    """CIFAR-style ResNet-18 (He et al. 2016, CVPR): 3x3 stem, no stem max-pool, GAP to 512."""
    layers: _Layers = [
        ("conv1", nn.Conv2d(input_shape[0], 64, 3, stride=1, padding=1, bias=False)),
        ("bn1", nn.BatchNorm2d(64)),
        ("relu", nn.ReLU()),
    ]
    in_channels = 64
    for stage, (channels, stride) in enumerate(((64, 1), (128, 2), (256, 2), (512, 2)), start=1):
        blocks = nn.Sequential(
            BasicBlock(in_channels, channels, stride), BasicBlock(channels, channels, 1)
        )
        layers.append((f"layer{stage}", blocks))
        in_channels = channels
    layers += [("avgpool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten())]
    return nn.Sequential(OrderedDict(layers))


_ENCODERS: dict[str, Callable[[InputShape], nn.Sequential]] = {
    "mlp": _mlp,
    "mcmahan-cnn": _mcmahan_cnn,
    "simple-cnn": _simple_cnn,
    "lenet5": _lenet5,
    "vgg9": _vgg9,
    "resnet18": _resnet18,
}


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int) -> SplitModel:
    """Build model ``name`` for inputs of shape ``(C, H, W)`` and ``num_classes`` outputs.

    Raises ValueError for an unknown name (listing :data:`MODELS`), a malformed shape, a
    non-positive class count, or an input size the model does not support.
    """
    if name not in _ENCODERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise ValueError(f"input_shape must be three positive ints (C, H, W), got {input_shape!r}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    channels, height, width = (int(d) for d in input_shape)
    shape = (channels, height, width)
    return SplitModel(_ENCODERS[name](shape), shape, num_classes)


def resolve_model_name(name: str, dataset: str) -> str:
    """Return ``name``, or the default model for ``dataset`` when ``name`` is ``"auto"``."""
    if name == "auto":
        if dataset not in DEFAULT_MODEL:
            raise ValueError(
                f"no default model for dataset {dataset!r}; known: {', '.join(DEFAULT_MODEL)}"
            )
        return DEFAULT_MODEL[dataset]
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)} or 'auto'")
    return name


def fc_layer_names(model: nn.Module) -> list[str]:
    """State_dict key prefixes of all ``nn.Linear`` layers, in forward order.

    E.g. ``["encoder.fc1", "encoder.fc2", "classifier"]``; the classifier is always last.
    """
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
