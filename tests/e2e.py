"""Helpers for end-to-end tests: real `flwr run` simulations and real SuperLink/SuperNode processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil

from concatfl.bench.inprocess import simulate_in_process
from concatfl.launch import run_simulation as launch_simulation

FAST = {"num-server-rounds": 3, "local-epochs": 1, "batch-size": 32, "round-timeout": 300.0}


def run_simulation(tmp_path: Path, run_config: dict[str, Any], num_supernodes: int) -> dict[str, Any]:
    """Run concatfl through `flwr run` (Ray simulation) and return its metrics.json."""
    return launch_simulation({**FAST, **run_config}, num_supernodes, workdir=tmp_path, timeout=900)


def run_in_process(tmp_path: Path, run_config: dict[str, Any], num_supernodes: int) -> dict[str, Any]:
    """Run concatfl's ServerApp and ClientApps in this process, Flower Messages passed directly
    (concatfl.bench.inprocess: seconds instead of a simulation's ~25 s start-up and teardown);
    metrics.json goes to `tmp_path/output` and is returned. For what a strategy does over a whole
    run; `run_simulation` and the deployment tests prove the transport."""
    return simulate_in_process({**FAST, **run_config}, num_supernodes, tmp_path)


def leftover_processes(workdir: Path) -> list[str]:
    """Processes a test left running: its own descendants, or any process naming its workdir.

    (Scoped to the test, not to every Flower process on the machine, so that runs in other
    shells do not count as this test's leaks.)
    """
    suspects = psutil.Process().children(recursive=True)
    for process in psutil.process_iter(["cmdline"]):
        if str(workdir) in " ".join(process.info["cmdline"] or []):
            suspects.append(process)
    leaked = []
    for process in suspects:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                leaked.append(" ".join(process.cmdline()))
        except psutil.NoSuchProcess:
            continue
    return leaked
