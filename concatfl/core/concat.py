"""FedConcat's final model: K frozen cluster encoders side by side under one linear classifier.

Stage 3 of FedConcat (Diao et al.) keeps the encoders of the K cluster models fixed and learns
only a linear head on their concatenated features. This module is pure torch (plus
`concatfl.models` to rebuild encoders on load) so the saved model runs without Flower:

* `ConcatModel` — the module: ``forward(x) = classifier([enc_1(x), …, enc_K(x)])``, encoders
  frozen (no gradients, always in eval mode so BatchNorm statistics never move).
* `FeatureCache` — a fixed input set's concatenated features, recomputed only when the
  encoders change (the server's evaluation in the classifier rounds).
* `concat_state_dict` — the ConcatModel state dict built from K cluster models' state dicts
  (keys ``encoder.*`` / ``classifier.*`` as in `concatfl.models`) and a classifier.
* `classifier_from_heads` — the paper's initialization: cluster classifier weights concatenated
  along the input axis and their biases summed, so the start equals the sum of the cluster
  models' logits (an ensemble); `random_classifier` — nn.Linear's default init, seeded.
* `train_classifier` — the client's head-only update: a few SGD steps on cached features.
* `save_concat_model` / `load_concat_model` — one self-describing file for inference.

State-dict layout: ``encoders.<k>.<encoder key>`` for cluster k's encoder and
``classifier.weight`` (num_classes × K·feature_dim) / ``classifier.bias``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..models import SplitModel, build_model

ENCODER_PREFIX = "encoder."
ENCODERS_PREFIX = "encoders."
CLASSIFIER_WEIGHT = "classifier.weight"
CLASSIFIER_BIAS = "classifier.bias"
CLASSIFIER_KEYS = (CLASSIFIER_WEIGHT, CLASSIFIER_BIAS)
FILE_FORMAT = "concatfl-fedconcat-1"

StateDict = Mapping[str, torch.Tensor]


class ConcatModel(nn.Module):
    """K frozen encoders whose flat features are concatenated and fed to one nn.Linear.

    Parameters
    ----------
    encoders : Sequence[nn.Module]
        The cluster encoders (each maps a batch to flat features). They are frozen here:
        `requires_grad` is turned off and they stay in eval mode even under `train()`.
    feature_dims : Sequence[int]
        Output width of each encoder; the classifier reads their sum.
    num_classes : int
        Output width of the classifier.
    """

    def __init__(self, encoders: Sequence[nn.Module], feature_dims: Sequence[int], num_classes: int) -> None:
        super().__init__()
        if len(encoders) == 0 or len(encoders) != len(feature_dims):
            raise ValueError(
                f"need one feature_dim per encoder, got {len(encoders)} encoders, {len(feature_dims)} dims"
            )
        self.encoders = nn.ModuleList(encoders)
        self.encoders.requires_grad_(False)
        self.feature_dims = tuple(int(d) for d in feature_dims)
        self.classifier = nn.Linear(sum(self.feature_dims), num_classes)
        self.encoders.eval()

    @classmethod
    def from_factory(cls, make_model: Callable[[], nn.Module], num_encoders: int) -> ConcatModel:
        """A ConcatModel over `num_encoders` fresh encoders of `make_model()`, which must build a
        `SplitModel` (or a module with the same ``encoder``/``feature_dim``/``classifier``)."""
        models = [cast(SplitModel, make_model()) for _ in range(num_encoders)]
        return cls(
            [model.encoder for model in models],
            [model.feature_dim for model in models],
            models[0].classifier.out_features,
        )

    def train(self, mode: bool = True) -> ConcatModel:
        """Set the classifier's mode; the frozen encoders always stay in eval mode."""
        super().train(mode)
        self.encoders.eval()
        return self

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The concatenated encoder features of a (normalized) batch, without gradients."""
        with torch.no_grad():
            return torch.cat([encoder(x) for encoder in self.encoders], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the classifier on the concatenated features."""
        return self.classifier(self.features(x))


class FeatureCache:
    """The concatenated features of one fixed input set under a ConcatModel's encoders,
    recomputed only when those encoders' weights (or the inputs) change.

    FedConcat's classifier rounds change only the head, so evaluating the global model every
    round costs one linear layer on cached features instead of K encoder passes. The cache
    keeps a copy of the encoder weights it was computed with and compares them (exact
    equality) on every call, so any change of encoders, however the model was built, is seen.
    """

    def __init__(self) -> None:
        self._encoders: dict[str, torch.Tensor] = {}
        self._inputs: torch.Tensor | None = None
        self._features: torch.Tensor | None = None

    def features(
        self,
        model: ConcatModel,
        x: torch.Tensor,
        transform: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
        batch_size: int = 512,
    ) -> torch.Tensor:
        """`model.features(transform(batch))` of every `batch_size` batch of `x`, concatenated
        (on `device`): the same batches a `batch_size` evaluation of `model` would feed it, so
        a head applied to these batches gives that evaluation's logits exactly."""
        encoders = model.encoders.state_dict()
        if self._features is None or not self._computed_with(encoders, x):
            model.to(device).eval()
            batches = [
                model.features(transform(x[start : start + batch_size]).to(device))
                for start in range(0, len(x), batch_size)
            ]
            empty = torch.empty(0, sum(model.feature_dims), device=device)
            self._features = torch.cat(batches) if batches else empty
            self._encoders = {key: value.detach().clone() for key, value in encoders.items()}
            self._inputs = x
        return self._features

    def _computed_with(self, encoders: StateDict, x: torch.Tensor) -> bool:
        cached = self._encoders
        return (
            x is self._inputs
            and encoders.keys() == cached.keys()
            and all(
                value.shape == cached[key].shape and torch.equal(value.to(cached[key].device), cached[key])
                for key, value in encoders.items()
            )
        )


