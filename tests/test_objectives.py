"""Local objectives: each loss against a hand computation, their config rules, and the ClientApp
running every objective with real Messages and a real Context (digits)."""

from __future__ import annotations

import logging
import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from torch import nn

from concatfl.client_app import app
from concatfl.config import ConfigError, RunConfig
from concatfl.objectives import (
    FEDLC_MIN_COUNT,
    MOON_STATE,
    build_objective,
    fedlc_logits,
    fedrs_logits,
    linear_term,
    moon_contrastive,
)
from concatfl.runtime import load_data, make_model

CPU = torch.device("cpu")
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
with PYPROJECT.open("rb") as _handle:
    DEFAULTS = tomllib.load(_handle)["tool"]["flwr"]["app"]["config"]
RUN_CONFIG = {**DEFAULTS, "device": "cpu", "batch-size": 64, "lr": 0.05, "seed": 3}


class Tiny(nn.Module):
    """encoder: 2 → 2 (no bias), classifier: 2 → 3 (no bias), weights set by hand."""

    def __init__(self, encoder: list[list[float]], classifier: list[list[float]]) -> None:
        super().__init__()
        self.encoder = nn.Linear(2, 2, bias=False)
        self.classifier = nn.Linear(2, 3, bias=False)
        with torch.no_grad():
            self.encoder.weight.copy_(torch.tensor(encoder))
            self.classifier.weight.copy_(torch.tensor(classifier))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(x))


IDENTITY = [[1.0, 0.0], [0.0, 1.0]]
# classifier rows give logits (z0, z1, z0 + z1)
HEAD = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]


def settings(**overrides) -> dict:
    return {**RunConfig().as_dict(), **overrides}


def objective_loss(name: str, model: nn.Module, x, y, counts=(16, 1, 0), state=None, received=None, **kw):
    objective = build_objective(
        settings(**{"local-objective": name, **kw}),
        RecordDict() if state is None else state,
        received=lambda: received or Tiny(IDENTITY, HEAD),
        make_model=lambda: Tiny(IDENTITY, HEAD),
        label_counts=np.array(counts),
        num_examples=len(y),
        device=CPU,
    )
    loss = nn.functional.cross_entropy(model(x), y) if objective.loss is None else objective.loss(model, x, y)
    if objective.regularizer is not None:
        loss = loss + objective.regularizer(model)
    return float(loss.detach()), objective


def ce(logits: list[float], target: int) -> float:
    return math.log(sum(math.exp(v) for v in logits)) - logits[target]


# ---------------------------------------------------------------------- pure losses
def test_fedrs_scales_only_absent_class_logits_by_alpha():
    logits = torch.tensor([[1.0, 2.0, 3.0], [-2.0, 4.0, 0.5]])
    scaled = fedrs_logits(logits, torch.tensor([True, False, True]), 0.5)
    assert scaled.tolist() == [[1.0, 1.0, 3.0], [-2.0, 2.0, 0.5]]


def test_fedrs_loss_of_the_built_objective_equals_hand_value():
    x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([0])
    # logits (1, 2, 3); class 1 absent (count 0) → (1, 1, 3) with α = 0.5
    loss, _ = objective_loss("fedrs", Tiny(IDENTITY, HEAD), x, y, counts=(5, 0, 7), **{"fedrs-alpha": 0.5})
    assert loss == pytest.approx(ce([1.0, 1.0, 3.0], 0), abs=1e-6)


def test_fedlc_subtracts_tau_times_count_to_the_minus_quarter():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    calibrated = fedlc_logits(logits, torch.tensor([16, 1, 0]), 2.0)
    # 16^-1/4 = 0.5, 1^-1/4 = 1, absent: (1e-8)^-1/4 = 100
    assert FEDLC_MIN_COUNT == 1e-8
    assert calibrated[0].tolist() == pytest.approx([0.0, 0.0, -197.0], abs=1e-4)


