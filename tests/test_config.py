"""RunConfig: pyproject defaults match the dataclass, validation names the key, coercion."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
import torch

from concatfl.config import ConfigError, RunConfig, known_keys
from concatfl.launch import parse_overrides
from concatfl.runtime import ServerEnv

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _pyproject_defaults() -> dict:
    with PYPROJECT.open("rb") as handle:
        return tomllib.load(handle)["tool"]["flwr"]["app"]["config"]


def _dataclass_defaults() -> dict:
    return {field.name.replace("_", "-"): field.default for field in dataclasses.fields(RunConfig)}


def test_every_pyproject_key_is_a_runconfig_field_with_the_same_default():
    declared, fields = _pyproject_defaults(), _dataclass_defaults()
    for key, value in declared.items():
        assert key in fields, f"pyproject key {key!r} missing from RunConfig"
        assert fields[key] == value and type(fields[key]) is type(value), key


def test_every_runconfig_field_is_declared_in_pyproject():
    assert set(_dataclass_defaults()) == set(_pyproject_defaults())
    assert set(known_keys()) == set(_pyproject_defaults())


def test_pyproject_defaults_validate_and_equal_the_dataclass_defaults():
    config = RunConfig.from_mapping(_pyproject_defaults())
    assert config == RunConfig()
    RunConfig().validate()


def test_empty_mapping_gives_the_defaults():
    assert RunConfig.from_mapping({}) == RunConfig()


INVALID = [
    ({"strategy": "fedfoo"}, "strategy"),
    ({"dataset": "imagenet"}, "dataset"),
    ({"partition": "shards"}, "partition"),
    ({"model": "vit"}, "model"),
    ({"device": "tpu"}, "device"),
    ({"cifar100-labels": "medium"}, "cifar100-labels"),
    ({"alpha": -0.1}, "alpha"),
    ({"classes-per-client": 0}, "classes-per-client"),
    ({"min-partition-size": 0}, "min-partition-size"),
    ({"local-test-fraction": 1.0}, "local-test-fraction"),
    ({"local-test-fraction": -0.1}, "local-test-fraction"),
    ({"num-server-rounds": 0}, "num-server-rounds"),
    ({"fraction-train": 0.0}, "fraction-train"),
    ({"fraction-train": 1.5}, "fraction-train"),
    ({"fraction-evaluate": 1.01}, "fraction-evaluate"),
    ({"fraction-evaluate": -0.5}, "fraction-evaluate"),
    ({"min-available-nodes": 0}, "min-available-nodes"),
    ({"round-timeout": -1.0}, "round-timeout"),
    ({"local-epochs": 0}, "local-epochs"),
    ({"batch-size": 0}, "batch-size"),
    ({"batch-size": -4}, "batch-size"),
    ({"lr": 0.0}, "lr"),
    ({"lr": -0.01}, "lr"),
    ({"momentum": -0.9}, "momentum"),
    ({"weight-decay": -1e-4}, "weight-decay"),
    ({"proximal-mu": -0.1}, "proximal-mu"),
    ({"fedcat-k": 1}, "fedcat-k"),
    ({"fedcat-k": -2}, "fedcat-k"),
    ({"fedcat-lambda": 0}, "fedcat-lambda"),
    ({"fedcat-epsilon": 1.5}, "fedcat-epsilon"),
    ({"fedcat-selection": "best"}, "fedcat-selection"),
    ({"fedcat-hop-step": "sized"}, "fedcat-hop-step"),
    ({"fedseq-hop-step": "size"}, "fedseq-hop-step"),
    ({"fedseq-approximator": "knn"}, "fedseq-approximator"),
    ({"fedseq-metric": "kl", "fedseq-approximator": "clf"}, "fedseq-metric"),
    ({"fedseq-metric": "gini", "fedseq-approximator": "clf"}, "fedseq-metric"),
    ({"fedseq-grouping": "spectral"}, "fedseq-grouping"),
    ({"fedseq-min-samples": 0}, "fedseq-min-samples"),
    ({"fedconcat-clusters": "x"}, "fedconcat-clusters"),
    ({"fedconcat-clusters": "0"}, "fedconcat-clusters"),
    ({"fedconcat-clusters": "-3"}, "fedconcat-clusters"),
    ({"fedconcat-dp-epsilon": -1.0}, "fedconcat-dp-epsilon"),
    ({"fedconcat-dp-epsilon": 1.0, "strategy": "fedconcat-id"}, "fedconcat-dp-epsilon"),
    ({"fedconcat-dp-epsilon": 1.0, "strategy": "fedavg"}, "fedconcat-dp-epsilon"),
    ({"fedconcat-classifier-steps": 0}, "fedconcat-classifier-steps"),
    ({"partition": "natural", "dataset": "digits"}, "partition"),
    ({"learning-rate": 0.1}, "learning-rate"),
    ({"lr": "abc"}, "lr"),
    ({"local-epochs": "two"}, "local-epochs"),
    ({"local-epochs": 1.5}, "local-epochs"),
    ({"download": "yes"}, "download"),
    ({"download": 1}, "download"),
    ({"seed": True}, "seed"),
    ({"update-clip": 0.5}, "update-clip"),
    ({"weight-clip": -1.0}, "weight-clip"),
    ({"aggregation": "mode"}, "aggregation"),
    ({"aggregation": "median", "strategy": "fedcat"}, "aggregation"),
    ({"aggregation-trim": 0.5}, "aggregation-trim"),
    ({"aggregation-byzantine": -1}, "aggregation-byzantine"),
    ({"fuzz-share": 1.5}, "fuzz-share"),
    ({"fuzz-kinds": "nan,bogus"}, "fuzz-kinds"),
]


@pytest.mark.parametrize(("values", "key"), INVALID, ids=[f"{k}={list(v.values())}" for v, k in INVALID])
def test_invalid_value_raises_configerror_naming_the_key(values, key):
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_mapping(values)
    assert key in str(caught.value)


def test_a_distribution_metric_is_only_checked_where_greedy_grouping_uses_it():
    for grouping in ("kmeans", "random"):
        config = RunConfig.from_mapping({"fedseq-approximator": "clf", "fedseq-grouping": grouping})
        assert config.fedseq_metric == "kl"


@pytest.mark.parametrize(
    ("values", "key"),
    [({"model": "lenet5"}, "model='lenet5'"), ({"partition": "classes", "classes-per-client": 11}, "classes-per-client")],
)
def test_values_the_dataset_refutes_fail_when_the_server_loads_it(values, key):
    config = RunConfig.from_mapping(values)  # digits: 8x8 inputs, 10 classes
    with pytest.raises(ConfigError, match=key):
        ServerEnv.from_config(config)


def test_checking_the_model_against_the_data_leaves_the_seeded_generator_alone():
    torch.manual_seed(0)
    ServerEnv.from_config(RunConfig())
    after_check = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after_check, torch.rand(3))


def test_configerror_is_a_valueerror():
    assert issubclass(ConfigError, ValueError)


def test_unknown_key_message_lists_known_keys():
    with pytest.raises(ConfigError, match="unknown run-config key 'learning-rate'") as caught:
        RunConfig.from_mapping({"learning-rate": 0.1})
    assert "'lr'" in str(caught.value)


def test_valid_edge_values_pass():
    config = RunConfig.from_mapping(
        {
            "fraction-train": 1.0,
            "fraction-evaluate": 0.0,
            "alpha": 0.0,
            "fedcat-k": 2,
            "fedconcat-clusters": "auto",
            "strategy": "fedprox",
            "proximal-mu": 0.01,
            "partition": "natural",
            "dataset": "femnist",
            "fedseq-approximator": "clf",
            "fedseq-metric": "cosine",
            "round-timeout": 0.0,
        }
    )
    assert config.fedconcat_num_clusters is None
    assert config.timeout is None


def test_string_forms_coerce_to_the_field_types():
    config = RunConfig.from_mapping(
        {"download": "true", "fedcat-concat": "False", "local-epochs": "3", "lr": "0.5", "alpha": "0",
         "seed": "-1", "fedconcat-clusters": 7}
    )
    assert config.download is True and config.fedcat_concat is False
    assert config.local_epochs == 3 and type(config.local_epochs) is int
    assert config.lr == 0.5 and type(config.lr) is float
    assert config.alpha == 0.0 and type(config.alpha) is float
    assert config.seed == -1
    assert config.fedconcat_clusters == "7" and config.fedconcat_num_clusters == 7


def test_numeric_forms_coerce():
    config = RunConfig.from_mapping({"lr": 1, "local-epochs": 2.0, "round-timeout": 30})
    assert type(config.lr) is float and config.lr == 1.0
    assert type(config.local_epochs) is int and config.local_epochs == 2
    assert config.timeout == 30.0


def test_as_dict_has_kebab_keys_and_round_trips():
    config = RunConfig.from_mapping({"strategy": "fedprox", "proximal-mu": 0.1, "lr": "0.2", "fedcat-k": 3})
    as_dict = config.as_dict()
    assert set(as_dict) == set(known_keys())
    assert as_dict["proximal-mu"] == 0.1 and as_dict["fedcat-k"] == 3
    assert RunConfig.from_mapping(as_dict) == config


def test_runconfig_is_frozen_and_hashable():
    config = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0  # type: ignore[misc]
    assert hash(config) == hash(RunConfig())


@pytest.mark.parametrize("key", ["alpha", "momentum", "weight-decay", "proximal-mu", "round-timeout",
                                 "fedconcat-dp-epsilon"])
def test_nan_float_value_raises_configerror_naming_the_key(key):
    # _at_least uses `value < low`, which is False for NaN, so NaN must be rejected explicitly.
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_mapping({key: "nan"})
    assert key in str(caught.value)


def test_malformed_int_string_raises_configerror_not_bare_valueerror():
    # "--3".lstrip("-") is "3" (isdigit), then int("--3") fails with a ValueError without the key.
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_mapping({"local-epochs": "--3"})
    assert "local-epochs" in str(caught.value)


def test_launcher_overrides_parse_toml_values_and_quoted_spaces():
    assert parse_overrides("lr=0.05 strategy='fedcat' data-dir='/data/my sets' fedcat-concat=false") == {
        "lr": 0.05, "strategy": "fedcat", "data-dir": "/data/my sets", "fedcat-concat": False,
    }
    assert parse_overrides("") == {}


@pytest.mark.parametrize("text", ["lr", "lr=0.1 =3", "data-dir='/unclosed"])
def test_launcher_rejects_overrides_it_cannot_read(text):
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(text)
