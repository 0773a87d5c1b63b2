"""The user's app under tests/apps/quickstart, run in-process: its modules and a FakeGrid of its nodes.

The app is written as a user writes one (Flower's quickstart style): its own model `Net`
(layers fc1, fc2, fc3 on flat 64-feature digits), its own ClientApp and its own ServerApp.
"""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from tests.fakes import BIG_IDS, FakeGrid

APP_DIR = Path(__file__).parent / "apps" / "quickstart"
RUN_CONFIG = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
NUM_NODES = 10


@pytest.fixture(name="app")
def fixture_app(monkeypatch):
    """The app's modules (task, client_app, server_app), imported from its folder as Flower imports them."""
    monkeypatch.syspath_prepend(str(APP_DIR))
    return (
        importlib.import_module("quickstart_digits.task"),
        importlib.import_module("quickstart_digits.client_app"),
        importlib.import_module("quickstart_digits.server_app"),
    )


def federation(client_app, run_config) -> FakeGrid:
    """NUM_NODES nodes running the app's ClientApp, each with its partition and its own state."""
    contexts = {
        BIG_IDS[i]: Context(
            run_id=1,
            node_id=BIG_IDS[i],
            node_config={"partition-id": i, "num-partitions": NUM_NODES},
            state=RecordDict(),
            run_config=run_config,
        )
        for i in range(NUM_NODES)
    }
    return FakeGrid({node: (lambda message, node=node: client_app(message, contexts[node])) for node in contexts})


def serve(server_app, grid: FakeGrid, run_config: dict):
    """The app's ServerApp `run` against `grid`: (strategy, Flower Result)."""
    return server_app.run(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config))