def test_fedlc_loss_of_the_built_objective_equals_hand_value():
    x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([0])
    loss, _ = objective_loss("fedlc", Tiny(IDENTITY, HEAD), x, y, counts=(16, 1, 0), **{"fedlc-tau": 1.0})
    assert loss == pytest.approx(ce([1.0 - 0.5, 2.0 - 1.0, 3.0 - 100.0], 0), abs=1e-6)


def test_moon_contrastive_term_equals_hand_value():
    z = torch.tensor([[1.0, 0.0]])
    z_global, z_previous = torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 1.0]])
    # sim(z, z_glob) = 1/√2, sim(z, z_prev) = 0, τ = 0.5 → −log(e^{√2} / (e^{√2} + e^0))
    expected = math.log(1 + math.exp(-math.sqrt(2)))
    assert float(moon_contrastive(z, z_global, z_previous, 0.5)) == pytest.approx(expected, abs=1e-6)
    assert float(moon_contrastive(z, z_global, None, 0.5)) == 0.0


def test_moon_objective_uses_encoder_outputs_of_local_global_and_previous_models():
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([2])
    local = Tiny(IDENTITY, HEAD)  # z = (1, 0), logits (1, 0, 1)
    received = Tiny([[1.0, 0.0], [1.0, 0.0]], HEAD)  # z_glob = (1, 1)
    previous = Tiny([[0.0, 0.0], [1.0, 0.0]], HEAD)  # z_prev = (0, 1)
    state = RecordDict({MOON_STATE: ArrayRecord(previous.state_dict())})
    loss, _ = objective_loss(
        "moon", local, x, y, state=state, received=received, **{"moon-mu": 2.0, "moon-tau": 0.5}
    )
    expected = ce([1.0, 0.0, 1.0], 2) + 2.0 * math.log(1 + math.exp(-math.sqrt(2)))
    assert loss == pytest.approx(expected, abs=1e-6)


def test_moon_without_previous_model_is_cross_entropy_and_logs_a_note(caplog):
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([2])
    with caplog.at_level(logging.INFO, logger="flwr"):
        loss, objective = objective_loss("moon", Tiny(IDENTITY, HEAD), x, y)
    assert loss == pytest.approx(ce([1.0, 0.0, 1.0], 2), abs=1e-6)
    assert "MOON's previous local model" in caplog.text and "lost in a restart" in caplog.text
    state = RecordDict()
    _, objective = objective_loss("moon", Tiny(IDENTITY, HEAD), x, y, state=state)
    objective.finish(Tiny(IDENTITY, HEAD))
    assert MOON_STATE in state.array_records


def test_feddyn_regularizer_is_minus_linear_term_plus_proximal_term():
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    model = Tiny([[1.0, 2.0], [0.0, 0.0]], HEAD)
    received = Tiny([[0.0, 1.0], [0.0, 0.0]], HEAD)
    gradient = {"encoder.weight": np.array([[0.5, -1.0], [0.0, 0.0]], np.float32),
                "classifier.weight": np.zeros((3, 2), np.float32)}
    state = RecordDict({"feddyn-gradient": ArrayRecord({k: Array(v) for k, v in gradient.items()})})
    loss, objective = objective_loss("feddyn", model, x, y, state=state, received=received, **{"feddyn-alpha": 0.1})
    # logits (1, 0, 1); −⟨g, θ⟩ = −(0.5·1 − 1·2) = 1.5; α/2·‖θ − θ_r‖² = 0.05·(1 + 1) = 0.1
    assert loss == pytest.approx(ce([1.0, 0.0, 1.0], 0) + 1.5 + 0.1, abs=1e-6)
    objective.finish(model)
    updated = state.array_records["feddyn-gradient"]["encoder.weight"].numpy()
    np.testing.assert_allclose(updated, [[0.4, -1.1], [0.0, 0.0]], atol=1e-7)


