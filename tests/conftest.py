"""Shared test setup."""

import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity

# The tests' models are tiny: one thread avoids oversubscribing small CI machines (two threads
# made backward passes ~100x slower on a shared 2-core machine).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def task_identity():
    """Flower 1.42 stamps each new Message with the running task's identity (set by its runtime).

    In-process tests have no runtime, so they act as run 1 / task 1 on the server node (id 0).
    """
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
