"""The ServerApp: concatfl's FedAvg, FedCat, FedSeq (default arguments, or those the run config
sets) or FedConcat / FedConcat-ID on `Net`, whose head is `fc3`; evaluated centrally, results
written as concatfl's metrics.json."""

from __future__ import annotations

import time

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from concatfl.config import parse_hop_step
from concatfl.metrics import summarize, write_metrics
from concatfl.strategies import FedAvg, FedCat, FedConcat, FedSeq, FedSeqInter
from concatfl.strategies.aggregation import Aggregation
from concatfl.strategies.base import RelayStrategy

from .task import NUM_CLASSES, load_image_test_data, load_test_data, model_of, test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    started = time.perf_counter()
    strategy, result = run(grid, context)
    document = summarize(
        dict(context.run_config),
        str(context.run_config["variant"]),
        len(list(grid.get_node_ids())),
        strategy.setup_record,
        dict(result.evaluate_metrics_serverapp[0]),
        strategy.history,
        time.perf_counter() - started,
    )
    write_metrics(str(context.run_config["output-dir"]), document)


def run(grid: Grid, context: Context) -> tuple[RelayStrategy, Result]:
    """Build the strategy from the run config and run it to the end."""
    config = context.run_config
    x_test, y_test = load_test_data() if config["dataset"] == "digits" else load_image_test_data(config)
    strategy = build(config, x_test, y_test)
    make_model = model_of(config)[0]

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        loss, accuracy = test(strategy.global_module(arrays, make_model), x_test, y_test)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    torch.manual_seed(int(config["seed"]))
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(make_model().state_dict()),
        num_rounds=int(config["num-server-rounds"]),
        train_config=ConfigRecord({"lr": float(config["lr"])}),
        evaluate_fn=evaluate,
    )
    return strategy, result


def build(config, x_test: torch.Tensor, y_test: torch.Tensor) -> RelayStrategy:
    """The concatfl strategy the run config's `variant` names, with its hop rule, bounds and aggregation."""
    variant = config["variant"]
    guard = {
        "seed": int(config["seed"]),
        "update_clip": float(config["update-clip"]),
        "weight_clip": float(config["weight-clip"]),
    }
    checks = {"history_check": bool(config["history-check"])}  # FedConcat has checks of its own
    aggregation = Aggregation(
        str(config["aggregation"]), float(config["aggregation-trim"]), int(config["aggregation-byzantine"])
    )
    step = str(config["hop-step"])
    hops: dict = {"hop_clip": float(config["hop-clip"])}
    if step:
        hops["hop_step"] = parse_hop_step(step)
    fraction = float(config["fraction-train"])
    make_model, input_shape = model_of(config)
    if variant == "fedavg":
        return FedAvg(fraction_train=fraction, aggregation=aggregation, **guard, **checks)
    if variant == "fedcat":
        return FedCat(k=int(config["fedcat-k"]), **hops, **guard, **checks)
    if variant in ("fedseq", "fedseq-inter"):
        cls = FedSeqInter if variant == "fedseq-inter" else FedSeq
        return cls(make_model, NUM_CLASSES, exemplar_pool=(x_test, y_test), fraction_train=fraction, **hops, **guard, **checks)
    return FedConcat(
        label_inference=variant == "fedconcat-id",
        head="fc3",
        num_clusters=int(config["num-clusters"]),
        encoder_rounds=int(config["encoder-rounds"]),
        classifier_rounds=int(config["classifier-rounds"]),
        classifier_steps=int(config["classifier-steps"]),
        id_samples=2000,
        aggregation=aggregation,
        make_model=make_model,
        input_shape=input_shape,
        **guard,
    )