def test_linear_term_gradient_is_the_vector():
    model = Tiny(IDENTITY, HEAD)
    vector = {"encoder.weight": torch.tensor([[1.0, -2.0], [3.0, 0.5]])}
    linear_term(model, vector).backward()
    assert model.encoder.weight.grad.tolist() == vector["encoder.weight"].tolist()
    assert model.classifier.weight.grad is None


def test_fedprox_and_sgd_with_mu_add_the_proximal_term():
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    model, received = Tiny([[1.0, 2.0], [0.0, 0.0]], HEAD), Tiny([[0.0, 1.0], [0.0, 0.0]], HEAD)
    for name in ("fedprox", "sgd"):
        loss, _ = objective_loss(name, model, x, y, received=received, **{"proximal-mu": 0.5})
        assert loss == pytest.approx(ce([1.0, 0.0, 1.0], 0) + 0.25 * 2, abs=1e-6)
    loss, objective = objective_loss("sgd", model, x, y, received=received)
    assert objective.loss is None and objective.regularizer is None
    assert loss == pytest.approx(ce([1.0, 0.0, 1.0], 0), abs=1e-6)


@pytest.mark.parametrize(
    "name, overrides, builds",
    [
        ("sgd", {}, 0),
        ("fedrs", {}, 0),
        ("fedlc", {}, 0),
        ("sgd", {"proximal-mu": 0.5}, 1),
        ("fedprox", {"proximal-mu": 0.5}, 1),
        ("feddyn", {}, 1),
        ("moon", {}, 1),
    ],
)
def test_only_objectives_that_keep_the_received_model_build_a_copy_of_it(name, overrides, builds):
    built = []

    def received() -> nn.Module:
        built.append(Tiny(IDENTITY, HEAD))
        return built[-1]

    build_objective(
        settings(**{"local-objective": name, **overrides}),
        RecordDict(),
        received=received,
        make_model=lambda: Tiny(IDENTITY, HEAD),
        label_counts=np.array([3, 1, 0]),
        num_examples=4,
        device=CPU,
    )
    assert len(built) == builds
    assert all(not p.requires_grad for model in built for p in model.parameters())  # frozen


# ---------------------------------------------------------------------- config rules
@pytest.mark.parametrize(
    "values, named",
    [
        ({"strategy": "scaffold", "local-objective": "moon"}, ("strategy", "local-objective")),
        ({"strategy": "scaffold", "proximal-mu": 0.1}, ("strategy", "proximal-mu")),
        ({"strategy": "fedprox", "proximal-mu": 0.1, "local-objective": "feddyn"}, ("strategy", "local-objective")),
        ({"local-objective": "moon", "proximal-mu": 0.1}, ("local-objective", "proximal-mu")),
        ({"local-objective": "fedrs", "strategy": "fedconcat-id"}, ("local-objective", "strategy")),
        ({"local-objective": "adam"}, ("local-objective",)),
        ({"feddyn-alpha": 0.0}, ("feddyn-alpha",)),
        ({"moon-tau": 0.0}, ("moon-tau",)),
        ({"fedrs-alpha": 1.5}, ("fedrs-alpha",)),
        ({"fedlc-tau": -1.0}, ("fedlc-tau",)),
        ({"scaffold-server-lr": 0.0}, ("scaffold-server-lr",)),
    ],
)
def test_nonsensical_combinations_are_rejected_naming_the_keys(values, named):
    with pytest.raises(ConfigError) as error:
        RunConfig.from_mapping(values)
    for key in named:
        assert key in str(error.value)


@pytest.mark.parametrize(
    "values",
    [
        {"strategy": "scaffold"},
        {"strategy": "fedprox", "proximal-mu": 0.01, "local-objective": "fedprox"},
        {"strategy": "fedcat", "local-objective": "fedprox", "proximal-mu": 0.01},
        {"strategy": "fedseq", "local-objective": "feddyn", "feddyn-alpha": 0.1},
        {"strategy": "fedseq-inter", "local-objective": "feddyn"},
        {"strategy": "fedconcat", "local-objective": "moon"},
        {"strategy": "fedconcat", "local-objective": "fedlc"},
        {"strategy": "fedconcat-id", "local-objective": "moon"},
        {"strategy": "fedavg", "local-objective": "fedrs", "fedrs-alpha": 0.0},
    ],
)
def test_sensible_combinations_pass(values):
    RunConfig.from_mapping(values)


