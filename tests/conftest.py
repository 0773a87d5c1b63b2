"""Shared test setup."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture(autouse=True)
def task_identity():
    """Flower 1.42 stamps each new Message with the running task's identity (set by its runtime).

    In-process tests have no runtime, so they act as run 1 / task 1 on the server node (id 0).
    """
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
