"""The ServerApp: concatfl's FedConcat (or FedConcat-ID) on `Net`, whose head is `fc3`, or FedCat
or FedSeq with their default arguments; evaluated centrally."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from concatfl.strategies import FedCat, FedConcat, FedSeq
from concatfl.strategies.base import RelayStrategy

from .task import NUM_CLASSES, NUM_FEATURES, Net, load_test_data, test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy, result = run(grid, context)
    accuracies = {
        int(server_round): float(metrics["accuracy"])
        for server_round, metrics in result.evaluate_metrics_serverapp.items()
    }
    output = Path(str(context.run_config["output-dir"]))
    output.mkdir(parents=True, exist_ok=True)
    summary = {"accuracy": accuracies, "setup": strategy.setup_record, "rounds": strategy.history}
    (output / "metrics.json").write_text(json.dumps(summary, default=str))


def run(grid: Grid, context: Context) -> tuple[RelayStrategy, Result]:
    """Build the strategy from the run config and run it to the end."""
    config = context.run_config
    x_test, y_test = load_test_data()
    strategy = build(config, x_test, y_test)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        loss, accuracy = test(strategy.global_module(arrays, Net), x_test, y_test)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    torch.manual_seed(0)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=int(config["num-server-rounds"]),
        train_config=ConfigRecord({"lr": float(config["lr"])}),
        evaluate_fn=evaluate,
    )
    return strategy, result


def build(config, x_test: torch.Tensor, y_test: torch.Tensor) -> RelayStrategy:
    """The concatfl strategy the run config's `variant` names."""
    variant = config["variant"]
    if variant == "fedcat":
        return FedCat()
    if variant == "fedseq":
        return FedSeq(Net, NUM_CLASSES, exemplar_pool=(x_test, y_test))
    return FedConcat(
        label_inference=variant == "fedconcat-id",
        head="fc3",
        num_clusters=int(config["num-clusters"]),
        encoder_rounds=int(config["encoder-rounds"]),
        classifier_rounds=int(config["classifier-rounds"]),
        classifier_steps=int(config["classifier-steps"]),
        id_samples=2000,
        make_model=Net,
        input_shape=(NUM_FEATURES,),
        seed=0,
    )