# ---------------------------------------------------------------------- through the ClientApp
def _context(**run_config) -> Context:
    return Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": 4},
        state=RecordDict(),
        run_config={**RUN_CONFIG, **run_config},
    )


def _initial() -> ArrayRecord:
    config = RunConfig.from_mapping(RUN_CONFIG)
    torch.manual_seed(0)
    return ArrayRecord(make_model(config, load_data(config)).state_dict())


INITIAL = _initial()


def _train(context: Context, arrays: ArrayRecord, config: dict) -> Message:
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1, **config})})
    return app(Message(content, dst_node_id=1, message_type=MessageType.TRAIN), context)


@pytest.mark.parametrize(
    "config",
    [
        {"local-objective": "fedprox", "proximal-mu": 0.1},
        {"local-objective": "feddyn", "feddyn-alpha": 0.1},
        {"local-objective": "moon"},
        {"local-objective": "fedrs"},
        {"local-objective": "fedlc"},
    ],
)
def test_every_objective_trains_through_the_clientapp_and_replies_a_valid_model(config):
    reply = _train(_context(), INITIAL, config)
    assert not reply.has_error(), reply.error
    got = reply.content.array_records["arrays"]
    assert list(got.keys()) == list(INITIAL.keys())
    for key, array in got.items():
        assert array.shape == INITIAL[key].shape and np.isfinite(array.numpy()).all()
    assert any(not np.array_equal(got[k].numpy(), INITIAL[k].numpy()) for k in got)
    assert set(reply.content.array_records) == {"arrays"}
    assert math.isfinite(reply.content.metric_records["metrics"]["train-loss"])


def test_fedrs_and_fedlc_change_the_trained_model_of_a_label_skewed_client():
    skewed = {"partition": "classes", "classes-per-client": 2}  # client 0 holds two classes
    plain = _train(_context(**skewed), INITIAL, {"local-objective": "sgd"}).content.array_records["arrays"]
    for config in ({"local-objective": "fedrs"}, {"local-objective": "fedlc"}):
        other = _train(_context(**skewed), INITIAL, config).content.array_records["arrays"]
        assert any(not np.allclose(plain[k].numpy(), other[k].numpy()) for k in plain)


def test_moon_keeps_the_previous_local_model_in_context_state_across_rounds():
    context = _context()
    first = _train(context, INITIAL, {"local-objective": "moon"})
    saved = context.state.array_records[MOON_STATE]
    for key, array in first.content.array_records["arrays"].items():
        np.testing.assert_array_equal(saved[key].numpy(), array.numpy())
    # Round 2 from the same global model: the contrastive term (now non-zero) changes training.
    second = _train(context, INITIAL, {"local-objective": "moon", "moon-mu": 5.0})
    fresh = _train(_context(), INITIAL, {"local-objective": "moon", "moon-mu": 5.0})
    a, b = second.content.array_records["arrays"], fresh.content.array_records["arrays"]
    assert any(not np.allclose(a[k].numpy(), b[k].numpy()) for k in a)
    assert context.state.array_records[MOON_STATE]["classifier.bias"].numpy().tolist() == pytest.approx(
        a["classifier.bias"].numpy().tolist()
    )


def test_a_message_asking_for_a_nonsensical_objective_fails_naming_it():
    # (Flower turns the exception into an error reply, which the server counts as a miss.)
    with pytest.raises(ValueError, match="proximal-mu"):
        _train(_context(), INITIAL, {"local-objective": "moon", "proximal-mu": 0.1})
    with pytest.raises(ValueError, match="unknown local-objective"):
        _train(_context(), INITIAL, {"local-objective": "adam"})
