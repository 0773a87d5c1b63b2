"""FedAvg / FedProx driven through a FakeGrid: exact aggregates, faults, sampling, config,
history, evaluation, and Flower's configure_train/aggregate_train hooks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from torch import nn

from concatfl.config import RunConfig
from concatfl.strategies import FedAvg, FedProx, build_strategy
from concatfl.strategies.fedavg import build, sample_count
from concatfl.strategies.common import Request, collect, message_bytes, to_messages, train_content
from tests.fakes import BIG_IDS, FakeGrid, reply_with

INITIAL = ArrayRecord(
    {"w": Array(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)), "b": Array(np.array([0.5], np.float32))}
)


def _numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: value.numpy() for key, value in record.items()}


def _offset(node: int) -> float:
    return float(BIG_IDS.index(node) + 1)  # node k of BIG_IDS adds k + 1


def _examples(node: int) -> int:
    return 10 * (BIG_IDS.index(node) + 1)


def _trained(message: Message, node: int) -> ArrayRecord:
    arrays = message.content.array_records["arrays"]
    return ArrayRecord({k: Array((v.numpy() + _offset(node)).astype(np.float32)) for k, v in arrays.items()})


def _good(node: int) -> Callable[[Message], Message]:
    def handle(message: Message) -> Message:
        if message.metadata.message_type == MessageType.EVALUATE:
            metrics = MetricRecord({"num-examples": _examples(node), "accuracy": _offset(node) / 10})
            return reply_with(message, RecordDict({"metrics": metrics}))
        metrics = MetricRecord({"num-examples": _examples(node), "train-loss": _offset(node)})
        return reply_with(message, RecordDict({"arrays": _trained(message, node), "metrics": metrics}))

    return handle


def _grid(nodes, faulty: dict | None = None) -> FakeGrid:
    return FakeGrid({node: (faulty or {}).get(node, _good(node)) for node in nodes})


def _expected_average(nodes) -> dict[str, np.ndarray]:
    weights = np.array([_examples(n) for n in nodes], np.float64)
    shift = float(np.dot(weights, [_offset(n) for n in nodes]) / weights.sum())
    return {k: (v + shift).astype(np.float32) for k, v in _numpy(INITIAL).items()}


def _assert_arrays(record: ArrayRecord, expected: dict[str, np.ndarray]) -> None:
    got = _numpy(record)
    assert set(got) == set(expected)
    for key in expected:
        assert got[key].dtype == expected[key].dtype
        np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=1e-6)


def _nan_reply(message: Message) -> Message:
    arrays = ArrayRecord({k: Array(np.full(v.shape, np.nan, np.float32))
                          for k, v in message.content.array_records["arrays"].items()})
    return reply_with(message, RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 5})}))


def _shape_reply(message: Message) -> Message:
    arrays = ArrayRecord({"w": Array(np.zeros((4,), np.float32)), "b": Array(np.zeros(1, np.float32))})
    return reply_with(message, RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 5})}))


def _million_times_reply(message: Message) -> Message:
    arrays = ArrayRecord({k: Array((v.numpy() * 1e6).astype(np.float32))
                          for k, v in message.content.array_records["arrays"].items()})
    return reply_with(message, RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 5})}))


def _error_reply(message: Message) -> Message:
    return Message(Error(code=1, reason="out of memory"), reply_to=message)


# ----------------------------------------------------------------------------- aggregation


def test_one_round_is_the_exact_num_examples_weighted_average():
    nodes = BIG_IDS[:3]
    result = FedAvg(seed=0).start(_grid(nodes), INITIAL, num_rounds=1)
    _assert_arrays(result.arrays, _expected_average(nodes))  # shift = (10+40+90)/60


def test_train_metrics_are_weighted_by_num_examples():
    nodes = BIG_IDS[:3]
    result = FedAvg(seed=0).start(_grid(nodes), INITIAL, num_rounds=1)
    assert result.train_metrics_clientapp[1]["train-loss"] == pytest.approx((10 * 1 + 20 * 2 + 30 * 3) / 60)


def test_two_rounds_compose():
    nodes = BIG_IDS[:2]
    result = FedAvg(seed=0).start(_grid(nodes), INITIAL, num_rounds=2)
    shift = (10 * 1 + 20 * 2) / 30
    _assert_arrays(result.arrays, {k: v + np.float32(2 * shift) for k, v in _numpy(INITIAL).items()})


@pytest.mark.parametrize("bad", [_nan_reply, _shape_reply, _million_times_reply, lambda m: None, _error_reply],
                         ids=["nan", "shape", "times-a-million", "missing", "error"])
def test_bad_reply_is_left_out_of_the_average(bad):
    nodes = BIG_IDS[:3]
    strategy = FedAvg(seed=0)
    result = strategy.start(_grid(nodes, {nodes[1]: bad}), INITIAL, num_rounds=1)
    _assert_arrays(result.arrays, _expected_average([nodes[0], nodes[2]]))
    hop = strategy.history[0]["hops"][0]
    assert [miss["node"] for miss in hop["misses"]] == [nodes[1]] and hop["replies"] == 2
    if bad is _million_times_reply:  # well-formed, but no update: rejected by the guard, not clipped
        assert hop["misses"][0]["reason"].startswith("rejected: update of length")
        assert "clipped" not in strategy.history[0]["guard"]
    assert strategy.history[0]["aggregated"] is True
    assert strategy.history[0]["membership"]["trained"] == 2


def test_all_replies_failing_keeps_the_model_and_skips_evaluation():
    nodes = BIG_IDS[:3]
    calls: list[int] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        calls.append(server_round)
        return MetricRecord({"accuracy": 0.5, "loss": 1.0})

    strategy = FedAvg(seed=0)
    grid = _grid(nodes, {nodes[0]: _nan_reply, nodes[1]: lambda m: None, nodes[2]: _error_reply})
    result = strategy.start(grid, INITIAL, num_rounds=1, evaluate_fn=evaluate_fn)
    _assert_arrays(result.arrays, _numpy(INITIAL))
    assert calls == [0]
    record = strategy.history[0]
    assert record["aggregated"] is False and "accuracy" not in record
    assert len(record["hops"][0]["misses"]) == 3
    assert 1 not in result.train_metrics_clientapp


# ----------------------------------------------------------------------------- sampling and config


@pytest.mark.parametrize(("fraction", "available", "expected"), [(0.3, 10, 3), (0.75, 8, 6), (1.0, 5, 5),
                                                                  (0.01, 10, 1)])
def test_fraction_train_samples_round_f_times_n_distinct_nodes(fraction, available, expected):
    nodes = BIG_IDS[:available]
    strategy = FedAvg(fraction_train=fraction, seed=1)
    grid = _grid(nodes)
    strategy.start(grid, INITIAL, num_rounds=2)
    for hop in grid.hops:
        targets = [m.metadata.dst_node_id for m in hop]
        assert len(targets) == expected == len(set(targets))
        assert set(targets) <= set(nodes)
    assert strategy.history[0]["selected"] == sorted(m.metadata.dst_node_id for m in grid.hops[0])


def test_sample_count_is_round_f_n_at_least_minimum():
    assert sample_count(0.1, 10, minimum=3) == 3
    assert sample_count(0.3, 10) == 3
    assert sample_count(0.01, 10) == 1


def test_sample_count_never_exceeds_the_available_nodes():
    # max(minimum, min(available, ...)) lets `minimum` win over `available`; sample_nodes then
    # asks numpy for 10 distinct nodes out of 4 and the round crashes.
    assert sample_count(0.5, 4, minimum=10) == 4


def test_min_train_nodes_raises_the_sample():
    nodes = BIG_IDS[:10]
    grid = _grid(nodes)
    FedAvg(fraction_train=0.1, min_train_nodes=4, seed=0).start(grid, INITIAL, num_rounds=1)
    assert len(grid.hops[0]) == 4


def test_sampling_is_reproducible_from_seed():
    nodes = BIG_IDS[:20]
    grids = [_grid(nodes) for _ in range(3)]
    for grid, seed in zip(grids, (7, 7, 8)):
        FedAvg(fraction_train=0.25, seed=seed).start(grid, INITIAL, num_rounds=3)
    targets = [[[m.metadata.dst_node_id for m in hop] for hop in grid.hops] for grid in grids]
    assert targets[0] == targets[1]
    assert targets[0] != targets[2]


def test_train_config_carries_server_round_proximal_mu_and_run_keys():
    nodes = BIG_IDS[:2]
    grid = _grid(nodes)
    FedAvg(proximal_mu=0.25, seed=0).start(grid, INITIAL, num_rounds=2,
                                           train_config=ConfigRecord({"lr": 0.1, "local-epochs": 2}))
    for server_round, hop in enumerate(grid.hops, start=1):
        for message in hop:
            config = message.content.config_records["config"]
            assert config["server-round"] == server_round
            assert config["proximal-mu"] == 0.25
            assert config["lr"] == 0.1 and config["local-epochs"] == 2
            assert message.metadata.message_type == MessageType.TRAIN


def test_each_message_carries_the_current_global_model():
    nodes = BIG_IDS[:2]
    grid = _grid(nodes)
    FedAvg(seed=0).start(grid, INITIAL, num_rounds=2)
    for message in grid.hops[0]:
        _assert_arrays(message.content.array_records["arrays"], _numpy(INITIAL))
    for message in grid.hops[1]:
        _assert_arrays(message.content.array_records["arrays"], _expected_average(nodes))


def test_fedprox_rejects_non_positive_mu_and_sends_its_mu():
    with pytest.raises(ValueError):
        FedProx(proximal_mu=0.0)
    with pytest.raises(ValueError):
        FedProx(proximal_mu=-0.1)
    grid = _grid(BIG_IDS[:2])
    FedProx(seed=0).start(grid, INITIAL, num_rounds=1)
    assert all(m.content.config_records["config"]["proximal-mu"] == 0.01 for m in grid.sent)


def test_fedavg_rejects_bad_fraction_and_negative_mu():
    for kwargs in ({"fraction_train": 0.0}, {"fraction_train": 1.5}, {"proximal_mu": -1.0},
                   {"fraction_evaluate": 1.5}):
        with pytest.raises(ValueError):
            FedAvg(**kwargs)


def test_build_from_run_config():
    config = RunConfig.from_mapping({"strategy": "fedprox", "proximal-mu": 0.3, "fraction-train": 0.5,
                                     "fraction-evaluate": 0.2, "round-timeout": 12.0, "seed": 4})
    strategy = build(config, env=None)
    assert type(strategy) is FedProx
    assert (strategy.proximal_mu, strategy.fraction_train, strategy.fraction_evaluate,
            strategy.round_timeout) == (0.3, 0.5, 0.2, 12.0)
    assert type(build_strategy(RunConfig(), env=None)) is FedAvg


# ----------------------------------------------------------------------------- history / evaluation


def test_history_records_bytes_hops_and_misses():
    nodes = BIG_IDS[:3]
    strategy = FedAvg(seed=0)
    strategy.start(_grid(nodes, {nodes[2]: lambda m: None}), INITIAL, num_rounds=2)
    assert [record["round"] for record in strategy.history] == [1, 2]
    for record in strategy.history:
        assert len(record["hops"]) == 1
        hop = record["hops"][0]
        assert hop["sent"] == 3 and hop["replies"] == 2
        assert hop["misses"] == [{"node": nodes[2], "tag": None, "reason": "no reply before the round timeout"}]
        assert record["bytes_sent"] == hop["bytes_sent"] > 0
        assert record["bytes_received"] == hop["bytes_received"] > 0
        assert record["aggregated"] is True and record["seconds"] >= 0


def test_evaluate_fn_called_on_round_zero_and_each_aggregated_round():
    nodes = BIG_IDS[:2]
    calls: list[tuple[int, float]] = []

    def fails_in_round_2(node):
        good = _good(node)
        return lambda m: None if m.content.config_records["config"]["server-round"] == 2 else good(m)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        calls.append((server_round, float(arrays["b"].numpy()[0])))
        return MetricRecord({"accuracy": server_round / 10, "loss": 1.0})

    strategy = FedAvg(seed=0)
    grid = FakeGrid({node: fails_in_round_2(node) for node in nodes})
    result = strategy.start(grid, INITIAL, num_rounds=3, evaluate_fn=evaluate_fn)
    shift = (10 * 1 + 20 * 2) / 30
    assert [r for r, _ in calls] == [0, 1, 3]
    assert [b for _, b in calls] == pytest.approx([0.5, 0.5 + shift, 0.5 + 2 * shift])
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 3]
    assert [record.get("accuracy") for record in strategy.history] == [0.1, None, 0.3]


def test_federated_evaluation_sends_evaluate_messages_and_aggregates():
    nodes = BIG_IDS[:3]
    grid = _grid(nodes)
    strategy = FedAvg(fraction_evaluate=1.0, seed=0)
    result = strategy.start(grid, INITIAL, num_rounds=1)
    evaluate = [m for m in grid.sent if m.metadata.message_type == MessageType.EVALUATE]
    assert sorted(m.metadata.dst_node_id for m in evaluate) == nodes
    for message in evaluate:
        assert message.content.config_records["config"]["server-round"] == 1
        _assert_arrays(message.content.array_records["arrays"], _expected_average(nodes))
    expected = (10 * 0.1 + 20 * 0.2 + 30 * 0.3) / 60
    assert result.evaluate_metrics_clientapp[1]["accuracy"] == pytest.approx(expected)
    assert strategy.history[0]["federated_evaluation"]["accuracy"] == pytest.approx(expected)
    record, train_hop = strategy.history[0], strategy.history[0]["hops"][0]
    assert record["evaluation_bytes"]["sent"] == sum(message_bytes(m) for m in evaluate)
    assert record["bytes_sent"] == train_hop["bytes_sent"] + record["evaluation_bytes"]["sent"]
    assert record["bytes_received"] == train_hop["bytes_received"] + record["evaluation_bytes"]["received"] > 0


def test_no_federated_evaluation_by_default():
    grid = _grid(BIG_IDS[:3])
    result = FedAvg(seed=0).start(grid, INITIAL, num_rounds=1)
    assert all(m.metadata.message_type == MessageType.TRAIN for m in grid.sent)
    assert result.evaluate_metrics_clientapp == {}


def test_federated_evaluation_ignores_error_replies():
    nodes = BIG_IDS[:3]
    grid = _grid(nodes)
    good = grid.handlers[nodes[0]]
    grid.handlers[nodes[0]] = lambda m: _error_reply(m) if m.metadata.message_type == MessageType.EVALUATE else good(m)
    result = FedAvg(fraction_evaluate=1.0, seed=0).start(grid, INITIAL, num_rounds=1)
    expected = (20 * 0.2 + 30 * 0.3) / 50
    assert result.evaluate_metrics_clientapp[1]["accuracy"] == pytest.approx(expected)


def test_federated_evaluation_with_empty_local_test_sets_does_not_crash():
    # local-test-fraction = 0 is a valid run config: every client then answers EVALUATE with
    # num-examples 0. aggregate_evaluate passes them straight to aggregate_metricrecords,
    # which divides by the total weight 0.
    nodes = BIG_IDS[:2]

    def empty_eval(node):
        good = _good(node)

        def handle(message: Message) -> Message:
            if message.metadata.message_type == MessageType.EVALUATE:
                metrics = MetricRecord({"num-examples": 0, "loss": 0.0, "accuracy": 0.0})
                return reply_with(message, RecordDict({"metrics": metrics}))
            return good(message)

        return handle

    strategy = FedAvg(fraction_evaluate=1.0, seed=0)
    result = strategy.start(FakeGrid({n: empty_eval(n) for n in nodes}), INITIAL, num_rounds=1)
    _assert_arrays(result.arrays, _expected_average(nodes))
    assert 1 not in result.evaluate_metrics_clientapp


# ----------------------------------------------------------------------------- Flower's hooks


def test_configure_and_aggregate_train_match_start_for_one_round():
    nodes = BIG_IDS[:6]
    config = ConfigRecord({"lr": 0.1})
    via_start = FedAvg(fraction_train=0.5, seed=3).start(_grid(nodes), INITIAL, num_rounds=1,
                                                         train_config=config)
    strategy = FedAvg(fraction_train=0.5, seed=3)
    grid = _grid(nodes)
    messages = list(strategy.configure_train(1, INITIAL, config, grid))
    assert len(messages) == 3
    assert all(m.content.config_records["config"]["server-round"] == 1 for m in messages)
    arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    _assert_arrays(arrays, _numpy(via_start.arrays))
    assert metrics["train-loss"] == pytest.approx(via_start.train_metrics_clientapp[1]["train-loss"])


def test_aggregate_train_with_only_bad_replies_returns_none():
    nodes = BIG_IDS[:2]
    strategy = FedAvg(seed=0)
    grid = _grid(nodes, {node: _nan_reply for node in nodes})
    messages = list(strategy.configure_train(1, INITIAL, ConfigRecord(), grid))
    assert strategy.aggregate_train(1, grid.send_and_receive(messages)) == (None, None)


def test_configure_evaluate_samples_fraction_evaluate():
    nodes = BIG_IDS[:10]
    strategy = FedAvg(fraction_evaluate=0.3, seed=0)
    messages = list(strategy.configure_evaluate(2, INITIAL, ConfigRecord({"x": 1}), _grid(nodes)))
    assert len(messages) == 3 == len({m.metadata.dst_node_id for m in messages})
    assert all(m.metadata.message_type == MessageType.EVALUATE for m in messages)
    assert all(m.content.config_records["config"]["server-round"] == 2 for m in messages)
    assert list(FedAvg(fraction_evaluate=0.0).configure_evaluate(1, INITIAL, ConfigRecord(), _grid(nodes))) == []


def test_global_module_is_built_once_and_never_draws_from_torchs_generator():
    builds = []

    def make_model() -> nn.Module:
        builds.append(1)
        return nn.Linear(2, 2)

    strategy = FedAvg()
    first = ArrayRecord({"weight": Array(np.eye(2, dtype=np.float32)), "bias": Array(np.ones(2, np.float32))})
    second = ArrayRecord({"weight": Array(2 * np.eye(2, dtype=np.float32)), "bias": Array(np.zeros(2, np.float32))})
    torch.manual_seed(5)
    state = torch.get_rng_state()
    module = strategy.global_module(first, make_model)
    assert torch.equal(torch.get_rng_state(), state)  # a resumed run draws what the straight one drew
    again = strategy.global_module(second, make_model)
    assert again is module and len(builds) == 1
    np.testing.assert_array_equal(module.weight.detach().numpy(), 2 * np.eye(2))
    np.testing.assert_array_equal(module.bias.detach().numpy(), np.zeros(2))
    strategy.global_module(first, lambda: nn.Linear(2, 2))  # another factory: a module of its own
    assert strategy.global_module(first, make_model) is not module and len(builds) == 2


def test_a_reply_is_decoded_once_from_the_door_to_the_average(monkeypatch):
    """Validation decodes each reply's arrays; the bound and the average reuse them, and the
    model the hop sent is decoded once for all its replies (not once per reply)."""
    nodes = BIG_IDS[:4]
    strategy = FedAvg(seed=0)
    strategy.guard.begin_round(1)
    requests = [Request(node, train_content(INITIAL, {})) for node in nodes]
    messages = to_messages(requests)
    replies = [_good(node)(message) for node, message in zip(nodes, messages)]
    decodes = []
    original = Array.numpy
    monkeypatch.setattr(Array, "numpy", lambda array: decodes.append(array) or original(array))
    hop = collect(requests, replies, messages)
    assert len(decodes) == len(nodes) * len(INITIAL)
    arrays, _ = strategy.aggregate_hop(1, hop)
    assert len(decodes) == (len(nodes) + 1) * len(INITIAL)
    monkeypatch.undo()
    _assert_arrays(arrays, _expected_average(nodes))
