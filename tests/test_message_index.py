"""The simulation link state's per-node message index (`concatfl.deployment.message_index`):
each node is given exactly what Flower's scan gives it, at a cost of the messages, not nodes × messages."""

from __future__ import annotations

import dataclasses
import time

import pytest
from flwr.app import ConfigRecord, MessageType, RecordDict
from flwr.proto.task_pb2 import Task  # pylint: disable=no-name-in-module
from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from concatfl.deployment.grid import StableNodeGrid
from concatfl.deployment.message_index import index_messages_by_node

RUN_ID = 1


@pytest.fixture(autouse=True)
def server_identity():
    """Messages pushed through an InMemoryGrid come from the SuperLink's node (id 1)."""
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = RUN_ID, 1, 1
    yield


def simulation(num_nodes: int) -> tuple[InMemoryGrid, list[int]]:
    """The in-memory state, grid and nodes as Flower's simulation sets them up (`_main_loop`)."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = dataclasses.replace(Run.create_empty(RUN_ID), federation_id=NOOP_FEDERATION_ID, primary_task_id=1)
    state.run_ids[RUN_ID] = RunRecord(run=run)
    state.task_store[1] = Task(task_id=1, run_id=RUN_ID)
    nodes = list(_register_nodes(num_nodes, factory))
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return grid, nodes


def push(grid: InMemoryGrid, nodes: list[int], destinations: list[int], ttl: float | None = None) -> list[str]:
    """One message per entry of `destinations` (a position in `nodes`), numbered in order."""
    return list(grid.push_messages([
        grid.create_message(RecordDict({"c": ConfigRecord({"k": k})}), MessageType.QUERY, nodes[position], "g", ttl)
        for k, position in enumerate(destinations)
    ]))


def sweep(grid: InMemoryGrid, nodes: list[int], limit: int | None = 1) -> list[list[int]]:
    """What each node is given when the engine asks for its messages, as message numbers."""
    return [[m.content["c"]["k"] for m in grid.state.get_message_ins(node_id=node, limit=limit)] for node in nodes]


def test_each_node_is_given_what_flowers_scan_gives_it():
    destinations = [0, 2, 2, 4, 0, 0, 3]
    given = {}
    for indexed in (False, True):
        grid, nodes = simulation(5)
        if indexed:
            assert index_messages_by_node(grid.state)
        ids = push(grid, nodes, destinations)
        push(grid, nodes, [1], ttl=0.01)  # expires before it is asked for: deleted, never given
        time.sleep(0.05)
        grid.state.delete_messages({ids[5]})  # pulled and deleted before delivery: never given
        first = sweep(grid, nodes)
        push(grid, nodes, [3, 1])  # stored after a sweep: given at the next
        given[indexed] = (first, sweep(grid, nodes), sweep(grid, nodes, limit=None), sweep(grid, nodes))
        assert len(grid.state.message_ins_store) == len(destinations) - 1 + 2
    assert given[True] == given[False] == (
        [[0], [], [1], [6], [3]],
        [[4], [1], [2], [0], []],
        [[], [], [], [], []],
        [[], [], [], [], []],
    )


def test_a_sweep_checks_each_stored_message_once_not_once_per_node():
    checked = {}
    for indexed in (False, True):
        grid, nodes = simulation(200)
        state = grid.state
        calls = []
        check = state._check_stored_messages  # pylint: disable=protected-access

        def counted(message_ids, run_id=None):
            calls.append(len(message_ids))
            check(message_ids, run_id)

        state._check_stored_messages = counted
        if indexed:
            index_messages_by_node(state)
        push(grid, nodes, list(range(0, 200, 20)))  # 10 messages, for nodes 0, 20, …, 180
        assert sum(len(given) for given in sweep(grid, nodes)) == 10
        first = sum(calls)
        calls.clear()
        sweep(grid, nodes)  # delivered, not yet answered: still stored
        checked[indexed] = (first, sum(calls))
    assert checked[True] == (10, 0)
    assert checked[False][1] == 200 * 10  # Flower's scan: every node passes over every stored message


def test_stable_node_grid_indexes_a_simulation_state_once():
    grid, _ = simulation(3)
    StableNodeGrid(grid)
    indexed = grid.state.get_message_ins
    assert getattr(indexed, "indexed_by_node", False)
    StableNodeGrid(grid)  # a second grid over the same state keeps the one index
    assert grid.state.get_message_ins is indexed


def test_a_state_of_another_shape_keeps_flowers_scan(caplog):
    class OtherState:
        lock = None
        message_ins_store: dict = {}

        def get_message_ins(self, node_id, limit):
            return []

    state = OtherState()
    with caplog.at_level("WARNING"):
        assert not index_messages_by_node(state)
    assert "differs from the one concatfl indexes (no store_message_ins)" in caplog.text
    assert state.get_message_ins.__func__ is OtherState.get_message_ins
