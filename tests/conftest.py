"""Shared test setup, and the rule for tests that need Docker or HAProxy.

Tests marked `compose` run the docker-compose CLI; tests marked `docker` also need a running
Docker engine; tests marked `haproxy` run the fleet door natively (HAProxy, deploy/haproxy.cfg).
On a machine without them those tests are skipped, and the run ends with one line that says how
to run them; with CONCATFL_REQUIRE_DOCKER=1 (set by `.ci/run`, which installs and starts them) a
missing engine, CLI or HAProxy is a failure instead, so CI never skips them.
"""

import os
import shutil
import subprocess

import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity

REQUIRE_DOCKER = "CONCATFL_REQUIRE_DOCKER"
NEEDS_TOOLS = "needs Docker or HAProxy"
HOW_TO_RUN = (
    "install docker.io, docker-compose and haproxy, start dockerd (`.ci/run` does both on Debian), then run the "
    f"tests again; {REQUIRE_DOCKER}=1 turns a missing engine into a failure"
)

# The tests' models are tiny: one thread avoids oversubscribing small CI machines (two threads
# made backward passes ~100x slower on a shared 2-core machine).
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory):
    """concatfl's cache of computed arrays (`concatfl.data.cache`) in a folder of this test run,
    for the tests and every process they start, never the user's."""
    previous = os.environ.get("CONCATFL_CACHE")
    os.environ["CONCATFL_CACHE"] = str(tmp_path_factory.mktemp("concatfl-cache"))
    yield
    if previous is None:
        os.environ.pop("CONCATFL_CACHE", None)
    else:
        os.environ["CONCATFL_CACHE"] = previous


@pytest.fixture(autouse=True)
def task_identity():
    """Flower 1.42 stamps each new Message with the running task's identity (set by its runtime).

    In-process tests have no runtime, so they act as run 1 / task 1 on the server node (id 0).
    """
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield


def _missing(marker: str) -> str | None:
    """What is missing for a test marked `marker` (`haproxy`, `compose` or `docker`), or None."""
    if marker == "haproxy":
        return "no haproxy command" if shutil.which("haproxy") is None else None
    if shutil.which("docker-compose") is None:
        return "no docker-compose command"
    if marker == "docker":
        if shutil.which("docker") is None:
            return "no docker command"
        try:
            running = subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
        except subprocess.TimeoutExpired:
            running = False
        if not running:
            return "no running Docker engine (`docker info` fails)"
    return None


def pytest_collection_modifyitems(config, items):
    if os.environ.get(REQUIRE_DOCKER) == "1":
        return
    missing = {}
    for item in items:
        for marker in ("docker", "compose", "haproxy"):
            if item.get_closest_marker(marker) is None:
                continue
            if marker not in missing:
                missing[marker] = _missing(marker)
            if missing[marker] is not None:
                item.add_marker(pytest.mark.skip(reason=f"{NEEDS_TOOLS}: {missing[marker]}"))
            break


def pytest_terminal_summary(terminalreporter, config):
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if NEEDS_TOOLS in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} Docker/HAProxy tests skipped (not installed here): to run them, {HOW_TO_RUN}.")
