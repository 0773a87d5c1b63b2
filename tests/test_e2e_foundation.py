"""FedAvg end to end through a `flwr run` simulation. (Real SuperLink/SuperNode processes:
tests/test_readme_deployment.py runs the README's block; a bad run config refused by the ServerApp
of a real deployment: tests/test_deploy_tls.py; by the launcher before it starts: tests/test_launch.py.)"""

from __future__ import annotations

import pytest

from .e2e import leftover_processes, run_simulation

pytestmark = pytest.mark.e2e


def test_simulation_fedavg_learns_and_writes_metrics(tmp_path):
    metrics = run_simulation(tmp_path, {"strategy": "fedavg", "lr": 0.1}, num_supernodes=4)

    assert metrics["strategy"] == "fedavg" and metrics["num_nodes"] == 4
    assert [r["round"] for r in metrics["rounds"]] == [1, 2, 3]
    for record in metrics["rounds"]:
        assert record["hops"][0]["replies"] == 4 and record["hops"][0]["misses"] == []
        # 4 models of 55,210 float32 parameters go down and come back each round
        assert 4 * 55_210 * 4 < record["bytes_sent"] < 1.05 * 4 * 55_210 * 4
        assert 4 * 55_210 * 4 < record["bytes_received"] < 1.05 * 4 * 55_210 * 4
        assert record["seconds"] > 0
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"] + 0.2
    assert leftover_processes(tmp_path) == []

