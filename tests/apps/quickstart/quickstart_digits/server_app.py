"""The ServerApp: concatfl's FedAvg, FedCat, FedSeq (default arguments, or those the run config
sets) or FedConcat / FedConcat-ID on `Net`, whose head is `fc3`, or Flower's own FedAvg for
comparison; evaluated centrally, results written as concatfl's metrics.json."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import Result
from torch import nn

from concatfl.config import parse_hop_step
from concatfl.metrics import summarize, write_metrics
from concatfl.strategies import FedAvg, FedCat, FedConcat, FedSeq, FedSeqInter
from concatfl.strategies.aggregation import Aggregation
from concatfl.strategies.base import RelayStrategy
from concatfl.strategies.wire import message_bytes

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


def run(grid: Grid, context: Context) -> tuple[RelayStrategy | RecordedFlowerFedAvg, Result]:
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


def build(config, x_test: torch.Tensor, y_test: torch.Tensor) -> RelayStrategy | RecordedFlowerFedAvg:
    """The strategy the run config's `variant` names: concatfl's with its hop rule, bounds and
    aggregation, or Flower's FedAvg with its defaults."""
    variant = config["variant"]
    if variant == "flower-fedavg":
        return RecordedFlowerFedAvg(fraction_train=float(config["fraction-train"]))
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


class RecordedFlowerFedAvg(FlowerFedAvg):
    """Flower's own FedAvg (no evaluation round: the server evaluates), keeping the per-round
    record concatfl's strategies keep (`history`), so both write the same metrics.json."""

    def __init__(self, fraction_train: float) -> None:
        super().__init__(fraction_train=fraction_train, fraction_evaluate=0.0)
        self.setup_record: dict = {}  # no stage before round 1
        self.history: list[dict] = []

    def global_module(self, arrays: ArrayRecord, make_model: Callable[[], nn.Module]) -> nn.Module:
        model = make_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        return model

    def start(self, *, grid: Grid, evaluate_fn, **kwargs) -> Result:
        counted = _CountingGrid(grid)
        round_started = time.perf_counter()

        def recorded(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            nonlocal round_started
            metrics = evaluate_fn(server_round, arrays)
            if server_round > 0:
                seconds = time.perf_counter() - round_started
                self.history.append({"round": server_round, **counted.take(), "seconds": round(seconds, 4), **metrics})
            round_started = time.perf_counter()
            return metrics

        return super().start(grid=counted, evaluate_fn=recorded, **kwargs)


class _CountingGrid:
    """`grid`, counting the bytes of the messages sent through it and of their replies."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self._sent = self._received = 0

    def __getattr__(self, name: str):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *args, **kwargs):
        messages = list(messages)
        self._sent += sum(message_bytes(message) for message in messages)
        replies = list(self._grid.send_and_receive(messages, *args, **kwargs))
        self._received += sum(message_bytes(reply) for reply in replies)
        return replies

    def take(self) -> dict[str, int]:
        """The bytes since the last take."""
        counts = {"bytes_sent": self._sent, "bytes_received": self._received}
        self._sent = self._received = 0
        return counts
