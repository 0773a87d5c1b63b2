"""What the apps need at run time: the client's data and the server's evaluation environment.

Both are built from the validated `RunConfig`, so the ServerApp, the ClientApp and the
strategies agree on dataset, model, normalization and device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from .config import ConfigError, RunConfig
from .core.concat import ConcatModel, FeatureCache
from .data.datasets import LoadedData, load_dataset
from .data.partition import local_split, partition_indices
from .data.transforms import train_augmentation
from .models import build_model, resolve_model_name
from .training import Augmentation, Normalization, evaluate, pick_device


def load_data(config: RunConfig) -> LoadedData:
    """The run's dataset (cached per process by the loader)."""
    return load_dataset(
        config.dataset,
        config.data_dir or None,
        cifar100_labels=config.cifar100_labels,
        download=config.download,
    )


def make_model(config: RunConfig, data: LoadedData) -> nn.Module:
    """A fresh model of the run's architecture."""
    return build_model(resolve_model_name(config.model, config.dataset), data.input_shape, data.num_classes)


@dataclass
class ClientData:
    """One client's local train and test split, plus how to feed them to a model.

    `normalization` maps a batch of stored inputs to the model's inputs (concatfl's datasets
    keep inputs in [0, 1] and normalize per channel with a `Normalization`).
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    normalization: Callable[[torch.Tensor], torch.Tensor]
    augmentation: Augmentation | None

    @classmethod
    def from_train_split(
        cls,
        x_train: torch.Tensor,
        y_train: torch.Tensor,
        num_classes: int,
        normalization: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> ClientData:
        """A training split alone (no local test split, no augmentation): what FedConcat's client
        handlers read, built by a user's own ClientApp. `y_train` holds class indices in
        [0, num_classes); `normalization` None feeds the inputs to the model unchanged."""
        return cls(x_train, y_train, x_train[:0], y_train[:0], num_classes, normalization or _unchanged, None)

    def label_counts(self) -> np.ndarray:
        """How many training samples of each class this client holds."""
        return np.bincount(self.y_train.numpy(), minlength=self.num_classes)


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


@lru_cache(maxsize=4)
def _partitions(config: RunConfig, num_partitions: int) -> tuple[np.ndarray, ...]:
    data = load_data(config)
    return tuple(
        partition_indices(
            data.y_train.numpy(),
            num_partitions,
            config.partition,
            alpha=config.alpha,
            classes_per_client=config.classes_per_client,
            min_partition_size=config.min_partition_size,
            seed=config.seed,
            writers=data.train_writers,
        )
    )


def load_client_data(config: RunConfig, partition_id: int, num_partitions: int) -> ClientData:
    """The data of client `partition_id` out of `num_partitions` (deterministic from seed)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id must be in [0, {num_partitions}), got {partition_id}")
    data = load_data(config)
    indices = _partitions(config, num_partitions)[partition_id]
    train_idx, test_idx = local_split(indices, config.local_test_fraction, config.seed, partition_id)
    return ClientData(
        x_train=data.x_train[train_idx],
        y_train=data.y_train[train_idx],
        x_test=data.x_train[test_idx],
        y_test=data.y_train[test_idx],
        num_classes=data.num_classes,
        normalization=Normalization(data.mean, data.std),
        augmentation=train_augmentation(config.dataset),
    )


def check_fits_data(config: RunConfig, data: LoadedData) -> None:
    """Raise ConfigError, naming the key, for values that only the loaded dataset can refute."""
    if config.partition == "classes" and config.classes_per_client > data.num_classes:
        raise ConfigError(
            f"classes-per-client={config.classes_per_client} exceeds the {data.num_classes} classes of "
            f"dataset='{config.dataset}'"
        )
    try:
        with torch.random.fork_rng(devices=[]):  # the probe must not move the run's seeded generator
            make_model(config, data)
    except ValueError as error:
        raise ConfigError(
            f"model='{config.model}' does not fit dataset='{config.dataset}' "
            f"(inputs {tuple(data.input_shape)}): {error}"
        ) from None


@dataclass
class ServerEnv:
    """The server's view: dataset, model factory, device and the global evaluation set.

    `eval_x`/`eval_y` start as the dataset's test split; FedSeq removes its public exemplars
    from them (`exclude_from_evaluation`) so accuracy is never measured on data it used.
    """

    config: RunConfig
    data: LoadedData
    device: torch.device
    eval_x: torch.Tensor = field(init=False)
    eval_y: torch.Tensor = field(init=False)
    _concat_features: FeatureCache = field(init=False, default_factory=FeatureCache)

    def __post_init__(self) -> None:
        self.eval_x, self.eval_y = self.data.x_test, self.data.y_test

    @classmethod
    def from_config(cls, config: RunConfig) -> ServerEnv:
        """Load the dataset, check the keys that depend on it, pick the device named by the run config."""
        data = load_data(config)
        check_fits_data(config, data)
        return cls(config=config, data=data, device=pick_device(config.device))

    @property
    def num_classes(self) -> int:
        """Number of classes of the dataset."""
        return self.data.num_classes

    @property
    def normalization(self) -> Normalization:
        """The normalization every model input goes through."""
        return Normalization(self.data.mean, self.data.std)

    def make_model(self) -> nn.Module:
        """A fresh model of the run's architecture (seed torch first for reproducible weights)."""
        return make_model(self.config, self.data)

    def exclude_from_evaluation(self, test_indices: np.ndarray) -> None:
        """Drop these indices of the dataset's test split from the evaluation set."""
        keep = np.setdiff1d(np.arange(len(self.data.y_test)), np.asarray(test_indices))
        self.eval_x, self.eval_y = self.data.x_test[keep], self.data.y_test[keep]

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """(loss, accuracy) of `model` on the evaluation set.

        A `ConcatModel` (FedConcat) is evaluated as its head on the evaluation set's features,
        computed once per set of encoders (`FeatureCache`): the same figures, without K encoder
        passes in every classifier round.
        """
        if isinstance(model, ConcatModel):
            features = self._concat_features.features(model, self.eval_x, self.normalization, self.device)
            return evaluate(model.classifier, features, self.eval_y, normalization=None, device=self.device)
        return evaluate(model, self.eval_x, self.eval_y, normalization=self.normalization, device=self.device)
