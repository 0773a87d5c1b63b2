"""concatfl's SuperNode launcher and the ServerApp's reply backoff: Flower 1.42's fixed waits, shortened.

The launcher and `use_short_reply_backoff` replace sleeps and a backoff found by value in Flower's
own modules; the tests below read those modules' source so that a Flower upgrade that moves or
changes them fails here, not silently in deployment. Real SuperNodes run through the launcher in
every deployment test that uses the warm executor (tests/deploy.py's default).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import types

import flwr.superlink.grid.http_grid as http_grid
import pytest

import concatfl.supernode as supernode
from concatfl.stable_grid import StableNodeGrid, use_short_reply_backoff
from concatfl.warm_executor import SHORT_PULL_BACKOFF, UntestedFlowerVersion, check_flower_version

from .fakes import FakeGrid

SUPERNODE_LOOP = importlib.import_module("flwr.supernode.start_client_internal")


def calls(module: types.ModuleType, name: str) -> list[ast.Call]:
    """Calls of `name` (a plain name, or `x.name`) in `module`'s source."""
    found = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Call):
            function = node.func
            called = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
            if called == name:
                found.append(node)
    return found


def test_the_tested_supernode_loop_has_exactly_the_sleeps_and_pull_the_launcher_replaces():
    sleeps = sorted(ast.literal_eval(call.args[0]) for call in calls(SUPERNODE_LOOP, "sleep"))
    assert sleeps == [supernode.FLOWER_CHECK_SLEEP, supernode.FLOWER_CHECK_SLEEP, supernode.FLOWER_IDLE_SLEEP]
    (pull,) = calls(SUPERNODE_LOOP, "pull_objects")
    assert not {keyword.arg for keyword in pull.keywords} & set(SHORT_PULL_BACKOFF)


def test_flowers_grid_pulls_reply_objects_with_its_default_backoff():
    (pull,) = calls(http_grid, "pull_objects")
    assert not {keyword.arg for keyword in pull.keywords} & set(SHORT_PULL_BACKOFF)


def test_each_fixed_sleep_maps_to_its_short_wait():
    assert supernode.short_sleep(3, idle_poll=0.2) == 0.2
    assert supernode.short_sleep(0.5, idle_poll=0.2) == supernode.CHECK_INTERVAL == 0.05
    assert supernode.short_sleep(1.5, idle_poll=0.2) == 1.5


def test_shorten_waits_changes_only_the_given_module(monkeypatch):
    slept, pulled = [], []
    monkeypatch.setattr(supernode.time, "sleep", slept.append)
    loop = types.ModuleType("loop")
    loop.time = supernode.time
    loop.pull_objects = lambda ids, fn, **kwargs: pulled.append((ids, kwargs))
    supernode.shorten_waits(loop, idle_poll=0.3)
    loop.time.sleep(3)
    loop.time.sleep(0.5)
    loop.pull_objects(["a"], None)
    assert slept == [0.3, 0.05]
    assert pulled == [(["a"], {"initial_backoff": 0.05, "backoff_cap": 0.1, "max_tries_per_object": None})]
    assert loop.time is not supernode.time and supernode.time.sleep == slept.append  # the process's `time` is untouched


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
    assert supernode.main() == 2
    assert "CONCATFL_SUPERNODE_IDLE_POLL must be" in capsys.readouterr().err
    with pytest.raises(UntestedFlowerVersion, match=r"SuperNode loop, but flwr 1\.43\.0 is installed"):
        check_flower_version("1.43.0", component="x", mirrors="SuperNode loop")


def test_the_short_reply_backoff_is_set_for_the_tested_flower_only(monkeypatch):
    monkeypatch.setattr(http_grid, "pull_objects", http_grid.pull_objects)
    flowers = http_grid.pull_objects
    assert not use_short_reply_backoff("1.43.0") and http_grid.pull_objects is flowers
    assert use_short_reply_backoff("1.42.0")
    assert http_grid.pull_objects.func is flowers and http_grid.pull_objects.keywords == SHORT_PULL_BACKOFF


def test_a_simulation_grid_leaves_flowers_backoff_alone(monkeypatch):
    monkeypatch.setattr(http_grid, "pull_objects", http_grid.pull_objects)
    flowers = http_grid.pull_objects
    StableNodeGrid(FakeGrid({}))
    assert http_grid.pull_objects is flowers
