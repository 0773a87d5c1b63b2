"""FedConcat's final model: K frozen cluster encoders side by side under one linear classifier.

Stage 3 of FedConcat (Diao et al.) keeps the encoders of the K cluster models fixed and learns
only a linear head on their concatenated features. This module is pure torch (plus
`concatfl.models` to rebuild encoders on load) so the saved model runs without Flower:

* `ConcatModel` — the module: ``forward(x) = classifier([enc_1(x), …, enc_K(x)])``, encoders
  frozen (no gradients, always in eval mode so BatchNorm statistics never move).
* `FeatureCache` — a fixed input set's concatenated features, recomputed only when the
  encoders change (the server's evaluation in the classifier rounds).
* `split_model`, `check_head` — a model as FedConcat sees it: an encoder and a linear head (by
  default ``classifier``, as in `concatfl.models`; any model whose forward ends with a linear
  layer works, named by that layer).
* `concat_state_dict` — the ConcatModel state dict built from K cluster models' state dicts
  and a classifier.
* `concatenate` — the start of stage 3: encoders and classifier from the cluster models.
* `classifier_from_heads` — the paper's initialization: cluster classifier weights concatenated
  along the input axis and their biases summed, so the start equals the sum of the cluster
  models' logits (an ensemble); `random_classifier` — nn.Linear's default init, seeded.
* `train_classifier` — the client's head-only update: a few SGD steps on cached features.
* `save_concat_model` / `load_concat_model` — one self-describing file for inference.

State-dict layout: ``encoders.<k>.<encoder key>`` for cluster k's encoder and
``classifier.weight`` (num_classes × K·feature_dim) / ``classifier.bias``, whatever the head of
the cluster models is called. An encoder key is the model's key without ``encoder.`` for
concatfl's layout (every key but the head's under ``encoder.``), else the model's key unchanged
(the encoder is then the whole model with its head replaced by the identity).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models import SplitModel, build_model
from .sgd import SGD

ENCODER_PREFIX = "encoder."
ENCODERS_PREFIX = "encoders."
DEFAULT_HEAD = "classifier"
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
    def from_factory(
        cls,
        make_model: Callable[[], nn.Module],
        num_encoders: int,
        head: str = DEFAULT_HEAD,
        sample: torch.Tensor | None = None,
    ) -> ConcatModel:
        """A ConcatModel over the encoders of `num_encoders` fresh `make_model()` models, each
        split at its linear layer `head` (`split_model`; the first one checked on `sample`)."""
        parts = [split_model(make_model(), head, sample if index == 0 else None) for index in range(num_encoders)]
        return cls(
            [encoder for encoder, _ in parts],
            [layer.in_features for _, layer in parts],
            parts[0][1].out_features,
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


def head_keys(head: str) -> tuple[str, str]:
    """State-dict keys (weight, bias) of the linear layer named `head`."""
    return f"{head}.weight", f"{head}.bias"


def encoder_prefix(keys: Iterable[str], head: str) -> str:
    """What a model's encoder keys drop from its state keys: ``"encoder."`` when every key but the
    head's lies under it (concatfl's `SplitModel` layout; the ``encoder`` submodule is the
    encoder), else ``""`` (the encoder is the whole model without its head)."""
    rest = [key for key in keys if key not in head_keys(head)]
    return ENCODER_PREFIX if rest and all(key.startswith(ENCODER_PREFIX) for key in rest) else ""


def check_head(shapes: Mapping[str, Sequence[int]], head: str) -> tuple[int, int]:
    """(num_classes, feature_dim) of the linear head `head` of a model with these state-dict shapes.

    Raises ValueError, saying what is missing and which layer looks like the head, unless
    ``<head>.weight`` is (num_classes, feature_dim), ``<head>.bias`` is (num_classes,) and the
    model has other entries (the encoder).
    """
    weight_key, bias_key = head_keys(head)
    weight, bias = shapes.get(weight_key), shapes.get(bias_key)
    if weight is not None and bias is not None and len(weight) == 2 and tuple(bias) == (weight[0],):
        if len(shapes) > 2:
            return int(weight[0]), int(weight[1])
        problem = f"the model has no parameters besides its head {head!r} (no encoder)"
    elif weight is None or bias is None:
        missing = [key for key in (weight_key, bias_key) if key not in shapes]
        problem = f"the model's state has no {' or '.join(repr(key) for key in missing)}"
    else:
        problem = (
            f"{weight_key!r} has shape {tuple(weight)} and {bias_key!r} {tuple(bias)}; a linear head "
            "needs (num_classes, feature_dim) and (num_classes,)"
        )
    keys = list(shapes)
    listed = ", ".join(keys[:12]) + (f", … ({len(keys)} keys)" if len(keys) > 12 else "")
    guess = _last_linear(shapes)
    hint = f"; its last linear layer is {guess!r} (head={guess!r})" if guess and guess != head else ""
    raise ValueError(f"head={head!r}: {problem}. The model's keys: {listed}{hint}")


def _last_linear(shapes: Mapping[str, Sequence[int]]) -> str | None:
    """Name of the last layer (in state order) with a 2-D weight and a matching 1-D bias."""
    candidates = [
        key[: -len(".weight")]
        for key, shape in shapes.items()
        if key.endswith(".weight") and len(shape) == 2
        and tuple(shapes.get(key[: -len(".weight")] + ".bias", ())) == (shape[0],)
    ]
    return candidates[-1] if candidates else None


def split_model(
    model: nn.Module, head: str = DEFAULT_HEAD, sample: torch.Tensor | None = None
) -> tuple[nn.Module, nn.Linear]:
    """(encoder, head layer) of `model`, whose forward must end with ``return self.<head>(features)``.

    concatfl's layout (`encoder_prefix`) gives its ``encoder`` submodule; any other model is
    itself the encoder once its head is replaced (in place) by the identity. With a `sample`
    batch, checks that ``head(encoder(sample))`` equals ``model(sample)`` (in eval mode) and
    raises ValueError otherwise, as it does when `head` names no nn.Linear.
    """
    try:
        layer = model.get_submodule(head)
    except AttributeError:
        layer = None
    if not isinstance(layer, nn.Linear):
        found = "nothing" if layer is None else type(layer).__name__
        raise ValueError(
            f"head={head!r} must name the model's last nn.Linear layer; the model has {found} there"
        )
    expected = None
    if sample is not None:
        model.eval()
        with torch.no_grad():
            expected = model(sample)
    if encoder_prefix(model.state_dict(), head):
        encoder = model.get_submodule(ENCODER_PREFIX.rstrip("."))
    else:
        parent, _, name = head.rpartition(".")
        setattr(model.get_submodule(parent), name, nn.Identity())
        encoder = model
    if expected is not None:
        try:
            with torch.no_grad():
                recombined = layer(encoder(sample))
        except RuntimeError:  # e.g. the head was not the last layer, so the next one gets the wrong width
            recombined = None
        if (
            recombined is None
            or recombined.shape != expected.shape
            or not torch.allclose(recombined, expected, rtol=1e-4, atol=1e-5)
        ):
            raise ValueError(
                f"head={head!r}: the model's output is not {head}(features): FedConcat takes the input of "
                f"{head!r} as the features, so the model's forward must end with `return self.{head}(features)`"
            )
    return encoder, layer


def classifier_from_heads(
    cluster_states: Sequence[StateDict], head: str = DEFAULT_HEAD
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) with the cluster heads' weights concatenated along the input axis and their
    biases summed.

    With this head, ConcatModel's logits are Σ_k (W_k f_k(x) + b_k): the sum of the cluster
    models' logits.
    """
    weight_key, bias_key = head_keys(head)
    weight = torch.cat([state[weight_key] for state in cluster_states], dim=1)
    bias = torch.stack([state[bias_key] for state in cluster_states]).sum(dim=0)
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
    cluster_states: Sequence[StateDict], classifier: tuple[torch.Tensor, torch.Tensor], head: str = DEFAULT_HEAD
) -> dict[str, torch.Tensor]:
    """ConcatModel's state dict: each cluster model's entries but its head's (`head`), as encoder
    keys (`encoder_prefix`) under ``encoders.<k>.`` in cluster order, then the given
    classifier (weight, bias)."""
    state: dict[str, torch.Tensor] = {}
    for k, cluster_state in enumerate(cluster_states):
        prefix = encoder_prefix(cluster_state, head)
        for key, value in cluster_state.items():
            if key not in head_keys(head):
                state[f"{ENCODERS_PREFIX}{k}.{key[len(prefix) :]}"] = value.clone()
    state[CLASSIFIER_WEIGHT], state[CLASSIFIER_BIAS] = classifier
    return state


def concatenate(
    cluster_states: Sequence[StateDict], head: str = DEFAULT_HEAD, random_head: torch.Generator | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Stage 3's start: the (encoders, classifier) entries of the ConcatModel over these cluster
    models (`concat_state_dict`).

    The classifier starts from the cluster heads (`classifier_from_heads`), or, given a
    `random_head` generator, from nn.Linear's default init drawn from it (`random_classifier`).
    """
    if random_head is None:
        classifier = classifier_from_heads(cluster_states, head)
    else:
        weight = cluster_states[0][head_keys(head)[0]]
        in_features = weight.shape[1] * len(cluster_states)
        classifier = random_classifier(in_features, weight.shape[0], random_head, weight.dtype)
    state = concat_state_dict(cluster_states, classifier, head)
    encoders = {key: value for key, value in state.items() if key.startswith(ENCODERS_PREFIX)}
    return encoders, {key: state[key] for key in CLASSIFIER_KEYS}


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
    optimizer = SGD(classifier.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
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