def classifier_from_heads(cluster_states: Sequence[StateDict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) with the cluster weights concatenated along the input axis and biases summed.

    With this head, ConcatModel's logits are Σ_k (W_k f_k(x) + b_k): the sum of the cluster
    models' logits.
    """
    weight = torch.cat([state[CLASSIFIER_WEIGHT] for state in cluster_states], dim=1)
    bias = torch.stack([state[CLASSIFIER_BIAS] for state in cluster_states]).sum(dim=0)
    return weight.clone(), bias.clone()


def random_classifier(
    in_features: int, num_classes: int, generator: torch.Generator, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) drawn like nn.Linear's default: U(-1/√in, 1/√in), from `generator`."""
    bound = 1.0 / math.sqrt(in_features)
    weight = torch.empty(num_classes, in_features, dtype=dtype).uniform_(-bound, bound, generator=generator)
    bias = torch.empty(num_classes, dtype=dtype).uniform_(-bound, bound, generator=generator)
    return weight, bias


def concat_state_dict(
    cluster_states: Sequence[StateDict], classifier: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """ConcatModel's state dict: each cluster model's ``encoder.*`` entries under
    ``encoders.<k>.`` (in cluster order), then the given classifier (weight, bias)."""
    state: dict[str, torch.Tensor] = {}
    for k, cluster_state in enumerate(cluster_states):
        for key, value in cluster_state.items():
            if key.startswith(ENCODER_PREFIX):
                state[f"{ENCODERS_PREFIX}{k}.{key[len(ENCODER_PREFIX) :]}"] = value.clone()
    state[CLASSIFIER_WEIGHT], state[CLASSIFIER_BIAS] = classifier
    return state


def num_encoders(keys: Sequence[str] | Any) -> int:
    """How many encoders a ConcatModel state dict with these keys holds."""
    indices = {
        key[len(ENCODERS_PREFIX) :].split(".", 1)[0] for key in keys if key.startswith(ENCODERS_PREFIX)
    }
    return len(indices)


def is_concat_state(keys: Sequence[str] | Any) -> bool:
    """Whether keys are a ConcatModel's (as opposed to a single SplitModel's)."""
    return num_encoders(keys) > 0


def save_concat_model(
    path: str | os.PathLike,
    state_dict: StateDict,
    *,
    model_name: str,
    input_shape: Sequence[int],
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> Path:
    """Write a ConcatModel to one file that `load_concat_model` rebuilds without Flower.

    The file records the architecture (`model_name` from `concatfl.models`, `input_shape`,
    number of classes and encoders) and, when given, the input normalization (`mean`, `std`)
    the model expects: inference is ``model(normalize(x, mean, std))`` for x in [0, 1].
    """
    keys = list(state_dict)
    payload = {
        "format": FILE_FORMAT,
        "model": model_name,
        "input_shape": [int(d) for d in input_shape],
        "num_classes": int(state_dict[CLASSIFIER_BIAS].shape[0]),
        "num_encoders": num_encoders(keys),
        "mean": None if mean is None else [float(v) for v in mean],
        "std": None if std is None else [float(v) for v in std],
        "state_dict": {key: value.detach().cpu() for key, value in state_dict.items()},
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, target)
    return target


def load_concat_model(path: str | os.PathLike) -> tuple[ConcatModel, dict[str, Any]]:
    """(model in eval mode, metadata) from a file written by `save_concat_model`.

    The metadata holds ``model``, ``input_shape``, ``num_classes``, ``num_encoders``, ``mean``
    and ``std``. Only tensors and plain values are unpickled (``weights_only=True``).
    """
    payload = torch.load(Path(path), map_location="cpu", weights_only=True)
    if payload.get("format") != FILE_FORMAT:
        raise ValueError(f"{path} is not a FedConcat model file (format {payload.get('format')!r})")
    shape = tuple(payload["input_shape"])

    def make_model() -> SplitModel:
        return build_model(payload["model"], shape, payload["num_classes"])

    model = ConcatModel.from_factory(make_model, payload["num_encoders"])
    model.load_state_dict(payload["state_dict"])
    metadata = {key: value for key, value in payload.items() if key not in ("format", "state_dict")}
    return model.eval(), metadata


def train_classifier(
    classifier: nn.Linear,
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    generator: torch.Generator,
) -> float:
    """`steps` mini-batch SGD steps of `classifier` on fixed features; returns the mean loss.

    Batches walk through a random permutation of the samples and a new permutation starts when
    one is used up, so every sample is seen before any is repeated.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    classifier.train()
    optimizer = torch.optim.SGD(classifier.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    order = torch.randperm(len(labels), generator=generator)
    position, total = 0, 0.0
    for _ in range(steps):
        if position >= len(order):
            order, position = torch.randperm(len(labels), generator=generator), 0
        batch = order[position : position + batch_size]
        position += batch_size
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(classifier(features[batch]), labels[batch])
        loss.backward()
        optimizer.step()
        total += float(loss.detach())
    return total / steps
