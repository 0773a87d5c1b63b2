"""The `overhead` suite: figures read from hand-written metrics.json and latency reports, the
table, merging of separately run parts, the bare loop, and (e2e) part 1 at a tiny size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from concatfl.bench.__main__ import main as bench_main
from concatfl.data.datasets import load_dataset
from concatfl.bench.overhead import (
    Options,
    bare_fedavg,
    cpu_model,
    data_config,
    fedconcat_costs,
    fedseq_latency,
    parse_options,
    process_label,
    simulation_breakdown,
)
from concatfl.bench.overhead_report import describe_data, render_table

from .e2e import leftover_processes
from .test_bench import write_idx


def concat_round(stage: str, seconds: float, kinds: dict[str, int]) -> dict[str, Any]:
    """A FedConcat round record: one hop per kind, `kinds` = hop kind → bytes each way."""
    return {
        "stage": stage,
        "seconds": seconds,
        "bytes_sent": sum(kinds.values()),
        "bytes_received": sum(kinds.values()),
        "stage_bytes": {kind: {"sent": size, "received": size} for kind, size in kinds.items()},
        "hops": [{"seconds": seconds / 2} for _ in kinds],
    }


def test_fedconcat_costs_keep_the_encoder_broadcast_apart_and_give_both_ratios():
    metrics = {
        "rounds": [
            concat_round("encoders", 4.0, {"encoder-training": 1_000_000}),
            concat_round("encoders", 6.0, {"encoder-training": 1_000_000}),
            concat_round("classifier", 9.0, {"encoder-broadcast": 5_000_000, "classifier": 20_000}),
            concat_round("classifier", 0.4, {"classifier": 20_000}),
            concat_round("classifier", 0.6, {"classifier": 30_000}),
        ]
    }
    costs = fedconcat_costs(metrics)
    assert costs["rounds"]["encoder"] == {
        "rounds": 2, "mean_seconds": 5.0, "mean_hop_seconds": 2.5, "mean_bytes": 2_000_000
    }  # fmt: skip
    assert costs["rounds"]["classifier"]["mean_bytes"] == 50_000
    assert costs["rounds"]["encoder broadcast + classifier"]["rounds"] == 1
    assert costs["encoder_over_classifier"] == {"seconds": 10.0, "bytes": 40.0}
    assert fedconcat_costs({"rounds": metrics["rounds"][:2]})["encoder_over_classifier"] is None


def test_simulation_breakdown_splits_start_up_rounds_and_teardown():
    metrics = {
        "wall_seconds": 20.0,
        "final_accuracy": 0.9,
        "rounds": [{"seconds": s, "hops": [{"seconds": s - 0.5}]} for s in (5.0, 3.0, 3.0)],
    }
    # launcher started at 1000, ServerApp ran 1020–1040, launcher returned at 1046
    breakdown = simulation_breakdown(metrics, 1000.0, 1040.0, 1046.0)
    assert breakdown["wall_seconds"] == 46.0 and breakdown["rounds_seconds"] == 11.0
    assert breakdown["before_serverapp_seconds"] == 20.0
    assert breakdown["startup_seconds"] == 29.0  # 20 before the ServerApp + its 9 s outside rounds
    assert breakdown["after_serverapp_seconds"] == 6.0
    assert breakdown["first_round_seconds"] == 5.0 and breakdown["later_rounds_mean_seconds"] == 3.0
    assert breakdown["hop_mean_seconds"] == pytest.approx(9.5 / 3, abs=1e-4)  # hops 4.5, 2.5, 2.5


def latency_report() -> dict[str, Any]:
    """What scripts/deploy_latency.py writes, one variant, 3 nodes, 1 round (FedCat part trimmed)."""
    fedseq_hops = [
        {"seconds": 30.0, "messages": 3, "train_seconds": [2.0, 2.0, 2.0]},  # pre-training hop
        {"seconds": 12.0, "messages": 1, "train_seconds": [2.0]},
        {"seconds": 16.0, "messages": 1, "train_seconds": [3.0]},
        {"seconds": 14.0, "messages": 1, "train_seconds": [4.0]},
    ]
    return {
        "nodes": 3,
        "rounds": 1,
        "client_process_start_seconds": {"python": 0.05, "torch": 2.1},
        "train_message": {"bytes": 224_058, "seconds": 0.005},
        "variants": {"server-pull-0.1s": {"fedcat": {}, "fedseq": {"hops": fedseq_hops}}},
    }


def test_fedseq_latency_reads_the_chain_hops_after_pre_training():
    variant = fedseq_latency(latency_report())["variants"]["server-pull-0.1s"]
    assert variant["chain_hops"] == 3 and variant["hop_seconds"] == [12.0, 16.0, 14.0]
    assert variant["mean_hop_seconds"] == 14.0 and variant["mean_train_seconds"] == 3.0
    assert variant["mean_overhead_seconds"] == 11.0


def test_cpu_model_comes_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\n")
    assert cpu_model(cpuinfo) == "AMD EPYC 7B13"
    assert cpu_model(tmp_path / "missing") == "unknown"


def test_process_labels_name_the_script_or_module_a_python_process_runs():
    assert process_label(["/venv/bin/python", "/venv/bin/flwr-simulation", "--app", "x"]) == "flwr-simulation"
    assert process_label(["/usr/bin/python3.11", "-u", "/ray/_private/log_monitor.py"]) == "log_monitor.py"
    assert process_label(["python", "-m", "ray.util.client.server"]) == "ray.util.client.server"
    assert process_label(["ray::ClientAppActor"]) == "ray::ClientAppActor"
    assert process_label(["/ray/core/src/ray/raylet/raylet", "--node"]) == "raylet"


def test_part_4_from_a_latency_json_is_merged_with_parts_run_earlier(tmp_path, capsys):
    source = tmp_path / "deploy-latency.json"
    source.write_text(json.dumps(latency_report()))
    suite_dir = tmp_path / "out" / "overhead"
    suite_dir.mkdir(parents=True)
    earlier = {
        "rounds": {"encoder": {"rounds": 2, "mean_seconds": 5.0, "mean_hop_seconds": 2.5, "mean_bytes": 2e6}},
        "encoder_over_classifier": None,
        "target": 20.0,
        "run_config": {"classes-per-client": 2, "fedconcat-encoder-rounds": 2, "fedconcat-classifier-rounds": 1},
        "clients": 20,
        "clusters": 5,
        "wall_seconds": 80.0,
        "run": {"command": "earlier", "cpu_model": "X", "cores": 2,
                "load_average_start": [1.0, 1.0, 1.0], "load_average_end": [2.0, 1.0, 1.0]},  # fmt: skip
    }
    (suite_dir / "overhead.json").write_text(json.dumps({"parts": {"2": earlier}}))

    assert bench_main(["overhead", "--out", str(tmp_path / "out"), "--parts", "4", "--latency-json", str(source)]) == 0

    document = json.loads((suite_dir / "overhead.json").read_text())
    assert set(document["parts"]) == {"2", "4"} and document["parts"]["2"]["run"]["command"] == "earlier"
    run = document["parts"]["4"]["run"]
    assert run["command"].endswith(f"-m concatfl.bench overhead --out {tmp_path / 'out'} --parts 4 "
                                    f"--latency-json {source}")  # fmt: skip
    assert run["cores"] >= 1 and len(run["load_average_start"]) == len(run["load_average_end"]) == 3
    table = (suite_dir / "table.md").read_text()
    assert table.index("### 2. FedConcat") < table.index("### 4. FedSeq")
    assert "Command: `earlier` — X, 2 cores; load average (1/5/15 min) 1.00 / 1.00 / 1.00 at the start" in table
    assert "| server-pull-0.1s | 3 | 14.00 | 3.00 | 11.00 |" in table
    assert "224,058 bytes" in table and table in capsys.readouterr().out


def test_table_of_parts_1_and_3_reports_the_ratio_and_memory():
    simulation = {
        "wall_seconds": 60.0, "startup_seconds": 25.0, "before_serverapp_seconds": 15.0, "rounds_seconds": 30.0,
        "after_serverapp_seconds": 5.0, "first_round_seconds": 6.0, "later_rounds_mean_seconds": 2.67,
        "hop_mean_seconds": 2.5, "final_accuracy": 0.9, "peak_rss_bytes": 3.2e9,
        "peak_rss_by_process": {"ray::ClientAppActor": 2e9, "flwr-simulation": 1.2e9},
    }  # fmt: skip
    bare = {"setup_seconds": 0.1, "rounds_seconds": 12.0, "first_round_seconds": 1.5,
            "later_rounds_mean_seconds": 1.17, "final_accuracy": 0.9, "torch_threads": 2}  # fmt: skip
    run = {"command": "c", "cpu_model": "X", "cores": 2, "load_average_start": [1, 1, 1], "load_average_end": [1, 1, 1]}
    per_round = {"simulation_round": 3.0, "bare_round": 1.2, "simulation_hop": 2.5, "bare_train": 1.1,
                 "simulation_server_side": 0.5, "bare_aggregate_and_evaluate": 0.1}  # fmt: skip
    part1 = {
        "run_config": {"dataset": "digits", "local-epochs": 1, "num-server-rounds": 10}, "clients": 10, "concurrent_clients": 2,
        "simulation": simulation, "bare": bare, "ratio_rounds_to_bare": 2.5, "ratio_later_rounds_to_bare": 2.28,
        "target": 1.25,
        "per_round": per_round, "run": run,
    }  # fmt: skip
    part3 = {"runs": [{**simulation, "clients": 500, "per_round": 10}], "run": run}

    table = render_table({"parts": {"1": part1, "3": part3}})

    assert "digits, model default, 10 clients, all train every round, 1 local epoch(s), 10 rounds." in table
    assert "| **rounds / bare** (target ≤ 1.25: missed) | **2.50** |" in table
    assert "| rounds after the first / bare's (without round 1's warm-up) | 2.28 |" in table
    assert "| · start-up until round 1 (SuperLink, runtime, ServerApp set-up, initial evaluation) | 25.00 |" in table
    assert "| training: hop (send → last reply) vs the clients' training | 2.500 | 1.100 | 1.400 |" in table
    assert "| 500 | 10 | 3,200 | 25.0 | 6.00 | 2.67 | 2.50 |" in table
    assert "500 clients: ray::ClientAppActor 2,000, flwr-simulation 1,200" in table
    assert "### 2." not in table and "### 4." not in table


def test_options_refuse_unknown_parts_and_too_many_per_round(tmp_path):
    assert parse_options(["--parts", "2,1,2"]).parts == ("2", "1")
    with pytest.raises(SystemExit):
        parse_options(["--parts", "5"])
    with pytest.raises(SystemExit):
        parse_options(["--clients", "30", "--many-clients", "20,40"])
    for bad in (["--dataset", "imagenet"], ["--dataset", "mnist"], ["--subsample", "600"]):
        with pytest.raises(SystemExit):
            parse_options(bad)  # unknown dataset; a real one without --data-dir; TRAIN without TEST
    with pytest.raises(SystemExit):
        bench_main(["--seeds", "0", "overhead"])  # `overhead` takes its own options: it must come first


def test_bare_loop_is_reproducible_and_learns():
    config = {"num-server-rounds": 2, "min-available-nodes": 3, "seed": 1}
    first, second = bare_fedavg(config, 3), bare_fedavg(config, 3)
    assert [r["accuracy"] for r in first["rounds"]] == [r["accuracy"] for r in second["rounds"]]
    assert first["final_accuracy"] > 0.2 and len(first["rounds"]) == 2
    assert all(r["train_seconds"] > 0 and r["seconds"] >= r["train_seconds"] for r in first["rounds"])


@pytest.mark.e2e
def test_part_1_runs_a_tiny_simulation_against_the_bare_loop(tmp_path):
    assert bench_main(["overhead", "--out", str(tmp_path), "--parts", "1", "--clients", "2", "--rounds", "2"]) == 0

    part = json.loads((tmp_path / "overhead" / "overhead.json").read_text())["parts"]["1"]
    simulation, bare = part["simulation"], part["bare"]
    assert len(simulation["round_seconds"]) == len(bare["rounds"]) == 2
    assert 0 < simulation["startup_seconds"] < simulation["wall_seconds"]
    assert 0 < simulation["rounds_seconds"] < simulation["wall_seconds"] - simulation["startup_seconds"]
    assert part["ratio_rounds_to_bare"] == pytest.approx(simulation["rounds_seconds"] / bare["rounds_seconds"], 0.01)
    assert simulation["final_accuracy"] == pytest.approx(bare["final_accuracy"], abs=0.05)
    assert simulation["peak_rss_bytes"] > 100e6 and "flwr-simulation" in simulation["peak_rss_by_process"]
    assert "**rounds / bare**" in (tmp_path / "overhead" / "table.md").read_text()
    assert leftover_processes(tmp_path) == []


def test_parts_1_and_2_train_on_a_subsample_of_a_real_dataset_when_asked(tmp_path):
    rng = np.random.default_rng(0)
    source = tmp_path / "src"
    source.mkdir()
    for name, size in (("train", 100), ("t10k", 30)):
        write_idx(source / f"{name}-images-idx3-ubyte", rng.integers(0, 256, (size, 28, 28)))
        write_idx(source / f"{name}-labels-idx1-ubyte", np.arange(size) % 10)
    options = parse_options(["--out", str(tmp_path / "out"), "--dataset", "mnist", "--data-dir", str(source),
                             "--subsample", "50,20", "--model", "mcmahan-cnn"])  # fmt: skip

    config = data_config(options, options.model)

    assert config["dataset"] == "mnist" and config["model"] == "mcmahan-cnn"
    assert Path(config["data-dir"]) == tmp_path / "out" / "data" / "mnist-train50-test20-seed0"
    assert len(load_dataset("mnist", config["data-dir"]).y_train) == 50
    assert describe_data(config) == "MNIST (50 train images), model mcmahan-cnn"
    assert data_config(Options(), None) == {"dataset": "digits"}
