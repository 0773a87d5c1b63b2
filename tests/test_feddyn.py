"""FedDyn: the server step by hand, FedAvg / FedCat / FedSeq applying it against a FakeGrid, and
the client's g_k persisting across rounds in a real Context through the ClientApp."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from concatfl.client_app import app
from concatfl.config import RunConfig
from concatfl.objectives import FEDDYN_STATE
from concatfl.runtime import ServerEnv, load_data, make_model
from concatfl.strategies import FedAvg, FedCat, FedDynServer, build_strategy
from concatfl.strategies.common import to_numpy
from concatfl.strategies.feddyn import feddyn_server_update, parameter_names
from tests.fakes import BIG_IDS, FakeGrid, reply_with
from tests.test_fedseq_strategy import as_state, clients_for, expected_average, initial_arrays, run
from tests.test_fedseq_strategy import strategy as fedseq_strategy

ALPHA = 0.1
TRAIN_CONFIG = ConfigRecord({"lr": 0.1, "local-epochs": 1})
INITIAL = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([0.5], np.float32)}


def _record(values: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({key: Array(np.asarray(value)) for key, value in values.items()})


def _numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: array.numpy() for key, array in record.items()}


# ---------------------------------------------------------------------- the formula
def test_server_update_by_hand():
    previous = {"w": np.array([1.0, 1.0], np.float32), "n": np.array([7.0], np.float32)}
    models = [{"w": np.array([2.0, 1.0], np.float32)}, {"w": np.array([1.0, 3.0], np.float32)}]
    average = {"w": np.array([1.5, 2.0], np.float32), "n": np.array([9.0], np.float32)}
    h = {"w": np.zeros(2, np.float32)}
    model, new_h = feddyn_server_update(previous, models, average, h, alpha=0.1, num_clients=4)
    # h = 0 − (0.1/4)·((1, 0) + (0, 2)) = (−0.025, −0.05);  θ = (1.5, 2) − h/0.1 = (1.75, 2.5)
    np.testing.assert_allclose(new_h["w"], [-0.025, -0.05], atol=1e-7)
    np.testing.assert_allclose(model["w"], [1.75, 2.5], atol=1e-6)
    assert model["n"].tolist() == [9.0] and set(new_h) == {"w"}  # keys outside h: the average
    # h accumulates: a second identical step doubles it
    model, newer_h = feddyn_server_update(previous, models, average, new_h, alpha=0.1, num_clients=4)
    np.testing.assert_allclose(newer_h["w"], [-0.05, -0.1], atol=1e-7)
    np.testing.assert_allclose(model["w"], [2.0, 3.0], atol=1e-6)


def test_parameter_names_leave_out_buffers_and_torch_rng():
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    names = parameter_names(lambda: torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)))
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert torch.rand(1) == expected


# ---------------------------------------------------------------------- strategies
def _additive(node: int):
    """Training adds node % 97 to every array; num-examples 10 + node % 5."""

    def handle(message: Message) -> Message:
        arrays = _numpy(message.content.array_records["arrays"])
        trained = {key: (value + node % 97).astype(value.dtype) for key, value in arrays.items()}
        metrics = MetricRecord({"num-examples": 10 + node % 5})
        return reply_with(message, RecordDict({"arrays": _record(trained), "metrics": metrics}))

    return handle


def test_fedavg_with_feddyn_sends_the_objective_and_corrects_the_plain_mean():
    nodes = BIG_IDS[:4]
    grid = FakeGrid({node: _additive(node) for node in nodes})
    # Hand-made updates of lengths far apart: the reply bounds are off so the exact sums hold.
    strategy = FedAvg(fraction_train=0.5, feddyn=FedDynServer(ALPHA, keys=["w"]), seed=2, update_clip=0, weight_clip=0)
    globals_ = {}

    def evaluate_fn(server_round, arrays):
        globals_[server_round] = _numpy(arrays)
        return MetricRecord({"accuracy": 0.0})

    strategy.start(grid, _record(INITIAL), num_rounds=2, train_config=TRAIN_CONFIG, evaluate_fn=evaluate_fn)
    h = np.zeros(2)
    for server_round, hop in enumerate(grid.hops, start=1):
        config = hop[0].content.config_records["config"]
        assert config["local-objective"] == "feddyn" and config["feddyn-alpha"] == ALPHA
        shifts = [m.metadata.dst_node_id % 97 for m in hop]
        previous = globals_[server_round - 1]
        h = h - (ALPHA / 4) * sum(shifts)  # m = 4 connected nodes, |P| = 2
        np.testing.assert_allclose(globals_[server_round]["w"], previous["w"] + np.mean(shifts) - h / ALPHA, rtol=1e-6)
        np.testing.assert_allclose(globals_[server_round]["b"], previous["b"] + np.mean(shifts), rtol=1e-6)
    np.testing.assert_allclose(strategy.feddyn.h["w"], h, rtol=1e-6)
    assert strategy.history[-1]["feddyn_h_norm"] == pytest.approx(float(np.sqrt(2) * abs(h[0])), rel=1e-5)
    restored = FedAvg(feddyn=FedDynServer(ALPHA, keys=["w"]))
    restored.load_state_dict(strategy.state_dict())
    np.testing.assert_array_equal(restored.feddyn.h["w"], strategy.feddyn.h["w"])


def test_fedavg_rejects_feddyn_with_a_proximal_term():
    with pytest.raises(ValueError, match="proximal"):
        FedAvg(proximal_mu=0.1, feddyn=FedDynServer(ALPHA))


def test_fedcat_with_feddyn_corrects_the_copies_average_at_cycle_end():
    nodes = BIG_IDS[:4]
    grid = FakeGrid({node: _additive(node) for node in nodes})
    # Every reply taken as it is (the paper's FedCat), so the copies are the clients' models.
    strategy = FedCat(
        k=2, feddyn=FedDynServer(ALPHA), hop_step=1.0, hop_clip=0.0, check_parts=False, seed=3, update_clip=0, weight_clip=0
    )
    globals_ = {}

    def evaluate_fn(server_round, arrays):
        globals_[server_round] = _numpy(arrays)
        return MetricRecord({"accuracy": 0.0})

    strategy.start(grid, _record(INITIAL), num_rounds=2, train_config=TRAIN_CONFIG, evaluate_fn=evaluate_fn)
    assert sorted(globals_) == [0, 2]  # one cycle of K = 2 rounds
    assert all(m.content.config_records["config"]["local-objective"] == "feddyn" for hop in grid.hops for m in hop)
    shifts, sizes = np.zeros(2), np.zeros(2)
    for record in strategy.history:
        for copy, node in enumerate(record["copy_to_device"]):
            shifts[copy] += node % 97
            sizes[copy] += 10 + node % 5
    average = INITIAL["w"] + (sizes * shifts).sum() / sizes.sum()
    h = -(ALPHA / 2) * shifts.sum()  # m = K = 2 copies, θ_prev = the initial model
    np.testing.assert_allclose(globals_[2]["w"], average - h / ALPHA, rtol=1e-6)
    np.testing.assert_allclose(strategy.feddyn.h["w"], [h, h], rtol=1e-6)


def test_fedseq_with_feddyn_corrects_the_superclient_average_and_pretrains_plainly():
    clients = clients_for(8)
    fedseq = fedseq_strategy(fraction_train=0.5, feddyn=FedDynServer(ALPHA))
    grid, models, _ = run(fedseq, clients, 2)
    for client in clients.values():
        pretrain, *stage2 = client.configs
        assert pretrain["local-objective"] == "sgd"
        assert all(c["local-objective"] == "feddyn" and c["feddyn-alpha"] == ALPHA for c in stage2)
    assert len(fedseq.superclients) == 2
    start = as_state(initial_arrays())
    h = {key: np.zeros_like(value, dtype=np.float64) for key, value in start.items()}
    for server_round in (1, 2):
        chains = fedseq.history[server_round - 1]["superclients"]
        assert len(chains) == 1  # C = 0.5 of 2 superclients
        shift = sum(chains[0]["order"])  # each client adds its node id (1..8)
        previous = models[server_round - 1]
        chain_model = {key: value + shift for key, value in previous.items()}
        average = expected_average([chain_model], [1.0])
        for key in h:
            h[key] = h[key] - (ALPHA / 2) * shift  # m = 2 superclients
            np.testing.assert_allclose(models[server_round][key], average[key] - h[key] / ALPHA, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------- client state through the ClientApp
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
with PYPROJECT.open("rb") as _handle:
    RUN_CONFIG = {**tomllib.load(_handle)["tool"]["flwr"]["app"]["config"], "device": "cpu", "batch-size": 64,
                  "lr": 0.05, "seed": 3, "local-objective": "feddyn", "feddyn-alpha": ALPHA}


def _context() -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 4},
                   state=RecordDict(), run_config=RUN_CONFIG)


def _train(context: Context, arrays: ArrayRecord, server_round: int) -> ArrayRecord:
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": server_round})})
    reply = app(Message(content, dst_node_id=1, message_type=MessageType.TRAIN), context)
    assert not reply.has_error()
    return reply.content.array_records["arrays"]


def test_clientapp_keeps_g_k_in_context_state_across_rounds(caplog):
    config = RunConfig.from_mapping(RUN_CONFIG)
    torch.manual_seed(0)
    theta_0 = ArrayRecord(make_model(config, load_data(config)).state_dict())
    context = _context()
    with caplog.at_level(logging.INFO, logger="flwr"):
        theta_1 = _train(context, theta_0, 1)
    assert "No FedDyn g_k in context.state" in caplog.text and "starting from zero" in caplog.text
    g_1 = _numpy(context.state.array_records[FEDDYN_STATE])
    sent, got = _numpy(theta_0), _numpy(theta_1)
    assert set(g_1) == set(sent)  # the MLP's parameters (it has no buffers)
    for key in g_1:
        np.testing.assert_allclose(g_1[key], -ALPHA * (got[key] - sent[key]), rtol=1e-5, atol=1e-8)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flwr"):
        theta_2 = _train(context, theta_1, 2)
    assert "No FedDyn g_k" not in caplog.text
    g_2 = _numpy(context.state.array_records[FEDDYN_STATE])
    for key in g_2:
        expected = g_1[key] - ALPHA * (_numpy(theta_2)[key] - got[key])
        np.testing.assert_allclose(g_2[key], expected, rtol=1e-5, atol=1e-8)
    # The linear term −⟨g_1, θ⟩ shapes round 2: a client that lost its state trains differently.
    restarted = _train(_context(), theta_1, 2)
    assert any(not np.allclose(restarted[k].numpy(), theta_2[k].numpy()) for k in g_2)


def test_build_gives_feddyn_to_the_strategies_of_a_feddyn_run():
    for name in ("fedavg", "fedcat", "fedseq", "fedseq-inter"):
        config = RunConfig.from_mapping({"strategy": name, "local-objective": "feddyn", "feddyn-alpha": 0.3})
        env = ServerEnv.from_config(config)
        strategy = build_strategy(config, env)
        assert strategy.feddyn is not None and strategy.feddyn.alpha == 0.3
        assert strategy.feddyn.keys == [name for name, _ in env.make_model().named_parameters()]
    plain = RunConfig.from_mapping({"strategy": "fedavg", "local-objective": "moon"})
    assert build_strategy(plain, ServerEnv.from_config(plain)).feddyn is None


def test_the_corrected_model_keeps_zero_dimensional_buffers():
    """BatchNorm's num_batches_tracked is a 0-d array: the server must send it back as one."""
    server = FedDynServer(ALPHA)
    previous = ArrayRecord({"w": Array(np.zeros(2, np.float32)), "steps": Array(np.asarray(3, np.int64))})
    trained = ArrayRecord({"w": Array(np.ones(2, np.float32)), "steps": Array(np.asarray(5, np.int64))})
    corrected = server.step(previous, [to_numpy(trained)], trained, num_clients=2)
    assert corrected["steps"].shape == () and int(corrected["steps"].numpy()) == 5
