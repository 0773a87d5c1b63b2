"""FedAvg end to end through `python -m concatfl.launch`, as a user runs it: a `flwr run`
simulation that learns, its metrics.json, the log the launcher prints and the files it leaves.
(Real SuperLink/SuperNode processes: tests/test_readme_deployment.py runs the README's block; a
bad run config refused by the ServerApp of a real deployment: tests/test_deploy_tls.py; by the
launcher before it starts: tests/test_launch.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from concatfl import PROJECT_DIR
from concatfl.config import RunConfig
from concatfl.metrics import read_metrics
from concatfl.runtime import ServerEnv
from concatfl.strategies import build_strategy

from .e2e import FAST, leftover_processes

pytestmark = pytest.mark.e2e


def test_a_fedavg_simulation_learns_writes_metrics_and_a_short_log_and_leaves_no_session_files(tmp_path):
    scratch, cwd = tmp_path / "tmp", tmp_path / "cwd"
    scratch.mkdir()
    cwd.mkdir()
    config = {**FAST, "strategy": "fedavg", "lr": 0.1}
    done = subprocess.run(
        [sys.executable, "-m", "concatfl.launch", "--num-supernodes", "4",
         "--run-config", " ".join(f"{key}={value!r}" for key, value in config.items())],
        cwd=cwd,
        env={**os.environ, "TMPDIR": str(scratch), "PYTHONPATH": str(PROJECT_DIR)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    log = done.stdout
    assert done.returncode == 0, log

    metrics = read_metrics(cwd / "outputs")
    assert metrics["strategy"] == "fedavg" and metrics["num_nodes"] == 4
    assert [r["round"] for r in metrics["rounds"]] == [1, 2, 3]
    for record in metrics["rounds"]:
        assert record["hops"][0]["replies"] == 4 and record["hops"][0]["misses"] == []
        # 4 models of 55,210 float32 parameters go down and come back each round
        assert 4 * 55_210 * 4 < record["bytes_sent"] < 1.05 * 4 * 55_210 * 4
        assert 4 * 55_210 * 4 < record["bytes_received"] < 1.05 * 4 * 55_210 * 4
        assert record["seconds"] > 0
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"] + 0.2

    # The log: Flower's 4 start lines (SuperLink, log stream, simulation, federation size), the
    # start line (how many nodes the run starts with), the run line (dataset, model, nodes), the
    # strategy's summary, one line per round, the end of the strategy, the final accuracy and the
    # launcher's last line. Never data (a summary once printed the server's dataset tensors).
    summary = build_strategy(run_config := RunConfig.from_mapping(config), ServerEnv.from_config(run_config)).summary_lines()
    lines = log.splitlines()
    assert len(lines) <= 4 + 2 + len(summary) + 3 + 3, log
    assert sum("[ROUND " in line for line in lines) == 3, log
    assert "tensor" not in log and "Traceback" not in log and "default simulated SuperNodes" not in log
    assert "\x1b[" not in log  # a pipe is not a terminal: no colour codes in the saved log
    assert lines[-1].endswith(f"metrics: {cwd / 'outputs'}/metrics.json")
    assert not list(scratch.glob("concatfl-run-*"))  # the session's files are removed
    assert leftover_processes(tmp_path) == []
