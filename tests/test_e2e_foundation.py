"""FedAvg end to end through Flower: a Ray simulation and real SuperLink/SuperNode processes."""

from __future__ import annotations

import pytest

from concatfl.launch import FlowerSession, SimulationError
from concatfl.metrics import read_metrics

from .e2e import FAST, leftover_processes, run_simulation

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


def test_simulation_with_invalid_config_fails_naming_the_key(tmp_path):
    with pytest.raises(SimulationError, match="fedcat-epsilon"):
        run_simulation(tmp_path, {"fedcat-epsilon": 1.5}, num_supernodes=2)
    assert leftover_processes(tmp_path) == []


def test_real_processes_superlink_and_two_supernodes(tmp_path):
    output = tmp_path / "output"
    with FlowerSession(tmp_path, simulation=False) as session:
        for partition_id in range(2):
            session.start_supernode(partition_id, 2)
        run_id = session.submit({**FAST, "num-server-rounds": 2, "output-dir": str(output)})
        session.wait(run_id, timeout=600)
        assert session.status(run_id) == "finished:completed"
    metrics = read_metrics(output)
    assert metrics["num_nodes"] == 2
    assert [r["hops"][0]["replies"] for r in metrics["rounds"]] == [2, 2]
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"]
    assert leftover_processes(tmp_path) == []
