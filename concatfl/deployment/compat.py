"""Whether Flower's code still has the shape that concatfl's deployment modules adjust.

Four modules lean on Flower internals: the SuperNode launcher replaces the fixed sleeps and the
object-pull backoff of Flower's SuperNode loop and follows its message step, `StableNodeGrid` the reply-object backoff and the object pushes of
Flower's deployment grid, `message_index` the simulation link state's search for a node's
messages, and the warm executor runs the steps of `flwr-clientapp` itself. Each
checks the *shape* of the code it depends on, read from the installed Flower's source, instead of
a version number: a Flower release (1.42.1, …) whose code still has that shape gets the
adjustment; one whose code changed runs with Flower's own behaviour and one WARNING that says
what was not found. Nothing refuses to start. Verified end to end with Flower VERIFIED_WITH.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import types

VERIFIED_WITH = "1.42.0"
# The keywords of Flower's `pull_objects` that concatfl's backoff (warm_executor.SHORT_PULL_BACKOFF)
# sets: a pull already called with one of them has a backoff of its own.
PULL_BACKOFF_KEYWORDS = frozenset({"initial_backoff", "backoff_cap", "max_tries_per_object"})
# The SuperNode loop's fixed sleeps, as written in flwr/supernode/start_client_internal.py.
SUPERNODE_SLEEPS = [0.5, 0.5, 3]
# The SuperNode loop's step that pulls and stores a message (returns its run id, None when none came),
# and the keywords the loop passes it that the launcher's wrapper reads (`supernode.MessageStep`).
MESSAGE_STEP = "_pull_and_store_message"
MESSAGE_STEP_KEYWORDS = frozenset({"state", "object_store"})
# What the warm executor takes from Flower: module → the functions it calls, with the parameters
# it passes (by name or, first, by position).
CLIENTAPP_STEPS = {
    "flwr.supernode.runtime.run_clientapp": {
        "push_message": ("client", "message", "context"),
        "push_task_output": ("client", "context", "sub_status", "details"),
    },
    "flwr.clientapp.utils": {"get_load_client_app_fn": ("default_app_ref", "app_path", "multi_app")},
    "flwr.cli.install": {"install_from_fab": ("fab_file", "skip_prompt")},
    "flwr.supercore.heartbeat": {"make_task_heartbeat_fn_http": ("client",), "HeartbeatSender": ("heartbeat_fn",)},
}
# What `message_index` uses of Flower's in-memory link state: attribute -> the parameters it
# passes to the method (None: not a method).
LINKSTATE_PARTS: dict[str, tuple[str, ...] | None] = {
    "lock": None,
    "message_ins_store": None,
    "store_message_ins": ("message",),
    "get_message_ins": ("node_id", "limit", "run_id"),
    "_check_stored_messages": ("message_ids",),
}
# The Runtime API calls of Flower's own task input step, which the warm executor repeats.
TASK_INPUT_CALLS = {"PullTaskInput", "PullMessages", "pull_and_inflate_object_from_tree"}


def calls(module: types.ModuleType | types.FunctionType, name: str) -> list[ast.Call]:
    """Calls of `name` (a plain name, or `x.name`) in the source of `module` (or a function)."""
    found = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Call):
            function = node.func
            called = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
            if called == name:
                found.append(node)
    return found


def _default_backoff_pull(module: types.ModuleType) -> str | None:
    pulls = calls(module, "pull_objects")
    if len(pulls) != 1:
        return f"{len(pulls)} calls of pull_objects, expected 1"
    if {keyword.arg for keyword in pulls[0].keywords} & PULL_BACKOFF_KEYWORDS:
        return "pull_objects is already called with a backoff of its own"
    return None


def supernode_loop_problem(module: types.ModuleType) -> str | None:
    """Why the SuperNode loop `module` is not the shape the launcher adjusts (None: it is)."""
    try:
        sleeps = sorted(ast.literal_eval(call.args[0]) for call in calls(module, "sleep"))
    except (ValueError, IndexError):
        return "a sleep whose duration is not a constant"
    if sleeps != SUPERNODE_SLEEPS:
        return f"fixed sleeps {sleeps}, expected {SUPERNODE_SLEEPS}"
    steps = calls(module, MESSAGE_STEP)
    if not callable(getattr(module, MESSAGE_STEP, None)) or len(steps) != 1:
        return f"{len(steps)} calls of {MESSAGE_STEP}, expected 1 (the loop's step that stores a message)"
    if missing := sorted(MESSAGE_STEP_KEYWORDS - {keyword.arg for keyword in steps[0].keywords}):
        return f"{MESSAGE_STEP} is called without the keywords {missing}"
    return _default_backoff_pull(module)


def grid_pull_problem(module: types.ModuleType) -> str | None:
    """Why Flower's deployment grid `module` does not pull reply objects the way StableNodeGrid
    shortens (None: it does)."""
    return _default_backoff_pull(module)


def linkstate_problem(state: object) -> str | None:
    """Why `state` is not the in-memory link state that `message_index` indexes (None: it is)."""
    for name, parameters in LINKSTATE_PARTS.items():
        if not hasattr(state, name):
            return f"no {name}"
        if parameters is not None:
            found = tuple(inspect.signature(getattr(state, name)).parameters)
            if not set(parameters) <= set(found):
                return f"{name} takes {found}, without {sorted(set(parameters) - set(found))}"
    if not isinstance(state.message_ins_store, dict):  # type: ignore[attr-defined]
        return "message_ins_store is not a dict"
    return None


def grid_push_problem(module: types.ModuleType) -> str | None:
    """Why Flower's deployment grid `module` does not push objects the way StableNodeGrid retries
    (None: it does: one `make_push_object_fn_protobuf` call, the function imported by name)."""
    made = calls(module, "make_push_object_fn_protobuf")
    if len(made) != 1 or not callable(getattr(module, "make_push_object_fn_protobuf", None)):
        return f"{len(made)} calls of make_push_object_fn_protobuf, expected 1"
    return None


def clientapp_steps_problem(steps: dict[str, dict[str, tuple[str, ...]]] = CLIENTAPP_STEPS) -> str | None:
    """Why the installed Flower lacks a step the warm executor runs (None: it has them all)."""
    for module_name, functions in steps.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            return f"{module_name} does not import ({error})"
        for name, parameters in functions.items():
            function = getattr(module, name, None)
            if function is None:
                return f"{module_name}.{name} is gone"
            found = tuple(inspect.signature(function).parameters)
            if not set(parameters) <= set(found):
                return f"{module_name}.{name} takes {found}, without {sorted(set(parameters) - set(found))}"
    runtime = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    pull = getattr(runtime, "pull_task_input", None)
    if pull is None:
        return "flwr.supernode.runtime.run_clientapp.pull_task_input is gone"
    missing = sorted(name for name in TASK_INPUT_CALLS if not calls(pull, name))
    return f"pull_task_input no longer calls {missing}" if missing else None
