"""concatfl's ServerApp: builds the strategy named by the run config, runs it, writes metrics.json."""

from __future__ import annotations

import time
from collections.abc import Callable
from logging import INFO
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid.inmemory_grid import InMemoryGrid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from .checkpoint import CHECKPOINT_FILE, Checkpoint, check_resumable, load_checkpoint, save_checkpoint
from .config import RunConfig
from .metrics import summarize, write_metrics
from .models import resolve_model_name
from .runtime import ServerEnv
from .deployment.grid import StableNodeGrid
from .strategies import build_strategy
from .strategies.common import fingerprint

app = ServerApp()

TRAIN_KEYS = ("lr", "local-epochs", "batch-size", "optimizer", "momentum", "weight-decay", "proximal-mu")


# pylint: disable=too-many-arguments
def wait_for_start(
    grid: Grid,
    minimum: int,
    expected: int = 0,
    settle: float = 0.0,
    wait: float = 0.0,
    poll_seconds: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """The start policy; returns how many nodes the run starts with.

    Waits, without limit, until `minimum` nodes are connected; then at most `wait` seconds more:
    until `expected` nodes are connected when `expected` > 0, else until the set of connected
    nodes has not changed for `settle` seconds. So a deployment whose nodes connect over a few
    seconds (a compose stack coming up, SuperNodes started one after another) does not build
    its groups on whichever nodes came first; nodes that connect later still train (every
    strategy places them, `RelayStrategy.place`).
    """
    while len(nodes := set(grid.get_node_ids())) < minimum:
        log(INFO, "Waiting for nodes: %d connected, %d required", len(nodes), minimum)
        sleep(1.0)
    started = changed = clock()
    why = f"start-wait ({wait:g} s) reached"
    while clock() - started < wait:
        if expected > 0 and len(nodes) >= expected:
            why = f"{expected} expected nodes connected"
            break
        if expected == 0 and clock() - changed >= settle:
            why = f"no node connected or left for {settle:g} s"
            break
        sleep(poll_seconds)
        if (now := set(grid.get_node_ids())) != nodes:
            nodes, changed = now, clock()
    log(INFO, "Starting with %d connected nodes (%s)%s", len(nodes), why,
        f"; expected {expected}" if expected > len(nodes) else "")
    return len(nodes)


def timing(
    marks: dict[str, float], rounds: list[dict], checkpoint_seconds: list[float], output_dir: str
) -> dict[str, object]:
    """metrics.json's `timing`: the strategy's setup before round 1 (FedSeq's stage 1, FedConcat's
    clustering: from the end of the initial evaluation to the start of round 1; None for a
    resumed run, which has neither), the seconds each checkpoint took to write after its round,
    and the checkpoint's size at the end."""
    setup = None
    if "initial_evaluated" in marks and "first_round_ended" in marks:  # not resumed: round 1 is rounds[0]
        setup = round(marks["first_round_ended"] - rounds[0]["seconds"] - marks["initial_evaluated"], 4)
    path = Path(output_dir) / CHECKPOINT_FILE
    return {
        "setup_seconds": setup,
        "checkpoint_seconds": checkpoint_seconds,
        "checkpoint_bytes": path.stat().st_size if path.is_file() else None,
    }


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the config, then train with the chosen strategy and record everything.

    After every round the complete server state goes to `<output-dir>/checkpoint`;
    `resume=true` continues from there.
    """
    started = time.perf_counter()
    config = RunConfig.from_mapping(context.run_config)
    run_config = config.as_dict()
    resumed = load_checkpoint(config.output_dir) if config.resume else None
    if resumed is not None:
        check_resumable(resumed.run_config, run_config)
    torch.manual_seed(config.seed)
    env = ServerEnv.from_config(config)
    strategy = build_strategy(config, env)
    # A simulation registers all its nodes before the ServerApp starts: nothing to settle.
    settle = 0.0 if isinstance(grid, InMemoryGrid) else config.start_settle
    grid = StableNodeGrid(grid, identify_timeout=config.timeout)
    num_nodes = wait_for_start(grid, config.min_available_nodes, config.expected_nodes, settle, config.start_wait)

    initial_arrays = ArrayRecord(env.make_model().state_dict())
    log(
        INFO,
        "dataset %s: %d training and %d evaluation examples, %d classes; model %s: %d parameters; %d nodes",
        config.dataset,
        len(env.data.y_train),
        len(env.eval_y),
        env.num_classes,
        resolve_model_name(config.model, config.dataset),
        sum(array.numpy().size for array in initial_arrays.values()),
        num_nodes,
    )
    earlier_seconds = 0.0
    if resumed is not None:
        strategy.load_state_dict(resumed.strategy_state)
        initial_arrays = ArrayRecord(resumed.arrays)
        torch.set_rng_state(resumed.torch_rng)
        earlier_seconds = resumed.wall_seconds
        log(INFO, "Resuming after round %d from %s (model %s)", resumed.server_round, config.output_dir,
            fingerprint(initial_arrays))

    # When the initial evaluation ended (the strategy's setup starts right after it) and how long
    # each checkpoint took: metrics.json's `timing` (the scale benchmark's start-up, stage 1 and
    # per-round server cost).
    marks: dict[str, float] = {}
    checkpoint_seconds: list[float] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        loss, accuracy = env.evaluate(strategy.global_module(arrays, env.make_model))
        if server_round == 0:
            marks["initial_evaluated"] = time.perf_counter()
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    def initial_metrics(result: Result) -> dict[str, float]:
        return resumed.initial if resumed is not None else dict(result.evaluate_metrics_serverapp[0])

    def write_checkpoint(server_round: int, arrays: ArrayRecord, result: Result) -> None:
        marks.setdefault("first_round_ended", time.perf_counter())
        written = time.perf_counter()
        checkpoint = Checkpoint(
            server_round=server_round,
            arrays=arrays.to_torch_state_dict(),
            strategy_state=strategy.state_dict(),
            initial=initial_metrics(result),
            torch_rng=torch.get_rng_state(),
            run_config=run_config,
            wall_seconds=earlier_seconds + time.perf_counter() - started,
        )
        save_checkpoint(config.output_dir, checkpoint)
        checkpoint_seconds.append(round(time.perf_counter() - written, 4))

    strategy.after_round = write_checkpoint
    result = strategy.start(
        grid=grid,
        initial_arrays=initial_arrays,
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
        initial_metrics(result),
        strategy.history,
        earlier_seconds + time.perf_counter() - started,
        grid.identity_report(),
        strategy.membership.report(),
    )
    document["run_id"] = int(context.run_id)
    document["timing"] = timing(marks, strategy.history, checkpoint_seconds, config.output_dir)
    if resumed is not None:  # what this run continued from, to compare with the checkpoint it found
        document["resumed"] = {"after_round": resumed.server_round, "model": fingerprint(ArrayRecord(resumed.arrays))}
    path = write_metrics(config.output_dir, document)
    log(INFO, "final accuracy %.4f; metrics written to %s", document["final_accuracy"], path)
