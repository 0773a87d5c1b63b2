"""examples/own-app (its own model, ClientApp and ServerApp, with concatfl's strategies) through
real `flwr run` simulations on a private SuperLink."""

from __future__ import annotations

import logging

import pytest

from concatfl import PROJECT_DIR
from concatfl.launch import run_simulation

from .e2e import leftover_processes

pytestmark = pytest.mark.e2e

EXAMPLE_DIR = PROJECT_DIR / "examples" / "own-app"
NUM_NODES = 4


# FedSeq: the example's most involved strategy (pre-training, grouping, chains); FedCat with a
# user's app runs through `flwr run` in tests/test_sequential_user_app.py and the soak.
@pytest.mark.parametrize("strategy", ["fedseq"])
def test_the_example_app_runs_a_concatfl_strategy_to_completion(tmp_path, strategy):
    metrics = run_simulation(
        {"strategy": strategy, "num-server-rounds": 2, "min-nodes": NUM_NODES},
        NUM_NODES,
        workdir=tmp_path,
        app_dir=EXAMPLE_DIR,
        timeout=600,
    )  # raises unless the SuperLink reports the run finished:completed
    logging.getLogger(__name__).warning(
        "own-app %s: accuracy %.4f -> %.4f", strategy, metrics["initial"]["accuracy"], metrics["final_accuracy"]
    )
    assert metrics["strategy"] == strategy and metrics["num_nodes"] == NUM_NODES
    assert [record["round"] for record in metrics["rounds"]] == [1, 2]
    if strategy == "fedseq":
        setup = metrics["setup"]
        # No exemplar pool on the server: the classifier-weight approximator. The example's
        # quickstart-style ClientApp takes its epochs from its own run config and says so.
        assert setup["approximator"] == "clf" and setup["clients"] == NUM_NODES
        assert sorted(setup["pretrain_epochs_reported"].values()) == [1] * NUM_NODES
        assert len(setup["pretrain_epochs_differ"]) == NUM_NODES
    assert leftover_processes(tmp_path) == []
