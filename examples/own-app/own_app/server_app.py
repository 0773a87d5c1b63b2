"""The ServerApp: its own model and evaluation, a concatfl strategy chosen by the run config.

    flwr run . --run-config "strategy='fedcat' num-server-rounds=10"
"""

from __future__ import annotations

import time
from logging import INFO

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from concatfl.metrics import summarize, write_metrics
from concatfl.strategies import FedAvg, FedCat, FedSeq, FedSeqInter, RelayStrategy
from own_app.task import Net, load_test, test

app = ServerApp()

NUM_CLASSES = 10
STRATEGIES = ("fedavg", "fedcat", "fedseq", "fedseq-inter")


def make_strategy(name: str, fraction_train: float, seed: int) -> RelayStrategy:
    """The concatfl strategy called `name`, with the few arguments each one needs."""
    if name == "fedavg":
        return FedAvg(fraction_train=fraction_train, seed=seed)
    if name == "fedcat":  # K = round(fraction_train × nodes) devices per round, at least 2
        return FedCat(fraction_train=fraction_train, seed=seed)
    if name in ("fedseq", "fedseq-inter"):
        # FedSeq pre-trains a copy of the model on every client and groups the clients by the
        # returned classifier weights (no exemplar_pool: the `clf` approximator, no server data).
        # Superclients of about 300 samples: three or four of this app's clients.
        fedseq = FedSeqInter if name == "fedseq-inter" else FedSeq
        return fedseq(Net, NUM_CLASSES, min_samples=300, pretrain_epochs=5, fraction_train=fraction_train, seed=seed)
    raise ValueError(f"run-config 'strategy' must be one of {STRATEGIES}, got {name!r}")


def wait_for_nodes(grid: Grid, minimum: int) -> int:
    """Block until `minimum` nodes are connected (FedSeq groups the nodes connected at the start)."""
    while len(nodes := list(grid.get_node_ids())) < minimum:
        log(INFO, "Waiting for nodes: %d connected, %d required", len(nodes), minimum)
        time.sleep(1.0)
    return len(nodes)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train with the chosen strategy, evaluate centrally, write metrics.json."""
    started = time.perf_counter()
    config = context.run_config
    name = str(config["strategy"])
    strategy = make_strategy(name, float(config["fraction-train"]), int(config["seed"]))
    torch.manual_seed(int(config["seed"]))
    num_nodes = wait_for_nodes(grid, int(config["min-nodes"]))
    x_test, y_test = load_test()

    def central_evaluation(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = Net()
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = test(net, x_test, y_test)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=int(config["num-server-rounds"]),
        timeout=float(config["round-timeout"]),
        train_config=ConfigRecord({"lr": float(config["lr"])}),
        evaluate_fn=central_evaluation,
    )
    document = summarize(
        dict(config),
        name,
        num_nodes,
        strategy.setup_record,
        dict(result.evaluate_metrics_serverapp[0]),
        strategy.history,
        time.perf_counter() - started,
    )
    path = write_metrics(str(config["output-dir"]), document)
    log(INFO, "%s: final accuracy %.4f; metrics written to %s", name, document["final_accuracy"], path)
