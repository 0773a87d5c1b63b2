"""Every run-config key: its type, allowed values and validation, turned into one typed object.

Flower passes the run config as a flat dict of kebab-case keys (declared with their defaults in
pyproject.toml). `RunConfig.from_mapping` checks every value before anything trains and fails
with a `ConfigError` that names the key, the value and what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .core.bounds import DEFAULT_UPDATE_CLIP, DEFAULT_WEIGHT_CLIP
from .fuzz import parse_kinds

STRATEGIES = ("fedavg", "fedprox", "scaffold", "fedcat", "fedseq", "fedseq-inter", "fedconcat", "fedconcat-id")
LOCAL_OBJECTIVES = ("sgd", "fedprox", "feddyn", "moon", "fedrs", "fedlc")
DATASETS = ("digits", "mnist", "fmnist", "cifar10", "cifar100", "svhn", "femnist")
PARTITIONS = ("iid", "dirichlet", "classes", "natural")
MODELS = ("auto", "mlp", "mcmahan-cnn", "simple-cnn", "lenet5", "vgg9", "resnet18")
DEVICES = ("auto", "cpu", "cuda")
OPTIMIZERS = ("sgd", "adam")  # the clients' local optimizer (concatfl.training.train)
FEDSEQ_DISTRIBUTION_METRICS = ("kl", "wasserstein", "gini")
AGGREGATIONS = ("mean", "median", "trimmed-mean", "krum", "multi-krum")
SEQUENTIAL_STRATEGIES = ("fedcat", "fedseq", "fedseq-inter")
# FedProx's μ where FedProx is asked for (strategy or local objective) and proximal-mu is left at
# 0: the default of `concatfl.strategies.FedProx` (Li et al.'s smallest value).
FEDPROX_DEFAULT_MU = 0.01
# Seconds a hop waits for its replies, in the run config and in every strategy's `start()`.
DEFAULT_ROUND_TIMEOUT = 600.0


class ConfigError(ValueError):
    """A run-config value is invalid; the message names the key."""


@dataclass(frozen=True)
class RunConfig:
    """The validated run config. Field names are the keys with '-' turned into '_'.

    The keys come in groups by the part of a run they configure; each group's validation
    (`_validate_<group>`) stands right below it, and `validate` runs them in order.
    """

    # ------------------------------------------------------------------ the strategy
    strategy: str = "fedavg"

    # ------------------------------------------------------------------ data and partition
    dataset: str = "digits"
    data_dir: str = ""
    download: bool = False
    cifar100_labels: str = "fine"
    partition: str = "iid"
    alpha: float = 0.5
    classes_per_client: int = 2
    min_partition_size: int = 10
    local_test_fraction: float = 0.2

    def _validate_data(self) -> None:
        _choice("dataset", self.dataset, DATASETS)
        _choice("cifar100-labels", self.cifar100_labels, ("fine", "coarse"))
        _choice("partition", self.partition, PARTITIONS)
        if self.partition == "natural" and self.dataset != "femnist":
            raise ConfigError("partition='natural' (one client per group of writers) needs dataset='femnist'")
        _at_least("alpha", self.alpha, 0.0)
        _at_least("classes-per-client", self.classes_per_client, 1)
        _at_least("min-partition-size", self.min_partition_size, 1)
        _open_interval("local-test-fraction", self.local_test_fraction, 0.0, 1.0, closed_low=True)

    # ------------------------------------------------------------------ the federation and its rounds
    num_server_rounds: int = 20
    fraction_train: float = 1.0
    fraction_evaluate: float = 0.0
    min_available_nodes: int = 2
    expected_nodes: int = 0
    start_settle: float = 3.0
    start_wait: float = 120.0
    round_timeout: float = DEFAULT_ROUND_TIMEOUT

    def _validate_federation(self) -> None:
        _at_least("num-server-rounds", self.num_server_rounds, 1)
        _open_interval("fraction-train", self.fraction_train, 0.0, 1.0, closed_high=True)
        _open_interval("fraction-evaluate", self.fraction_evaluate, 0.0, 1.0, closed_low=True, closed_high=True)
        _at_least("min-available-nodes", self.min_available_nodes, 1)
        _at_least("expected-nodes", self.expected_nodes, 0)
        if 0 < self.expected_nodes < self.min_available_nodes:
            raise ConfigError(
                f"expected-nodes={self.expected_nodes} is below min-available-nodes={self.min_available_nodes}: "
                "the run starts with at least min-available-nodes; set expected-nodes to 0 or to at least that"
            )
        _at_least("start-settle", self.start_settle, 0.0)
        _at_least("start-wait", self.start_wait, 0.0)
        _at_least("round-timeout", self.round_timeout, 0.0)

    # ------------------------------------------------------------------ the model and local training
    model: str = "auto"
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.1
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "auto"

    def _validate_training(self) -> None:
        _choice("model", self.model, MODELS)
        _choice("device", self.device, DEVICES)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _at_least("local-epochs", self.local_epochs, 1)
        _at_least("batch-size", self.batch_size, 1)
        _open_interval("lr", self.lr, 0.0, float("inf"))
        _at_least("momentum", self.momentum, 0.0)
        _at_least("weight-decay", self.weight_decay, 0.0)

    # ------------------------------------------------------------------ local objectives and SCAFFOLD
    proximal_mu: float = 0.0
    local_objective: str = "sgd"
    scaffold_server_lr: float = 1.0
    feddyn_alpha: float = 0.01
    moon_tau: float = 0.5
    moon_mu: float = 1.0
    fedrs_alpha: float = 0.5
    fedlc_tau: float = 1.0

    def _validate_objective(self) -> None:
        """The objectives' values, and no `local-objective` / `strategy` / `proximal-mu` combination
        that makes no sense."""
        _at_least("proximal-mu", self.proximal_mu, 0.0)
        _open_interval("scaffold-server-lr", self.scaffold_server_lr, 0.0, float("inf"))
        _open_interval("feddyn-alpha", self.feddyn_alpha, 0.0, float("inf"))
        _open_interval("moon-tau", self.moon_tau, 0.0, float("inf"))
        _at_least("moon-mu", self.moon_mu, 0.0)
        _open_interval("fedrs-alpha", self.fedrs_alpha, 0.0, 1.0, closed_low=True, closed_high=True)
        _at_least("fedlc-tau", self.fedlc_tau, 0.0)
        objective = self.local_objective
        _choice("local-objective", objective, LOCAL_OBJECTIVES)
        if self.strategy == "scaffold" and self.optimizer != "sgd":
            raise ConfigError(
                "strategy='scaffold' computes the clients' control variates from plain SGD steps (option II); "
                f"optimizer={self.optimizer!r} takes other steps: use optimizer='sgd'"
            )
        if self.strategy == "scaffold" and (objective != "sgd" or self.proximal_mu > 0):
            raise ConfigError(
                "strategy='scaffold' corrects the local gradients with its control variates and needs "
                f"local-objective='sgd' and proximal-mu=0 (got local-objective={objective!r}, "
                f"proximal-mu={self.proximal_mu})"
            )
        if self.strategy == "fedprox" and objective not in ("sgd", "fedprox"):
            raise ConfigError(
                f"strategy='fedprox' is FedAvg with local-objective='fedprox'; it does not combine with "
                f"local-objective={objective!r} (use strategy='fedavg')"
            )
        if objective == "fedprox" and self.proximal_mu <= 0:
            raise ConfigError("local-objective='fedprox' needs proximal-mu > 0 (the weight of the proximal term)")
        if self.proximal_mu > 0 and objective not in ("sgd", "fedprox"):
            raise ConfigError(
                f"proximal-mu > 0 adds FedProx's term, which local-objective={objective!r} does not combine "
                "with; set proximal-mu=0"
            )
        if objective in ("fedrs", "fedlc") and self.strategy == "fedconcat-id":
            raise ConfigError(
                f"strategy='fedconcat-id' infers label distributions from the label bias of locally trained "
                f"models, which local-objective={objective!r} removes; use strategy='fedconcat'"
            )

    # ------------------------------------------------------------------ bounds, aggregation, faults, privacy
    update_clip: float = DEFAULT_UPDATE_CLIP
    weight_clip: float = DEFAULT_WEIGHT_CLIP
    history_check: bool = True
    aggregation: str = "mean"
    aggregation_trim: float = 0.2
    aggregation_byzantine: int = 1
    fuzz_share: float = 0.0
    fuzz_kinds: str = "all"
    fuzz_seed: int = 0
    fuzz_log: str = ""
    local_dp_epsilon: float = 0.0
    local_dp_delta: float = 1e-5
    local_dp_clip: float = 1.0

    def _validate_guard(self) -> None:
        """The reply bounds, the aggregation rule and the fuzzing mod's keys."""
        for key, value in (("update-clip", self.update_clip), ("weight-clip", self.weight_clip)):
            if not (value == 0 or value >= 1):
                raise ConfigError(f"run-config key '{key}' must be 0 (off) or >= 1, got {value}")
        _choice("aggregation", self.aggregation, AGGREGATIONS)
        if self.aggregation != "mean" and self.strategy in SEQUENTIAL_STRATEGIES:
            raise ConfigError(
                f"run-config key 'aggregation' ({self.aggregation!r}) combines the models of one round; "
                f"strategy={self.strategy!r} trains models in chains and needs aggregation='mean' "
                "(its replies are bounded by update-clip)"
            )
        _open_interval("aggregation-trim", self.aggregation_trim, 0.0, 0.5, closed_low=True)
        _at_least("aggregation-byzantine", self.aggregation_byzantine, 0)
        _open_interval("fuzz-share", self.fuzz_share, 0.0, 1.0, closed_low=True, closed_high=True)
        _at_least("local-dp-epsilon", self.local_dp_epsilon, 0.0)
        _open_interval("local-dp-delta", self.local_dp_delta, 0.0, 1.0)
        _open_interval("local-dp-clip", self.local_dp_clip, 0.0, float("inf"))
        if self.local_dp_epsilon > 0 and self.strategy == "scaffold":
            raise ConfigError(
                "local-dp-epsilon puts Flower's LocalDpMod on the clients, which takes one ArrayRecord; "
                "strategy='scaffold' sends two (the model and the control variate): use strategy='fedavg' or "
                "'fedprox' with local DP (docs/privacy.md)"
            )
        try:
            parse_kinds(self.fuzz_kinds)
        except ValueError as error:
            raise ConfigError(f"run-config key 'fuzz-kinds': {error}") from None

    # ------------------------------------------------------------------ FedCat
    fedcat_k: int = 0
    fedcat_lambda: int = 2
    fedcat_epsilon: float = 0.5
    fedcat_selection: str = "grouped-count"
    fedcat_concat: bool = True
    fedcat_hop_step: str = "0.5"
    fedcat_hop_clip: float = 1.5

    def _validate_fedcat(self) -> None:
        _choice("fedcat-selection", self.fedcat_selection, ("grouped-count", "random"))
        _at_least("fedcat-k", self.fedcat_k, 0)
        if self.fedcat_k == 1:
            raise ConfigError("fedcat-k must be 0 (auto: round(fraction-train x N), at least 2) or >= 2")
        _at_least("fedcat-lambda", self.fedcat_lambda, 1)
        _open_interval("fedcat-epsilon", self.fedcat_epsilon, 0.0, 1.0, closed_low=True, closed_high=True)
        _hop_step("fedcat-hop-step", self.fedcat_hop_step)
        if self.fedcat_hop_step == "sized":
            raise ConfigError("run-config key 'fedcat-hop-step' is 'sized', FedSeq's rule, not measured for FedCat; "
                              "use a number in (0, 1], 'even', 'mean' or 'auto'")
        _at_least("fedcat-hop-clip", self.fedcat_hop_clip, 0.0)

    # ------------------------------------------------------------------ FedSeq and FedSeqInter
    fedseq_pretrain_epochs: int = 10
    fedseq_approximator: str = "conf"
    fedseq_exemplars_per_class: int = 10
    fedseq_conf_normalize: str = "sum"
    fedseq_clf_layers: str = "all"
    fedseq_metric: str = "kl"
    fedseq_grouping: str = "greedy"
    fedseq_greedy_merge: str = "half"
    fedseq_min_samples: int = 800
    fedseq_max_clients: int = 11
    fedseq_superclient_epochs: int = 1
    fedseq_hop_step: str = "sized"
    fedseq_hop_clip: float = 1.5
    fedseq_witness: bool = True
    report_label_counts: bool = False

    def _validate_fedseq(self) -> None:
        _choice("fedseq-approximator", self.fedseq_approximator, ("conf", "clf"))
        _choice("fedseq-conf-normalize", self.fedseq_conf_normalize, ("sum", "softmax"))
        _choice("fedseq-clf-layers", self.fedseq_clf_layers, ("all", "last2", "last"))
        _choice("fedseq-metric", self.fedseq_metric, ("kl", "cosine", "euclidean", "wasserstein", "gini"))
        _choice("fedseq-grouping", self.fedseq_grouping, ("greedy", "kmeans", "random"))
        _choice("fedseq-greedy-merge", self.fedseq_greedy_merge, ("half", "weighted"))
        _hop_step("fedseq-hop-step", self.fedseq_hop_step)
        _at_least("fedseq-hop-clip", self.fedseq_hop_clip, 0.0)
        _at_least("fedseq-pretrain-epochs", self.fedseq_pretrain_epochs, 1)
        _at_least("fedseq-exemplars-per-class", self.fedseq_exemplars_per_class, 1)
        _at_least("fedseq-min-samples", self.fedseq_min_samples, 1)
        _at_least("fedseq-max-clients", self.fedseq_max_clients, 1)
        _at_least("fedseq-superclient-epochs", self.fedseq_superclient_epochs, 1)
        if (
            self.fedseq_grouping == "greedy"
            and self.fedseq_metric in FEDSEQ_DISTRIBUTION_METRICS
            and self.fedseq_approximator != "conf"
        ):
            raise ConfigError(
                f"fedseq-metric='{self.fedseq_metric}' compares distributions and needs "
                "fedseq-approximator='conf'; with 'clf' and greedy grouping use fedseq-metric='cosine' or "
                "'euclidean' (kmeans and random grouping use no metric)"
            )

    # ------------------------------------------------------------------ FedConcat and FedConcat-ID
    fedconcat_clusters: str = "5"
    fedconcat_balanced: bool = False
    fedconcat_dp_epsilon: float = 0.0
    fedconcat_label_check: bool = True
    fedconcat_id_samples: int = 10000
    fedconcat_encoder_rounds: int = 10
    fedconcat_classifier_rounds: int = 20
    fedconcat_classifier_steps: int = 3
    fedconcat_init_classifier: bool = False
    fedconcat_head_memory: bool = True
    fedconcat_head_check: bool = True

    def _validate_fedconcat(self) -> None:
        if self.fedconcat_clusters != "auto":
            try:
                clusters = int(self.fedconcat_clusters)
            except ValueError:
                raise ConfigError(
                    f"fedconcat-clusters must be a positive integer or 'auto', got {self.fedconcat_clusters!r}"
                ) from None
            _at_least("fedconcat-clusters", clusters, 1)
        _at_least("fedconcat-dp-epsilon", self.fedconcat_dp_epsilon, 0.0)
        if self.fedconcat_dp_epsilon > 0 and self.strategy != "fedconcat":
            raise ConfigError(
                "fedconcat-dp-epsilon adds Laplace noise to the label distributions clients report in "
                f"strategy='fedconcat'; strategy={self.strategy!r} reports none (set it to 0)"
            )
        _at_least("fedconcat-id-samples", self.fedconcat_id_samples, 1)
        _at_least("fedconcat-encoder-rounds", self.fedconcat_encoder_rounds, 1)
        _at_least("fedconcat-classifier-rounds", self.fedconcat_classifier_rounds, 1)
        _at_least("fedconcat-classifier-steps", self.fedconcat_classifier_steps, 1)

    # ------------------------------------------------------------------ outputs
    output_dir: str = "outputs"
    resume: bool = False

    # ------------------------------------------------------------------ the whole
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        """Build and validate from Flower's run config (kebab-case keys); unknown keys fail.

        `proximal-mu` = 0 with strategy or local objective 'fedprox' becomes FedProx's default μ
        (FEDPROX_DEFAULT_MU), as `FedProx()` has it.
        """
        fields = {field.name: field for field in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ConfigError(f"unknown run-config key '{key}'; known keys: {sorted(known_keys())}")
            kwargs[name] = _coerce(key, value, fields[name].type)
        wants_fedprox = "fedprox" in (kwargs.get("strategy"), kwargs.get("local_objective"))
        if wants_fedprox and kwargs.get("proximal_mu", 0.0) == 0.0:
            kwargs["proximal_mu"] = FEDPROX_DEFAULT_MU  # one default for the key and the class
        config = cls(**kwargs)
        config.validate()
        return config

    def as_dict(self) -> dict[str, Any]:
        """The config with kebab-case keys (as written into metrics.json)."""
        return {key.replace("_", "-"): value for key, value in dataclasses.asdict(self).items()}

    @property
    def timeout(self) -> float | None:
        """Per-hop reply timeout in seconds; `round-timeout = 0` means wait forever."""
        return self.round_timeout if self.round_timeout > 0 else None

    @property
    def fedconcat_num_clusters(self) -> int | None:
        """The number of FedConcat clusters, or None for `auto` (elbow rule)."""
        return None if self.fedconcat_clusters == "auto" else int(self.fedconcat_clusters)

    @property
    def checks_update_history(self) -> bool:
        """`history-check`, except under FedDyn's objective: its linear term corrects each client
        toward the federation, so an honest node's successive updates need not agree (ten clean
        runs of the robustness bench: 207 of their 2,000 replies would have been rejected); and
        except with `local-dp-epsilon` > 0: updates drowned in the clients' noise share no
        direction (docs/privacy.md)."""
        return self.history_check and self.local_objective != "feddyn" and self.local_dp_epsilon == 0

    def validate(self) -> None:
        """Check every value, group by group; raise ConfigError naming the first bad key."""
        _choice("strategy", self.strategy, STRATEGIES)
        self._validate_data()
        self._validate_federation()
        self._validate_training()
        self._validate_objective()
        self._validate_guard()
        self._validate_fedcat()
        self._validate_fedseq()
        self._validate_fedconcat()


def known_keys() -> list[str]:
    """All run-config keys, kebab-case."""
    return [field.name.replace("_", "-") for field in dataclasses.fields(RunConfig)]


def _coerce(key: str, value: Any, kind: str) -> Any:
    """Turn a TOML/CLI value into the field's type, or fail naming the key."""
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return int(value)
    elif kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return float(value)
    elif kind == "str":
        return str(value)
    raise ConfigError(f"run-config key '{key}' must be a {kind}, got {value!r}")


HOP_RULES = ("sized", "even", "mean", "auto")  # the hop steps given by name (concatfl.strategies.sequential)


def parse_hop_step(value: str) -> float | str:
    """A validated `…-hop-step` value as a strategy takes it: a rule's name or a number."""
    return value if value in HOP_RULES else float(value)


def _hop_step(key: str, value: str) -> None:
    if value in HOP_RULES:
        return
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(
            f"run-config key '{key}' must be one of {', '.join(HOP_RULES)} or a number in (0, 1], got {value!r}"
        ) from None
    _open_interval(key, number, 0.0, 1.0, closed_high=True)


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"run-config key '{key}' is {value!r}; allowed values: {', '.join(allowed)}")


def _at_least(key: str, value: float, low: float) -> None:
    if not value >= low:  # also rejects NaN
        raise ConfigError(f"run-config key '{key}' must be >= {low}, got {value}")


def _open_interval(
    key: str, value: float, low: float, high: float, closed_low: bool = False, closed_high: bool = False
) -> None:
    above = value >= low if closed_low else value > low
    below = value <= high if closed_high else value < high
    if not (above and below):
        left, right = "[" if closed_low else "(", "]" if closed_high else ")"
        raise ConfigError(f"run-config key '{key}' must be in {left}{low}, {high}{right}, got {value}")
