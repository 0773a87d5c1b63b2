"""concatfl's ServerApp: builds the strategy named by the run config, runs it, writes metrics.json."""

from __future__ import annotations

import time
from logging import INFO

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from .config import RunConfig
from .metrics import summarize, write_metrics
from .runtime import ServerEnv
from .strategies import build_strategy

app = ServerApp()

TRAIN_KEYS = ("lr", "local-epochs", "batch-size", "momentum", "weight-decay", "proximal-mu")


def wait_for_nodes(grid: Grid, minimum: int, poll_seconds: float = 1.0) -> int:
    """Block until `minimum` nodes are connected; returns how many are."""
    while len(nodes := list(grid.get_node_ids())) < minimum:
        log(INFO, "Waiting for nodes: %d connected, %d required", len(nodes), minimum)
        time.sleep(poll_seconds)
    return len(nodes)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the config, then train with the chosen strategy and record everything."""
    started = time.perf_counter()
    config = RunConfig.from_mapping(context.run_config)
    torch.manual_seed(config.seed)
    env = ServerEnv.from_config(config)
    strategy = build_strategy(config, env)
    num_nodes = wait_for_nodes(grid, config.min_available_nodes)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        loss, accuracy = env.evaluate(strategy.global_module(arrays, env.make_model))
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    run_config = config.as_dict()
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(env.make_model().state_dict()),
        num_rounds=config.num_server_rounds,
        timeout=config.timeout,
        train_config=ConfigRecord({key: run_config[key] for key in TRAIN_KEYS}),
        evaluate_fn=evaluate_fn,
    )
    document = summarize(
        run_config,
        config.strategy,
        num_nodes,
        strategy.setup_record,
        dict(result.evaluate_metrics_serverapp[0]),
        strategy.history,
        time.perf_counter() - started,
    )
    path = write_metrics(config.output_dir, document)
    log(INFO, "final accuracy %.4f; metrics written to %s", document["final_accuracy"], path)
