"""concatfl's SuperNode launcher and the ServerApp's reply backoff: Flower 1.42's fixed waits, shortened.

The launcher and `use_short_reply_backoff` replace sleeps and a backoff found by value in Flower's
own modules. Before they do, `concatfl.deployment.compat` reads those modules' source: the
installed Flower must have the expected shape (checked here, so an upgrade that changes it shows
up in the suite), and a Flower that differs keeps its own waits with a warning instead of being
refused (tested here on modules of another shape). Real SuperNodes run through the launcher in
every deployment test that uses the warm executor (tests/deploy.py's default).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import time
import types

import flwr.superlink.grid.http_grid as http_grid
import pytest
from flwr.app import ConfigRecord, Message, Metadata, RecordDict
from flwr.proto.message_pb2 import PushObjectRequest, PushObjectResponse  # pylint: disable=no-name-in-module
from flwr.proto.node_pb2 import Node  # pylint: disable=no-name-in-module
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.inflatable.inflatable_utils import ObjectPushError
from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
from flwr.supercore.run import Run, RunNotRunningException
from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

import concatfl.deployment.grid as grid_module
import concatfl.deployment.supernode as supernode
from concatfl.deployment.grid import (
    PUSH_TRIES,
    StableNodeGrid,
    make_push_object_fn_retrying,
    pull_objects_in_time,
    retry_object_pushes,
    use_short_reply_backoff,
)
from concatfl.deployment.compat import (
    PULL_BACKOFF_KEYWORDS,
    calls,
    clientapp_steps_problem,
    grid_pull_problem,
    grid_push_problem,
    supernode_loop_problem,
)
from concatfl.deployment.warm_executor import SHORT_PULL_BACKOFF

from .fakes import FakeGrid

SUPERNODE_LOOP = importlib.import_module("flwr.supernode.start_client_internal")


def test_the_installed_flower_has_the_shape_every_adjustment_expects():
    sleeps = sorted(ast.literal_eval(call.args[0]) for call in calls(SUPERNODE_LOOP, "sleep"))
    assert sleeps == [supernode.FLOWER_CHECK_SLEEP, supernode.FLOWER_CHECK_SLEEP, supernode.FLOWER_IDLE_SLEEP]
    assert supernode_loop_problem(SUPERNODE_LOOP) is None
    assert grid_pull_problem(http_grid) is None
    assert grid_push_problem(http_grid) is None
    assert clientapp_steps_problem() is None
    assert set(SHORT_PULL_BACKOFF) == PULL_BACKOFF_KEYWORDS  # what the pull check looks for


def changed_loop(source: str) -> types.ModuleType:
    """A module whose source is `source`, as a Flower of another shape would have it."""
    module = types.ModuleType("changed_loop")
    exec(compile(source, "<changed>", "exec"), module.__dict__)  # noqa: S102  (test input)
    module.__dict__["__source__"] = source
    return module


KNOWN_LOOP = (
    "import time\ndef pull_objects(*args, **kwargs):\n    pass\ndef _pull_and_store_message(state, object_store):\n"
    "    return 7\ndef loop():\n    run_id = _pull_and_store_message(state=1, object_store=2)\n    time.sleep(3)\n    time.sleep(0.5)\n"
    "    time.sleep(0.5)\n    pull_objects(1, 2)\n"
)


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("import time\ndef loop():\n    time.sleep(3)\n    time.sleep(0.5)\n", "fixed sleeps [0.5, 3]"),
        ("import time\ndef _pull_and_store_message():\n    pass\ndef loop():\n"
         "    _pull_and_store_message(state=1, object_store=2)\n    time.sleep(3)\n    time.sleep(0.5)\n    time.sleep(0.5)\n",
         "0 calls of pull_objects"),
        ("import time\ndef loop(pull_objects):\n    time.sleep(3)\n    time.sleep(0.5)\n    time.sleep(0.5)\n"
         "    pull_objects(1, 2)\n", "0 calls of _pull_and_store_message"),
        ("import time\ndef _pull_and_store_message():\n    pass\ndef loop(pull_objects):\n"
         "    _pull_and_store_message(state=1, object_store=2)\n    time.sleep(3)\n    time.sleep(0.5)\n    time.sleep(0.5)\n    pull_objects(1, 2, initial_backoff=1)\n",
         "already called with a backoff"),
        (KNOWN_LOOP.replace("state=1, object_store=2", "1, 2"), "called without the keywords ['object_store', 'state']"),
    ],
)
def test_a_loop_of_another_shape_keeps_flowers_waits_with_a_warning(monkeypatch, capsys, source, problem):
    monkeypatch.setattr(inspect, "getsource", lambda module: module.__dict__["__source__"])
    loop = changed_loop(source)
    assert problem in supernode_loop_problem(loop)
    assert not supernode.adjust(loop, idle_poll=0.2)
    assert f"({supernode_loop_problem(loop)}); running it with Flower's own waits" in capsys.readouterr().err
    assert not hasattr(loop, "pull_objects") or not isinstance(loop.pull_objects, functools.partial)
    assert loop.time is time  # the waits are Flower's


def test_a_loop_of_the_known_shape_is_adjusted(monkeypatch):
    monkeypatch.setattr(inspect, "getsource", lambda module: module.__dict__["__source__"])
    loop = changed_loop(KNOWN_LOOP)
    stored = []
    assert supernode.adjust(loop, idle_poll=0.2, on_message=lambda: stored.append(1))
    assert loop.time is not time and loop.pull_objects.keywords == SHORT_PULL_BACKOFF
    assert loop._pull_and_store_message(state=1, object_store=2) == 7 and stored == [1]  # the step tells the executor
    assert not supernode.adjust(changed_loop(KNOWN_LOOP), idle_poll=None)  # CONCATFL_SUPERNODE_WAITS=flower


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_idle_polls_lengthen_with_the_time_since_the_last_message_up_to_flowers_own():
    clock = Clock()
    polls = supernode.IdlePolls(0.2, clock)
    waits = []
    for idle in (0.0, 1.0, 5.0, 10.0, 30.0, 600.0):
        clock.now = 100.0 + idle
        waits.append(polls.wait_seconds())
    assert waits == pytest.approx([0.2, 0.2, 0.5, 1.0, 3.0, 3.0])
    polls.message_pulled()
    assert polls.wait_seconds() == 0.2  # a message: fast again


def test_each_fixed_sleep_maps_to_its_short_wait():
    polls = supernode.IdlePolls(0.2, Clock())
    assert supernode.short_sleep(3, polls) == 0.2
    assert supernode.short_sleep(0.5, polls) == supernode.CHECK_INTERVAL == 0.05
    assert supernode.short_sleep(1.5, polls) == 1.5


def test_shorten_waits_changes_only_the_given_module(monkeypatch):
    slept, pulled, stored = [], [], []
    monkeypatch.setattr(supernode.time, "sleep", slept.append)
    clock = Clock()
    loop = types.ModuleType("loop")
    loop.time = supernode.time
    loop.pull_objects = lambda ids, fn, **kwargs: pulled.append((ids, kwargs))
    loop._pull_and_store_message = lambda state, object_store: None if clock.now < 200 else 42
    polls = supernode.IdlePolls(0.3, clock)
    supernode.shorten_waits(loop, polls, on_message=lambda: stored.append(clock.now))
    loop.time.sleep(3)
    loop.time.sleep(0.5)
    clock.now = 150.0  # idle for 50 s
    assert loop._pull_and_store_message(state=None, object_store=None) is None
    loop.time.sleep(3)
    clock.now = 200.0
    assert loop._pull_and_store_message(state=None, object_store=None) == 42  # a message: fast polls, and the executor is told
    loop.time.sleep(3)
    loop.pull_objects(["a"], None)
    assert slept == [0.3, 0.05, 3.0, 0.3] and stored == [200.0]
    assert pulled == [(["a"], {"initial_backoff": 0.05, "backoff_cap": 0.1, "max_tries_per_object": None})]
    assert loop.time is not supernode.time and supernode.time.sleep == slept.append  # the process's `time` is untouched


def message_step_of_a_run(run_id: int, running: bool):
    """Flower's own message step on a real node state, for one train message of run `run_id`
    (already known to the node) whose objects the SuperLink serves if the run is `running`, else
    answers that it is not: (state, call, message)."""
    state = InMemoryNodeState(object_store := InMemoryObjectStore())
    state.set_node_id(7)
    state.store_run(Run.create_empty(run_id))
    metadata = Metadata(run_id=run_id, message_id="", src_node_id=1, dst_node_id=7, reply_to_message_id="",
                        group_id="1", created_at=0.0, ttl=3600.0, message_type="train")
    message = Message(content=RecordDict({"config": ConfigRecord({"lr": 0.1})}), metadata=metadata)
    message.metadata.__dict__["_message_id"] = message.object_id
    objects = {object_id: found.deflate() for object_id, found in get_all_nested_objects(message).items()}

    def pull_object(_run_id: int, object_id: str) -> bytes:
        if not running:
            raise RunNotRunningException()
        return objects[object_id]

    def call():
        return SUPERNODE_LOOP._pull_and_store_message(
            state=state, object_store=object_store, node_config={}, receive=lambda: (message, get_object_tree(message)),
            get_run=None, get_fab=None, pull_object=pull_object, confirm_message_received=lambda *ids: None,
            trusted_entities=None)

    return state, call, message


def test_a_message_of_a_run_that_stopped_leaves_no_task_behind(monkeypatch):
    # Flower 1.42's own step keeps the task and the listed message whose objects never come (the
    # SuperLink restarted and lost the run): an executor would wait for them.
    state, call, message = message_step_of_a_run(5, running=False)
    assert call() is None
    (task,) = state.get_tasks()
    assert task.status.status == "pending" and list(state.msg_store) == [message.object_id]
    # Through the launcher: the message is dropped and the task failed, as Flower's step does
    # when a pull fails for another reason; the executor is not woken.
    for name in ("time", "pull_objects", "_pull_and_store_message"):
        monkeypatch.setattr(SUPERNODE_LOOP, name, getattr(SUPERNODE_LOOP, name))
    woken = []
    supernode.shorten_waits(SUPERNODE_LOOP, supernode.IdlePolls(0.2), on_message=lambda: woken.append(1))
    state, call, message = message_step_of_a_run(5, running=False)
    assert call() is None and woken == []
    (task,) = state.get_tasks()
    assert (task.status.status, task.status.sub_status) == ("finished", "failed")
    assert "no longer running" in task.status.details
    assert not state.msg_store and state.object_store.get(message.object_id) is None
    # A message whose objects arrive is stored, its task left for the executor, which is woken.
    state, call, message = message_step_of_a_run(6, running=True)
    assert call() == 6 and woken == [1]
    (task,) = state.get_tasks()
    assert task.status.status == "pending" and list(state.msg_store) == [message.object_id]


def test_the_environment_picks_the_waits_and_bad_values_name_the_variable():
    assert supernode.idle_poll_from_env({}) == supernode.DEFAULT_IDLE_POLL == 0.2
    assert supernode.idle_poll_from_env({"CONCATFL_SUPERNODE_IDLE_POLL": "0.5"}) == 0.5
    assert supernode.idle_poll_from_env({"CONCATFL_SUPERNODE_WAITS": "flower"}) is None
    for bad in ("0", "5", "fast", "nan"):
        with pytest.raises(ValueError, match=f"CONCATFL_SUPERNODE_IDLE_POLL must be .* from 0.01 to 3.0, got '{bad}'"):
            supernode.idle_poll_from_env({"CONCATFL_SUPERNODE_IDLE_POLL": bad})
    with pytest.raises(ValueError, match="CONCATFL_SUPERNODE_WAITS must be 'short' or 'flower', got 'slow'"):
        supernode.idle_poll_from_env({"CONCATFL_SUPERNODE_WAITS": "slow"})


def test_the_launcher_refuses_a_bad_setting_before_starting(monkeypatch, capsys):
    monkeypatch.setenv("CONCATFL_SUPERNODE_IDLE_POLL", "-1")
    assert supernode.main([]) == 2
    assert "CONCATFL_SUPERNODE_IDLE_POLL must be" in capsys.readouterr().err
    monkeypatch.delenv("CONCATFL_SUPERNODE_IDLE_POLL")
    assert supernode.main(["--warm-executor", "--isolation", "subprocess"]) == 2
    assert "--warm-executor runs the ClientApp tasks itself" in capsys.readouterr().err


def test_without_the_clientapp_steps_flowers_own_superexec_runs_the_tasks():
    assert supernode.without_isolation(["--port=9095", "--isolation", "process", "--insecure", "--isolation=process"]) == [
        "--port=9095", "--insecure",
    ]


def test_the_short_reply_backoff_is_set_where_the_grid_has_the_known_shape(monkeypatch):
    monkeypatch.setattr(http_grid, "pull_objects", http_grid.pull_objects)
    flowers = http_grid.pull_objects
    assert use_short_reply_backoff()
    assert http_grid.pull_objects is pull_objects_in_time
    monkeypatch.setattr(inspect, "getsource", lambda module: module.__dict__["__source__"])
    other = changed_loop("def pull_messages(pull_objects):\n    pull_objects(1, backoff_cap=3)\n")
    other.pull_objects = flowers
    assert not use_short_reply_backoff(other) and other.pull_objects is flowers


def test_an_object_the_superlink_did_not_store_is_pushed_again(monkeypatch):
    monkeypatch.setattr(grid_module.time, "sleep", lambda seconds: None)
    answers = []

    def superlink(stored_after: int):
        def push_object(request: PushObjectRequest) -> PushObjectResponse:
            answers.append(request.object_id)
            return PushObjectResponse(stored=len(answers) > stored_after)
        return push_object

    push = make_push_object_fn_retrying(push_object_protobuf=superlink(2), node=Node(node_id=1), run_id=3, session_id="s")
    push("abc", b"content")  # refused twice (the database locked), stored at the third try
    assert answers == ["abc"] * 3
    answers.clear()
    push = make_push_object_fn_retrying(push_object_protobuf=superlink(PUSH_TRIES), node=Node(node_id=1), run_id=3, session_id="s")
    with pytest.raises(ObjectPushError):
        push("abc", b"content")
    assert len(answers) == PUSH_TRIES
    monkeypatch.setattr(http_grid, "make_push_object_fn_protobuf", http_grid.make_push_object_fn_protobuf)
    assert retry_object_pushes() and http_grid.make_push_object_fn_protobuf is make_push_object_fn_retrying


def test_a_simulation_grid_leaves_flowers_backoff_alone(monkeypatch):
    monkeypatch.setattr(http_grid, "pull_objects", http_grid.pull_objects)
    flowers = http_grid.pull_objects
    StableNodeGrid(FakeGrid({}))
    assert http_grid.pull_objects is flowers
