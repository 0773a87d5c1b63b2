"""SCAFFOLD: control-variate maths by hand, the strategy against a FakeGrid (exact updates,
control validation, bytes ≈ 2× FedAvg), and the ClientApp keeping c_i in context.state."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from concatfl.client_app import app
from concatfl.config import RunConfig
from concatfl.objectives import (
    SCAFFOLD_STATE,
    SCAFFOLD_TAKEN_ROUND,
    SCAFFOLD_TAKEN_SHARE,
    commit_scaffold_control,
    local_steps,
    momentum_step_sum,
    scaffold_control_update,
)
from concatfl.runtime import ServerEnv, load_client_data, load_data, make_model
from concatfl.strategies import FedAvg, Scaffold, build_strategy
from concatfl.strategies.scaffold import scaffold_server_update
from tests.fakes import BIG_IDS, FakeGrid, reply_with

TRAIN_CONFIG = ConfigRecord({"lr": 0.1, "local-epochs": 1})


def _record(values: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({key: Array(np.asarray(value)) for key, value in values.items()})


def _numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: array.numpy() for key, array in record.items()}


# ---------------------------------------------------------------------- maths
def test_client_control_update_option_ii_by_hand():
    c_i = {"w": np.array([1.0, 0.0], np.float32)}
    c = {"w": np.array([0.5, 0.5], np.float32)}
    x, y = {"w": np.array([1.0, 1.0], np.float32)}, {"w": np.array([0.8, 1.2], np.float32)}
    # (x − y)/(Kη) = (0.2, −0.2)/(2·0.1) = (1, −1); c_i⁺ = (1 − 0.5 + 1, 0 − 0.5 − 1)
    updated, delta = scaffold_control_update(c_i, c, x, y, steps=2, lr=0.1)
    np.testing.assert_allclose(updated["w"], [1.5, -1.5], atol=1e-6)
    np.testing.assert_allclose(delta["w"], [0.5, -1.5], atol=1e-6)
    assert updated["w"].dtype == np.float32


def test_with_momentum_the_control_update_is_still_the_mean_gradient():
    # K steps of PyTorch's heavy-ball SGD under a constant gradient g move x by η·g·Σ(1 − β^t)/(1 − β).
    gradient, lr, steps = torch.tensor([2.0, -4.0]), 0.01, 7
    weights = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weights], lr=lr, momentum=0.9)
    for _ in range(steps):
        optimizer.zero_grad()
        (weights * gradient).sum().backward()
        optimizer.step()
    zero = {"w": np.zeros(2, np.float32)}

    updated, _ = scaffold_control_update(zero, zero, zero, {"w": weights.detach().numpy()}, steps, lr, momentum=0.9)

    np.testing.assert_allclose(updated["w"], gradient.numpy(), rtol=1e-5)
    assert momentum_step_sum(steps, 0.0) == steps
    assert momentum_step_sum(3, 0.5) == 1 + 1.5 + 1.75


def test_local_steps_counts_the_short_last_batch():
    assert local_steps(100, 32, 2) == 8 and local_steps(64, 32, 1) == 2


def test_server_update_by_hand():
    x = {"w": np.array([1.0, 1.0], np.float32), "n": np.array(3, np.int64)}
    c = {"w": np.array([0.0, 0.0], np.float32)}
    delta = {"w": np.array([0.1, 0.2], np.float32), "n": np.array(2)}  # the round's combined Δy
    control_deltas = [{"w": np.array([1.0, 1.0], np.float32)}, {"w": np.array([1.0, -1.0], np.float32)}]
    model, control = scaffold_server_update(x, c, delta, control_deltas, server_lr=1.0, num_clients=4)
    np.testing.assert_allclose(model["w"], [1.1, 1.2], atol=1e-6)
    assert model["n"] == 5 and model["n"].dtype == np.int64  # 3 + 2
    np.testing.assert_allclose(control["w"], [0.5, 0.0], atol=1e-7)  # c + (2, 0)/N
    model, _ = scaffold_server_update(x, c, delta, control_deltas, server_lr=2.0, num_clients=4)
    np.testing.assert_allclose(model["w"], [1.2, 1.4], atol=1e-6)
    assert model["n"] == 5  # η_g scales only the arrays with control variates, not buffers


# ---------------------------------------------------------------------- strategy with a FakeGrid
INITIAL = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([0.5], np.float32)}


def _client(node: int, failure: str | None = None):
    """Replies the delta (node/100 everywhere) and Δc = node/10 − c (so exact results are known)."""

    def handle(message: Message) -> Message:
        control = _numpy(message.content.array_records["control"])
        sent = _numpy(message.content.array_records["arrays"])
        delta = {k: np.full_like(v, (node % 97) / 100) for k, v in sent.items()}
        dc = {k: (np.full_like(v, (node % 97) / 10) - v).astype(np.float32) for k, v in control.items()}
        if failure == "nan":
            dc["w"] = np.array([np.nan, 0.0], np.float32)
        elif failure == "shape":
            dc["w"] = np.zeros(3, np.float32)
        content = RecordDict({"arrays": _record(delta), "metrics": MetricRecord({"num-examples": 10 + node % 5})})
        if failure != "missing":
            content["control"] = _record(dc)
        return reply_with(message, content)

    return handle


def test_strategy_sends_c_and_updates_x_and_c_exactly():
    nodes = BIG_IDS[:4]
    grid = FakeGrid({node: _client(node) for node in nodes})
    # Hand-made deltas of lengths far apart: the reply bounds are off so the exact sums hold.
    strategy = Scaffold(fraction_train=0.5, server_lr=1.0, control_keys=["w"], seed=1, update_clip=0, weight_clip=0)
    result = strategy.start(grid, _record(INITIAL), num_rounds=1, train_config=TRAIN_CONFIG)
    sent = grid.hops[0]
    assert len(sent) == 2
    for message in sent:
        assert _numpy(message.content.array_records["control"]) == {"w": pytest.approx(np.zeros(2))}
        assert message.content.config_records["config"]["local-objective"] == "sgd"
    chosen = [m.metadata.dst_node_id for m in sent]
    step = np.mean([(n % 97) / 100 for n in chosen])
    final = _numpy(result.arrays)
    np.testing.assert_allclose(final["w"], INITIAL["w"] + step, atol=1e-6)
    np.testing.assert_allclose(final["b"], INITIAL["b"] + step, atol=1e-6)
    # c = 0 + Σ Δc_i / N with N = 4 connected nodes
    expected_c = sum((n % 97) / 10 for n in chosen) / 4
    np.testing.assert_allclose(strategy.control["w"].numpy(), [expected_c] * 2, atol=1e-6)
    assert list(strategy.control.keys()) == ["w"]


@pytest.mark.parametrize("failure, reason", [("nan", "non-finite"), ("shape", "shape"), ("missing", "no ArrayRecord")])
def test_unusable_control_variates_are_misses(failure, reason):
    good, bad = BIG_IDS[0], BIG_IDS[1]
    grid = FakeGrid({good: _client(good), bad: _client(bad, failure)})
    strategy = Scaffold(control_keys=["w"])
    result = strategy.start(grid, _record(INITIAL), num_rounds=1, train_config=TRAIN_CONFIG)
    misses = strategy.history[0]["hops"][0]["misses"]
    assert [m["node"] for m in misses] == [bad] and reason in misses[0]["reason"]
    assert "control variate" in misses[0]["reason"] or failure == "missing"
    np.testing.assert_allclose(_numpy(result.arrays)["w"], INITIAL["w"] + (good % 97) / 100, atol=1e-6)
    np.testing.assert_allclose(strategy.control["w"].numpy(), [(good % 97) / 10 / 2] * 2, atol=1e-6)


def test_state_dict_round_trip_keeps_c():
    grid = FakeGrid({node: _client(node) for node in BIG_IDS[:2]})
    strategy = Scaffold(control_keys=["w"])
    strategy.start(grid, _record(INITIAL), num_rounds=1, train_config=TRAIN_CONFIG)
    restored = Scaffold(control_keys=["w"])
    restored.load_state_dict(strategy.state_dict())
    np.testing.assert_array_equal(restored.control["w"].numpy(), strategy.control["w"].numpy())


def _echo(message: Message) -> Message:
    """A client that returns what a real one would send back, sizes-wise."""
    content = RecordDict(
        {"arrays": message.content.array_records["arrays"], "metrics": MetricRecord({"num-examples": 10})}
    )
    if "control" in message.content.array_records:
        content["control"] = message.content.array_records["control"]
    return reply_with(message, content)


def test_measured_bytes_per_round_are_about_twice_fedavgs():
    config = RunConfig.from_mapping({"strategy": "scaffold"})
    env = ServerEnv.from_config(config)
    initial = ArrayRecord(env.make_model().state_dict())  # digits MLP: 55,210 float32 parameters
    nodes = BIG_IDS[:4]
    rounds = {}
    for name, strategy in (("fedavg", FedAvg()), ("scaffold", build_strategy(config, env))):
        strategy.start(FakeGrid({n: _echo for n in nodes}), initial, num_rounds=1, train_config=TRAIN_CONFIG)
        rounds[name] = strategy.history[0]
    for direction in ("bytes_sent", "bytes_received"):
        ratio = rounds["scaffold"][direction] / rounds["fedavg"][direction]
        assert 1.95 < ratio < 2.05, (direction, ratio)
    assert rounds["fedavg"]["bytes_sent"] > 4 * 55_210 * 4


# ---------------------------------------------------------------------- client side through the ClientApp
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
with PYPROJECT.open("rb") as _handle:
    RUN_CONFIG = {**tomllib.load(_handle)["tool"]["flwr"]["app"]["config"], "device": "cpu", "batch-size": 64,
                  "lr": 0.05, "seed": 3, "strategy": "scaffold"}


def _global() -> ArrayRecord:
    config = RunConfig.from_mapping(RUN_CONFIG)
    torch.manual_seed(0)
    return ArrayRecord(make_model(config, load_data(config)).state_dict())


def _scaffold_message(
    arrays: ArrayRecord, control: dict[str, np.ndarray], server_round: int, taken: tuple[int, float] = (0, 1.0)
) -> Message:
    config = {"server-round": server_round, SCAFFOLD_TAKEN_ROUND: taken[0], SCAFFOLD_TAKEN_SHARE: taken[1]}
    content = RecordDict({"arrays": arrays, "control": _record(control), "config": ConfigRecord(config)})
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)


def test_clientapp_keeps_c_i_in_context_state_and_replies_delta_and_delta_c():
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 4},
                      state=RecordDict(), run_config=RUN_CONFIG)
    x = _global()
    params = {k: np.zeros_like(v.numpy()) for k, v in x.items()}  # the MLP has no buffers
    n = len(load_client_data(RunConfig.from_mapping(RUN_CONFIG), 0, 4).y_train)
    k_eta = local_steps(n, 64, 1) * 0.05

    first = app(_scaffold_message(x, params, 1), context)
    delta = _numpy(first.content.array_records["arrays"])
    dc = _numpy(first.content.array_records["control"])
    assert set(first.content.array_records) == {"arrays", "control"}
    # Δc is pending until the server says it took the reply: c_i has not moved yet.
    assert SCAFFOLD_STATE not in context.state.array_records
    for key in params:  # c_i⁺ = 0 − 0 + (x − y)/(Kη) = −Δy/(Kη); Δc = c_i⁺ − 0
        np.testing.assert_allclose(dc[key], -delta[key] / k_eta, rtol=1e-4, atol=1e-6)
    assert any(np.abs(delta[key]).sum() > 0 for key in delta)

    # Round 2 with a non-zero server c, same Context: the server took round 1's reply, so c_i = Δc
    # is committed first and round 2 is corrected by c − c_i and computes c_i again.
    c = {key: np.full_like(value, 0.01) for key, value in params.items()}
    second = app(_scaffold_message(x, c, 2, taken=(1, 1.0)), context)
    c_1 = _numpy(context.state.array_records[SCAFFOLD_STATE])
    for key in params:
        np.testing.assert_allclose(c_1[key], dc[key], rtol=1e-6, atol=1e-7)
    delta_2 = _numpy(second.content.array_records["arrays"])
    dc_2 = _numpy(second.content.array_records["control"])
    for key in params:  # Δc_2 = c_2 − c_1 with c_2 = c_1 − c − Δy_2/(Kη)
        np.testing.assert_allclose(dc_2[key], -c[key] - delta_2[key] / k_eta, rtol=1e-4, atol=1e-5)
    # the correction c − c_i changed training (same data order as a client without state)
    fresh = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 4},
                    state=RecordDict(), run_config=RUN_CONFIG)
    uncorrected = _numpy(app(_scaffold_message(x, params, 2), fresh).content.array_records["arrays"])
    assert any(not np.allclose(uncorrected[key], delta_2[key]) for key in params)
    assert all(math.isfinite(float(np.abs(v).sum())) for v in dc_2.values())


def test_a_pending_control_delta_is_committed_only_when_the_server_took_its_reply():
    def state_with(committed, pending, pending_round):
        state = RecordDict({"scaffold-pending": _record(pending), "scaffold-pending-round": ConfigRecord({"round": pending_round})})
        if committed is not None:
            state[SCAFFOLD_STATE] = _record(committed)
        return state

    c_i, delta = {"w": np.array([1.0, 2.0], dtype=np.float32)}, {"w": np.array([4.0, -2.0], dtype=np.float32)}
    taken = state_with(c_i, delta, 3)
    assert commit_scaffold_control(taken, 3, 1.0)
    np.testing.assert_array_equal(taken.array_records[SCAFFOLD_STATE]["w"].numpy(), [5.0, 0.0])
    assert "scaffold-pending" not in taken.array_records  # settled once
    assert not commit_scaffold_control(taken, 3, 1.0)
    bounded = state_with(c_i, delta, 3)  # the server's bound let in half of Δc
    assert commit_scaffold_control(bounded, 3, 0.5)
    np.testing.assert_array_equal(bounded.array_records[SCAFFOLD_STATE]["w"].numpy(), [3.0, 1.0])
    lost = state_with(c_i, delta, 3)  # the server's last taken reply is of round 2: round 3's was lost
    assert not commit_scaffold_control(lost, 2, 1.0)
    np.testing.assert_array_equal(lost.array_records[SCAFFOLD_STATE]["w"].numpy(), [1.0, 2.0])
    assert "scaffold-pending" not in lost.array_records
    fresh = state_with(None, delta, 1)  # no committed c_i yet: it starts from zero
    assert commit_scaffold_control(fresh, 1, 1.0)
    np.testing.assert_array_equal(fresh.array_records[SCAFFOLD_STATE]["w"].numpy(), [4.0, -2.0])


def test_the_server_tells_each_node_the_round_and_share_of_its_last_reply_it_took():
    sent = []

    def node(node_id):
        def handle(message):
            sent.append((node_id, dict(message.content.config_records["config"])))
            if node_id == 2 and message.content.config_records["config"]["server-round"] == 1:
                return None  # round 1's reply of node 2 is lost
            zeros = {k: np.zeros_like(v.numpy()) for k, v in message.content.array_records["arrays"].items()}
            control = {k: np.ones_like(v.numpy()) for k, v in message.content.array_records["control"].items()}
            metrics = MetricRecord({"num-examples": 10})
            return reply_with(message, RecordDict({"arrays": _record(zeros), "control": _record(control), "metrics": metrics}))
        return handle

    strategy = Scaffold(seed=0, update_clip=0.0, weight_clip=0.0, round_timeout=1.0)
    strategy.start(FakeGrid({1: node(1), 2: node(2)}), _global(), num_rounds=3)
    told = {(n, int(c["server-round"])): (c[SCAFFOLD_TAKEN_ROUND], c[SCAFFOLD_TAKEN_SHARE]) for n, c in sent}
    assert told[(1, 1)] == (0, 1.0) and told[(1, 2)] == (1, 1.0) and told[(1, 3)] == (2, 1.0)
    assert told[(2, 2)] == (0, 1.0) and told[(2, 3)] == (2, 1.0)  # its lost reply was never taken
    assert strategy.state_dict()["taken"] == {"1": [3, 1.0], "2": [3, 1.0]}
