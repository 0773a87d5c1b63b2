"""concatfl's ClientApp called in-process with real Flower Messages and Contexts (digits)."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from concatfl.client_app import app
from concatfl.config import RunConfig
from concatfl.runtime import load_client_data, load_data, make_model
from concatfl.training import evaluate

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
with PYPROJECT.open("rb") as _handle:
    DEFAULTS = tomllib.load(_handle)["tool"]["flwr"]["app"]["config"]
RUN_CONFIG = {**DEFAULTS, "device": "cpu", "batch-size": 64, "lr": 0.05, "seed": 3}
NODE_CONFIG = {"partition-id": 0, "num-partitions": 4}


def _context(run_config: dict | None = None, node_config: dict | None = None) -> Context:
    return Context(
        run_id=1,
        node_id=1,
        node_config=NODE_CONFIG if node_config is None else node_config,
        state=RecordDict(),
        run_config=RUN_CONFIG if run_config is None else run_config,
    )


def _initial_arrays() -> ArrayRecord:
    config = RunConfig.from_mapping(RUN_CONFIG)
    torch.manual_seed(0)
    return ArrayRecord(make_model(config, load_data(config)).state_dict())


INITIAL = _initial_arrays()


def _numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: value.numpy() for key, value in record.items()}


def _train(config: dict | None = None, context: Context | None = None) -> Message:
    content = RecordDict({"arrays": INITIAL})
    if config is not None:
        content["config"] = ConfigRecord(config)
    message = Message(content, dst_node_id=1, message_type=MessageType.TRAIN)
    return app(message, context or _context())


def _distance(record: ArrayRecord) -> float:
    sent = _numpy(INITIAL)
    return float(np.sqrt(sum(((value - sent[key]) ** 2).sum() for key, value in _numpy(record).items())))


def _local_data():
    return load_client_data(RunConfig.from_mapping(RUN_CONFIG), 0, 4)


def test_train_reply_has_same_keys_shapes_dtypes_and_changed_values():
    reply = _train({"server-round": 1})
    assert not reply.has_error()
    assert reply.metadata.message_type == MessageType.TRAIN
    got, sent = _numpy(reply.content.array_records["arrays"]), _numpy(INITIAL)
    assert list(got) == list(sent)
    for key in sent:
        assert got[key].shape == sent[key].shape and got[key].dtype == sent[key].dtype
        assert np.isfinite(got[key]).all()
    assert any(not np.array_equal(got[key], sent[key]) for key in sent)
    assert _distance(reply.content.array_records["arrays"]) > 0


def test_train_metrics_num_examples_is_the_local_train_split_and_loss_finite():
    metrics = _train({"server-round": 1}).content.metric_records["metrics"]
    data = _local_data()
    assert metrics["num-examples"] == len(data.y_train) > 0
    assert math.isfinite(metrics["train-loss"]) and metrics["train-loss"] > 0
    assert _train({"server-round": 1, "local-epochs": 2}).content.metric_records["metrics"]["local-epochs"] == 2


def test_train_is_deterministic_for_the_same_round_and_partition():
    first = _numpy(_train({"server-round": 2}).content.array_records["arrays"])
    again = _numpy(_train({"server-round": 2}).content.array_records["arrays"])
    assert all(np.array_equal(first[key], again[key]) for key in first)


def test_a_later_pass_of_a_fedseq_chain_shuffles_differently():
    first = _numpy(_train({"server-round": 2, "chain-pass": 0}).content.array_records["arrays"])
    unmarked = _numpy(_train({"server-round": 2}).content.array_records["arrays"])
    second = _numpy(_train({"server-round": 2, "chain-pass": 1}).content.array_records["arrays"])
    assert all(np.array_equal(first[key], unmarked[key]) for key in first)
    assert any(not np.array_equal(first[key], second[key]) for key in first)


@pytest.mark.parametrize("override", [{"local-epochs": 3}, {"lr": 0.3}])
def test_message_config_overrides_change_the_result(override):
    base = _train({"server-round": 1}).content.array_records["arrays"]
    changed = _train({"server-round": 1, **override}).content.array_records["arrays"]
    assert any(not np.array_equal(a, b) for a, b in zip(_numpy(base).values(), _numpy(changed).values()))
    # more epochs / a larger step move the model further from what was sent
    assert _distance(changed) > _distance(base)


def test_missing_message_config_keys_fall_back_to_the_run_config():
    via_run_config = _train({"server-round": 1}, _context({**RUN_CONFIG, "lr": 0.2, "local-epochs": 2}))
    via_message = _train({"server-round": 1, "lr": 0.2, "local-epochs": 2})
    a, b = (_numpy(r.content.array_records["arrays"]) for r in (via_run_config, via_message))
    assert all(np.array_equal(a[key], b[key]) for key in a)


def test_large_proximal_mu_keeps_weights_closer_to_the_received_model():
    # lr·mu = 0.25 < 1 keeps the proximal step a contraction toward the received weights.
    free = _train({"server-round": 1, "local-epochs": 3, "proximal-mu": 0.0})
    prox = _train({"server-round": 1, "local-epochs": 3, "proximal-mu": 5.0})
    free_distance = _distance(free.content.array_records["arrays"])
    prox_distance = _distance(prox.content.array_records["arrays"])
    assert prox_distance < 0.5 * free_distance


def test_evaluate_reply_has_local_test_size_and_exact_accuracy():
    message = Message(RecordDict({"arrays": INITIAL}), dst_node_id=1, message_type=MessageType.EVALUATE)
    reply = app(message, _context())
    assert not reply.has_error() and reply.metadata.message_type == MessageType.EVALUATE
    assert "arrays" not in reply.content.array_records
    metrics = reply.content.metric_records["metrics"]
    data = _local_data()
    assert metrics["num-examples"] == len(data.y_test) > 0
    assert 0.0 <= metrics["accuracy"] <= 1.0 and math.isfinite(metrics["loss"])
    config = RunConfig.from_mapping(RUN_CONFIG)
    model = make_model(config, load_data(config))
    model.load_state_dict(INITIAL.to_torch_state_dict())
    loss, accuracy = evaluate(model, data.x_test, data.y_test, normalization=data.normalization,
                              device=torch.device("cpu"))
    assert metrics["accuracy"] == accuracy
    assert metrics["loss"] == pytest.approx(loss)


def test_trained_model_evaluates_better_than_the_initial_one():
    trained = _train({"server-round": 1, "local-epochs": 5, "lr": 0.1}).content.array_records["arrays"]
    accuracies = []
    for arrays in (INITIAL, trained):
        message = Message(RecordDict({"arrays": arrays}), dst_node_id=1, message_type=MessageType.EVALUATE)
        accuracies.append(app(message, _context()).content.metric_records["metrics"]["accuracy"])
    assert accuracies[1] > accuracies[0]


@pytest.mark.parametrize("node_config", [{}, {"partition-id": 0}, {"num-partitions": 4}])
def test_missing_node_config_raises_naming_the_node_config_flag(node_config):
    message = Message(RecordDict({"arrays": INITIAL}), dst_node_id=1, message_type=MessageType.EVALUATE)
    with pytest.raises(KeyError, match="--node-config"):
        app(message, _context(node_config=node_config))


def test_invalid_run_config_fails_before_training():
    with pytest.raises(ValueError, match="lr"):
        _train({"server-round": 1}, _context({**RUN_CONFIG, "lr": "abc"}))


def test_identity_query_reports_the_partition_id_without_loading_data():
    message = Message(
        RecordDict({"config": ConfigRecord({"query": "identity"})}), dst_node_id=1, message_type=MessageType.QUERY
    )
    # A data-dir that cannot be read proves no data is loaded for this answer.
    reply = app(message, _context(run_config={**RUN_CONFIG, "dataset": "mnist", "data-dir": "/nonexistent"},
                                  node_config={"partition-id": 3, "num-partitions": 4}))
    assert not reply.has_error()
    assert reply.content.metric_records["metrics"]["partition-id"] == 3
