"""Each baseline end to end (SCAFFOLD; FedDyn, MOON, FedRS, FedLC with FedAvg; FedSeq + FedDyn) on
digits, 4 clients, 2 rounds: SCAFFOLD (whose clients keep c_i in `context.state`) as a real `flwr
run` simulation, the others with the ServerApp and ClientApps in process (tests.e2e.run_in_process)."""

from __future__ import annotations

import pytest

from .e2e import leftover_processes, run_in_process, run_simulation

pytestmark = pytest.mark.e2e

MODEL_BYTES = 55_210 * 4  # the digits MLP's float32 parameters


@pytest.mark.parametrize(
    "run_config",
    [
        {"strategy": "scaffold"},
        {"strategy": "fedavg", "local-objective": "feddyn", "feddyn-alpha": 0.1},
        {
            "strategy": "fedseq",
            "local-objective": "feddyn",
            "feddyn-alpha": 0.1,
            "fedseq-pretrain-epochs": 1,
            "fedseq-min-samples": 500,  # ~287 samples per client: superclients of two clients
            "min-available-nodes": 4,
        },
        {"strategy": "fedavg", "local-objective": "moon"},
        {"strategy": "fedavg", "local-objective": "fedrs", "partition": "dirichlet", "alpha": 0.1},
        {"strategy": "fedavg", "local-objective": "fedlc", "partition": "dirichlet", "alpha": 0.1},
    ],
    ids=["scaffold", "fedavg+feddyn", "fedseq+feddyn", "fedavg+moon", "fedavg+fedrs", "fedavg+fedlc"],
)
def test_baseline_runs_end_to_end_and_learns(tmp_path, run_config):
    run = run_simulation if run_config["strategy"] == "scaffold" else run_in_process
    metrics = run(tmp_path, {"num-server-rounds": 2, **run_config}, num_supernodes=4)

    assert metrics["strategy"] == run_config["strategy"] and len(metrics["rounds"]) == 2
    assert metrics["run_config"]["local-objective"] == run_config.get("local-objective", "sgd")
    for record in metrics["rounds"]:
        assert all(hop["misses"] == [] for hop in record["hops"])
        assert record["aggregated"]
        if run_config["strategy"] == "scaffold":
            # x and c down, Δy and Δc up, for each of the 4 nodes: twice FedAvg's bytes
            assert 2 * 4 * MODEL_BYTES < record["bytes_sent"] < 1.05 * 2 * 4 * MODEL_BYTES
            assert 2 * 4 * MODEL_BYTES < record["bytes_received"] < 1.05 * 2 * 4 * MODEL_BYTES
        elif run_config.get("local-objective") == "feddyn":
            assert record["feddyn_h_norm"] > 0
    if run_config["strategy"] == "fedseq":
        assert metrics["setup"]["num_superclients"] == 2
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"] + 0.1
    assert leftover_processes(tmp_path) == []
