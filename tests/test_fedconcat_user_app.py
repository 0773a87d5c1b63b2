"""FedConcat and FedConcat-ID from a user's own Flower app (tests/apps/quickstart).

The app is written as a user writes one: its own model `Net` (layers fc1, fc2, fc3 on flat
64-feature digits), its own ClientApp (ordinary training plus the three handlers that
docs/strategies.md asks for) and its own ServerApp (FedConcat with ``head="fc3"``, central
evaluation). The in-process tests run the app's real ClientApp and ServerApp code on FakeGrid
nodes; the e2e test runs it once through `flwr run`.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from flwr.app import ArrayRecord
from torch import nn

from concatfl.protocol import FEATURES_MESSAGE_TYPE, HEAD_MESSAGE_TYPE, HEAD_NAME, LABELS_MESSAGE_TYPE
from concatfl.strategies import FedConcat
from tests.fakes import BIG_IDS

from .e2e import leftover_processes
from .user_app import APP_DIR, NUM_NODES, RUN_CONFIG, federation, fixture_app, serve  # noqa: F401  (fixture)

GROUPS = 5  # partition i holds the classes {2g, 2g+1}, g = i mod 5 (quickstart_digits.task)


@pytest.mark.parametrize("variant", ["fedconcat", "fedconcat-id"])
def test_a_users_app_runs_fedconcat_on_its_own_model(app, variant):
    task, client, server = app
    run_config = {**RUN_CONFIG, "variant": variant}
    grid = federation(client.app, run_config)
    strategy, result = serve(server, grid, run_config)

    rounds = RUN_CONFIG["encoder-rounds"] + RUN_CONFIG["classifier-rounds"]
    assert [record["stage"] for record in strategy.history] == (
        ["encoders"] * RUN_CONFIG["encoder-rounds"] + ["classifier"] * RUN_CONFIG["classifier-rounds"]
    )
    assert all(hop["misses"] == [] for record in strategy.history for hop in record["hops"])
    assert strategy.setup_record["variant"] == variant and strategy.setup_record["unreported_nodes"] == []
    # The clusters are the five label groups (reported distributions, or inferred from flat inputs).
    clusters = {frozenset(cluster["members"]) for cluster in strategy.setup_record["clusters"]}
    assert clusters == {frozenset(BIG_IDS[i] for i in range(NUM_NODES) if i % GROUPS == g) for g in range(GROUPS)}
    # What went over the wire: the head's name with the encoders, once per node; the head alone after.
    sent = Counter(message.metadata.message_type for message in grid.sent)
    assert sent[LABELS_MESSAGE_TYPE] == (NUM_NODES if variant == "fedconcat" else 0)
    assert sent[FEATURES_MESSAGE_TYPE] == NUM_NODES
    assert sent[HEAD_MESSAGE_TYPE] == NUM_NODES * RUN_CONFIG["classifier-rounds"]
    features = [m for m in grid.sent if m.metadata.message_type == FEATURES_MESSAGE_TYPE]
    assert {m.content["config"][HEAD_NAME] for m in features} == {"fc3"}
    heads = [m for m in grid.sent if m.metadata.message_type == HEAD_MESSAGE_TYPE]
    assert {tuple(m.content["arrays"].keys()) for m in heads} == {("classifier.weight", "classifier.bias")}
    # The result: Net's encoders under their own names, one linear head over the 5 × 32 features.
    assert {key for key in result.arrays.keys() if key.startswith("encoders.4.")} == {
        f"encoders.4.fc{i}.{part}" for i in (1, 2) for part in ("weight", "bias")
    }
    assert tuple(result.arrays["classifier.weight"].shape) == (10, GROUPS * 32)
    accuracy = {r: float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()}
    assert set(accuracy) == set(range(rounds + 1))
    assert accuracy[rounds] > accuracy[0] + 0.5, accuracy
    # The returned model is the evaluated one, rebuilt from Net alone.
    x_test, y_test = task.load_test_data()
    _, final = task.test(strategy.global_module(result.arrays, task.Net), x_test, y_test)
    assert final == pytest.approx(accuracy[rounds], abs=1e-9)
    strategy.check_model(result.arrays)  # a resumed run starts from its ConcatModel: accepted


def test_fedconcat_without_head_refuses_the_users_model_before_any_message(app):
    """The default head is concatfl's `classifier`; the message says what to pass and what the
    model and the ClientApp need."""
    task, client, _ = app
    grid = federation(client.app, RUN_CONFIG)
    strategy = FedConcat(num_clusters=2, make_model=task.Net, input_shape=(task.NUM_FEATURES,))
    with pytest.raises(ValueError) as error:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(task.Net().state_dict()))
    message = str(error.value)
    for part in (
        "FedConcat cannot split the model into encoder and head: head='classifier': ",
        "the model's state has no 'classifier.weight' or 'classifier.bias'",
        "The model's keys: fc1.weight, fc1.bias, fc2.weight, fc2.bias, fc3.weight, fc3.bias",
        "its last linear layer is 'fc3' (head='fc3')",
        "forward ends with a linear head, `return self.<head>(features)`",
        "concatfl.fedconcat_client (label query, features, head training)",
        "docs/strategies.md, 'FedConcat with your own model'",
    ):
        assert part in message
    assert grid.sent == []


class ProbabilitiesNet(nn.Module):
    """A model whose output is not its last linear layer's: softmax comes after fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 8)
        self.fc2 = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc2(torch.relu(self.fc1(x))), dim=1)


def test_a_model_that_does_not_end_with_its_head_is_refused_before_any_message(app):
    _, client, _ = app
    grid = federation(client.app, RUN_CONFIG)
    strategy = FedConcat(head="fc2", make_model=ProbabilitiesNet, input_shape=(64,))
    with pytest.raises(ValueError, match=r"head='fc2': the model's output is not fc2\(features\)") as error:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(ProbabilitiesNet().state_dict()))
    assert "docs/strategies.md" in str(error.value) and grid.sent == []


@pytest.mark.parametrize("head", ["", ".fc3", "fc3."])
def test_a_head_that_names_no_layer_is_refused_at_construction(head):
    with pytest.raises(ValueError, match="head must name the model's last linear layer"):
        FedConcat(head=head)


@pytest.mark.e2e
def test_a_users_app_runs_fedconcat_id_through_flwr_run(tmp_path):
    """The same app through `flwr run` (Ray simulation): Flower imports the user's modules and
    routes FedConcat's messages to the ClientApp's handlers."""
    from concatfl.launch import run_simulation

    summary = run_simulation(
        {"variant": "fedconcat-id", "encoder-rounds": 2, "classifier-rounds": 2},
        NUM_NODES,
        workdir=tmp_path,
        app_dir=APP_DIR,
        timeout=900,
    )
    assert [record["stage"] for record in summary["rounds"]] == ["encoders"] * 2 + ["classifier"] * 2
    assert sum(cluster["size"] for cluster in summary["setup"]["clusters"]) == NUM_NODES
    assert summary["final_accuracy"] > summary["initial"]["accuracy"] + 0.3
    assert leftover_processes(tmp_path) == []
