"""SCAFFOLD, FedAvg + FedDyn and FedSeq + FedDyn end to end: real `flwr run` simulations on digits."""

from __future__ import annotations

import pytest

from .e2e import leftover_processes, run_simulation

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
    ],
    ids=["scaffold", "fedavg+feddyn", "fedseq+feddyn"],
)
def test_baseline_runs_end_to_end_and_learns(tmp_path, run_config):
    metrics = run_simulation(tmp_path, {"num-server-rounds": 2, **run_config}, num_supernodes=4)

    assert metrics["strategy"] == run_config["strategy"] and len(metrics["rounds"]) == 2
    for record in metrics["rounds"]:
        assert all(hop["misses"] == [] for hop in record["hops"])
        assert record["aggregated"]
        if run_config["strategy"] == "scaffold":
            # x and c down, Δy and Δc up, for each of the 4 nodes: twice FedAvg's bytes
            assert 2 * 4 * MODEL_BYTES < record["bytes_sent"] < 1.05 * 2 * 4 * MODEL_BYTES
            assert 2 * 4 * MODEL_BYTES < record["bytes_received"] < 1.05 * 2 * 4 * MODEL_BYTES
        else:
            assert record["feddyn_h_norm"] > 0
    if run_config["strategy"] == "fedseq":
        assert metrics["setup"]["num_superclients"] == 2
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"] + 0.1
    assert leftover_processes(tmp_path) == []
