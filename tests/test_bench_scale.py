"""The `scale` benchmark: each cell's run config, its figures from a hand-written metrics.json, the
table, the plot and the command line (the simulations themselves are the benchmark's to run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from concatfl.bench.scale import (
    Options,
    parse_options,
    render_table,
    run_config,
    stage1_hop_seconds,
    summarize,
    write_outputs,
)
from concatfl.config import RunConfig
from concatfl.server_app import timing

OPTIONS = Options(data_dir=Path("/data"))


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "scaffold", "fedcat", "fedseq", "fedseq-inter", "fedconcat", "fedconcat-id"])
def test_every_cell_is_a_valid_run_config_that_trains_m_clients_a_round(strategy):
    config = run_config(strategy, 1000, 100, OPTIONS, Path("/data/mnist-sub"))
    checked = RunConfig.from_mapping(config)  # every key is a real one, with a valid value
    assert checked.min_available_nodes == 1000 and checked.model == "lenet5"
    if strategy == "fedcat":
        assert checked.fedcat_k == 100
    elif strategy.startswith("fedseq"):
        # Superclients of 10 clients holding 6 images each; 10 of the 100 selected per round.
        assert (checked.fedseq_max_clients, checked.fedseq_min_samples) == (10, 60)
        assert round(checked.fraction_train * 1000 / 10) == 10
    else:
        assert round(checked.fraction_train * 1000) == 100


def hop(seconds: float, sent: int = 100) -> dict:
    return {"seconds": seconds, "sent": sent, "replies": sent, "misses": []}


def test_a_cells_figures_split_start_up_stage_1_and_the_server_side_of_each_round(tmp_path):
    metrics = {
        "setup": {"pretraining": hop(30.0, 1000), "seconds": 30.0},
        "rounds": [
            {"seconds": 5.0, "hops": [hop(2.0, 10), hop(2.5, 10)]},
            {"seconds": 4.0, "hops": [hop(1.0, 10), hop(2.0, 10)]},
        ],
        "timing": {"setup_seconds": 34.0, "checkpoint_seconds": [0.2, 0.4], "checkpoint_bytes": 2_000_000},
        "final_accuracy": 0.5,
    }
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    breakdown = {"startup_seconds": 100.0, "wall_seconds": 120.0, "peak_rss_bytes": 2**31, "peak_rss_by_process": {}}
    cell = summarize(metrics, breakdown, tmp_path)
    assert cell["startup_seconds"] == pytest.approx(100.0 - 34.0 - 0.6)  # stage 1 and checkpoints are not start-up
    assert (cell["stage1_seconds"], cell["stage1_hop_seconds"], cell["stage1_server_seconds"]) == (34.0, 30.0, 4.0)
    assert cell["server_seconds"] == [pytest.approx(0.7), pytest.approx(1.4)]  # round − hops + checkpoint
    assert cell["hop_seconds_per_round"] == pytest.approx(3.75) and cell["selected_per_round"] == [20, 20]
    assert cell["metrics_bytes"] == (tmp_path / "metrics.json").stat().st_size and cell["checkpoint_bytes"] == 2_000_000


def test_stage_1_hops_kept_as_a_list_are_counted():
    # FedConcat records its label query and its inference training as a list of hops
    metrics = {"setup": {"stage1": [hop(12.0, 1000), hop(70.0, 1000)], "k": 5, "label_check": {"bound": 0.5}}}
    assert stage1_hop_seconds(metrics) == 82.0


def test_the_table_and_plot_show_every_cell_and_the_ratio_of_the_largest_sizes(tmp_path):
    def cell(clients: int, server: float) -> dict:
        return {
            "strategy": "fedavg", "clients": clients, "per_round": 100, "run_config": {"n": clients},
            "startup_seconds": 20.0 + clients / 100, "stage1_seconds": 0.0, "stage1_hop_seconds": 0.0,
            "stage1_server_seconds": 0.0, "server_seconds_per_round": server, "hop_seconds_per_round": 1.0,
            "peak_rss_bytes": 3 * 2**30, "metrics_bytes": 40_000, "checkpoint_bytes": 500_000,
            "load_average_start": [1.0, 1.0, 1.0], "load_average_end": [2.0, 1.0, 1.0],
        }

    failed = {"strategy": "fedseq", "clients": 10000, "per_round": 100, "run_config": {}, "error": "timed out"}
    document = {"command": "python -m concatfl.bench scale", "machine": "test CPU, 2 cores",
                "cells": [cell(1000, 0.2), cell(10000, 0.5), failed]}
    table = write_outputs(document, tmp_path).read_text()
    assert table == render_table(document)
    assert "| FedAvg | 10,000 | 100 | 120.0 | – | 0.500 |" in table
    assert "| FedSeq | 10,000 | 100 | failed: timed out |" in table
    assert "- FedAvg: 2.50 (missed)" in table
    assert (tmp_path / "scale.png").stat().st_size > 10_000


def test_the_command_line_refuses_what_cannot_run(capsys):
    assert parse_options(["--data-dir", "/d", "--clients", "100,500"]).clients == (100, 500)
    for argv, message in [
        (["--strategies", "fedavg,fedsgd"], "--strategies takes some of"),
        (["--rounds", "1"], "--rounds must be at least 2"),
        (["--clients", "20000"], "exceeds MNIST's 60,000"),
        (["--per-round", "15"], "multiples of 10 for FedSeq"),
    ]:
        with pytest.raises(SystemExit):
            parse_options(["--data-dir", "/d", *argv])
        assert message in capsys.readouterr().err


def test_the_server_times_stage_1_and_every_checkpoint(tmp_path):
    (tmp_path / "checkpoint").write_bytes(b"x" * 1234)
    marks = {"initial_evaluated": 10.0, "first_round_ended": 19.0}
    record = timing(marks, [{"seconds": 4.0}, {"seconds": 3.0}], [0.1, 0.2], str(tmp_path))
    assert record == {"setup_seconds": 5.0, "checkpoint_seconds": [0.1, 0.2], "checkpoint_bytes": 1234}
    # A resumed run has neither an initial evaluation nor a setup.
    assert timing({"first_round_ended": 19.0}, [{"seconds": 4.0}], [0.1], str(tmp_path / "none"))["setup_seconds"] is None
