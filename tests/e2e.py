"""Helpers for end-to-end tests: real `flwr run` simulations and real SuperLink/SuperNode processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from concatfl.bench.inprocess import simulate_in_process
from concatfl.deployment.processes import leftover_processes  # noqa: F401  (the tests import it from here)
from concatfl.launch import run_simulation as launch_simulation

# Every node of a simulation is there from the start: no settle wait.
FAST = {"num-server-rounds": 3, "local-epochs": 1, "batch-size": 32, "round-timeout": 300.0, "start-settle": 0.0}


def run_simulation(tmp_path: Path, run_config: dict[str, Any], num_supernodes: int) -> dict[str, Any]:
    """Run concatfl through `flwr run` (Ray simulation) and return its metrics.json."""
    return launch_simulation({**FAST, **run_config}, num_supernodes, workdir=tmp_path, timeout=900)


def run_in_process(tmp_path: Path, run_config: dict[str, Any], num_supernodes: int) -> dict[str, Any]:
    """Run concatfl's ServerApp and ClientApps in this process, Flower Messages passed directly
    (concatfl.bench.inprocess: seconds instead of a simulation's ~25 s start-up and teardown);
    metrics.json goes to `tmp_path/output` and is returned. For what a strategy does over a whole
    run; `run_simulation` and the deployment tests prove the transport."""
    return simulate_in_process({**FAST, **run_config}, num_supernodes, tmp_path)
