"""README.md's "Real processes (deployment)" block, run as it is written there: a real
SuperLink and two SuperNodes on 127.0.0.1, a 2-round run, everything stopped at the end.

Only what must differ for a test is replaced (each replaced text must be in the block, so a
changed README fails here rather than silently running something else): the ports (parallel
test runs), the log and output paths, FLWR_HOME, and the virtualenv (the one running pytest).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from concatfl import PROJECT_DIR
from concatfl.deployment.processes import free_port
from concatfl.metrics import read_metrics

pytestmark = pytest.mark.e2e

SECTION = "### Real processes (deployment)"


def readme_block() -> str:
    """The first ```bash block after the deployment heading in README.md."""
    text = (PROJECT_DIR / "README.md").read_text()
    match = re.search(r"```bash\n(.*?)```", text[text.index(SECTION):], re.DOTALL)
    assert match, f"no bash block under {SECTION!r} in README.md"
    return match.group(1)


def localized(block: str, replacements: dict[str, str]) -> str:
    for text, replacement in replacements.items():
        assert text in block, f"README's deployment block no longer contains {text!r}"
        block = block.replace(text, replacement)
    return block


def processes_of(flwr_home: Path) -> list[psutil.Process]:
    """Processes started with this FLWR_HOME in their environment (the block's, and only its)."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get("FLWR_HOME") == str(flwr_home) and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def stop_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(processes, timeout=10)


def test_the_readme_deployment_block_runs_as_written(tmp_path):
    flwr_home = tmp_path / "flwr-home"
    superlink_port = free_port()
    block = localized(
        readme_block(),
        {
            "source .venv/bin/activate": f"source {Path(sys.prefix) / 'bin' / 'activate'}",
            "127.0.0.1:8000": f"127.0.0.1:{superlink_port}",
            "--port 8000": f"--port {superlink_port}",
            "--port 9094": f"--port {free_port()}",
            "--port 9095": f"--port {free_port()}",
            "/tmp/concatfl-": f"{tmp_path}/concatfl-",
            "'/tmp/concatfl'": f"'{tmp_path / 'output'}'",
        },
    )
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "COLUMNS": "200"}  # a terminal wide enough that `flwr ls` prints the status in full
    env.pop("VIRTUAL_ENV", None)
    shell = subprocess.Popen(
        ["bash", "-c", block], cwd=PROJECT_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        output, _ = shell.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        stop_all([psutil.Process(shell.pid), *processes_of(flwr_home)])
        output, _ = shell.communicate()
        pytest.fail(f"the block did not finish within 540 s:\n{output[-4000:]}")
    finally:
        # What the block's own `kill` left (it should leave nothing; checked below) is stopped here.
        deadline = time.monotonic() + 30
        while (left := processes_of(flwr_home)) and time.monotonic() < deadline:
            time.sleep(1)
        stop_all(left)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("concatfl-*.log")))
    assert "finished:completed" in output, f"{output[-4000:]}{logs}"
    assert left == [], f"still running after the block: pids {[p.pid for p in left]}"
    assert (flwr_home / "config.toml").read_text().count("[superlink.mine]") == 1
    metrics = read_metrics(tmp_path / "output")
    assert metrics["num_nodes"] == 2 and [r["round"] for r in metrics["rounds"]] == [1, 2]
    assert [r["hops"][0]["replies"] for r in metrics["rounds"]] == [2, 2]
    # Both SuperNodes answered the identity query: nodes are named by partition id.
    assert metrics["node_identity"] == {"identified": 2, "late": [], "flower_ids": [], "unanswered": []}
