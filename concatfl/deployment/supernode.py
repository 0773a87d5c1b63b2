"""Flower's SuperNode with short waits, idle backoff and, optionally, the warm executor inside:

    python -m concatfl.deployment.supernode [--warm-executor] [flower-supernode flags]

Flower 1.42's SuperNode loop (`flwr/supernode/start_client_internal.py`) waits with sleeps written
into the code, none of them a setting:
- 3 s between two polls of the SuperLink when no message came;
- 0.5 s between two checks for the ClientApp's reply, and for each of the reply's objects;
- the object-pull backoff of `flwr/supercore/constant.py` (1 s, doubling up to 10 s) while it
  downloads a message's objects. A fast SuperNode always falls into it: the SuperLink lists a
  message as soon as its metadata is stored, before the ServerApp has pushed its arrays.
FedCat and FedSeq wait for one node at a time, so every hop pays these (measured on loopback
with the warm executor: a FedSeq hop of 2.67 s with them, 0.56 s without; docs/deployment.md §8).

This launcher runs Flower's own `flower-supernode` (same flags, same process, same protocol) with
only those waits replaced, in that one module:
- the idle poll by `IdlePolls`: `CONCATFL_SUPERNODE_IDLE_POLL` seconds (default 0.2; 0.01 to 3)
  while messages come, then a tenth of the time since the last message, at most Flower's own
  3 s. Each idle poll is a request to the SuperLink (~5 ms of CPU on each side here), so a node
  that has been idle for half a minute costs what Flower's SuperNode costs, while one in the
  middle of a run answers within its short poll;
- the 0.5 s checks by 0.05 s (they read the SuperNode's own memory);
- the object-pull backoff by `SHORT_PULL_BACKOFF` (0.05 s doubling up to 0.1 s).
It also finishes what Flower's message step leaves behind when the SuperLink answers that a
message's run is no longer running (a run that ended, or one a restarted SuperLink lost): Flower
logs "Ignoring message" but keeps the task it created and the message it listed, whose objects
never come; an executor that claims that task waits for them, and every later task of the node
(the resumed run's first query) waits behind it. `MessageStep` drops that message and fails that
task, as Flower's own step does when a pull fails for any other reason.
Before it changes anything it reads the installed loop's source
(`concatfl.deployment.compat.supernode_loop_problem`): a Flower whose loop has exactly these
sleeps, this pull and this message step is adjusted, whatever its version; one whose loop changed
runs with Flower's own waits and a warning. `CONCATFL_SUPERNODE_WAITS=flower` keeps Flower's
waits (the comparison in scripts/deploy_latency.py).

`--warm-executor` runs concatfl's warm executor (`concatfl.deployment.warm_executor`) in this
process, as a thread beside Flower's loop, instead of a SuperExec process next to it: the
SuperNode uses `--isolation process` (added when not given), the executor claims its tasks
through the SuperNode's own Runtime API (`--host`, `--port`, `--ssl-ca-certfile`,
`--superexec-auth-secret-file` as given to the SuperNode) and runs them in its one worker
process. The loop wakes it the moment it has stored a message, so it never polls while idle (a
poll every 5 s stays as a safety net); with Flower's waits it polls every 0.1 s. One process
fewer per node: ~90 MB of resident memory (Flower's client runtime imported a second time) and
its idle polling. Where the installed Flower's ClientApp steps are not those the executor runs
(`compat.clientapp_steps_problem`), Flower's own SuperExec runs the tasks, with a warning.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from logging import WARNING

from .compat import clientapp_steps_problem, supernode_loop_problem
from .warm_executor import DEFAULT_POLL_INTERVAL, SHORT_PULL_BACKOFF, RuntimeConnection, Supervisor

WAITS_ENV = "CONCATFL_SUPERNODE_WAITS"  # "short" (default) or "flower"
IDLE_POLL_ENV = "CONCATFL_SUPERNODE_IDLE_POLL"
DEFAULT_IDLE_POLL = 0.2
IDLE_POLL_RANGE = (0.01, 3.0)
# Flower's idle poll and its reply/object checks, as written in start_client_internal.py
# (compat.SUPERNODE_SLEEPS).
FLOWER_IDLE_SLEEP = 3
FLOWER_CHECK_SLEEP = 0.5
CHECK_INTERVAL = 0.05
# An idle poll waits at most this share of the time since the node's last message.
IDLE_SHARE = 0.1
WARM_EXECUTOR_FLAG = "--warm-executor"
# The in-process executor's poll while no wake came (the loop wakes it for every message it stores).
WAKEFUL_EXECUTOR_POLL = 5.0
# Runtime API hosts that listen everywhere: the executor reaches them on loopback.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class IdlePolls:
    """How long the SuperNode loop waits after the SuperLink had no message for it: `fast`
    seconds at first, then `IDLE_SHARE` of the time since its last message (or its start), at
    most Flower's own FLOWER_IDLE_SLEEP.

    With the default 0.2 s: 0.2 s during the first 2 s after a message, 1 s after 10 s, 3 s from
    30 s on. The delay this adds to a message is at most a tenth of the time the node had been
    idle before it.
    """

    def __init__(self, fast: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.fast = fast
        self._clock = clock
        self._last = clock()

    def message_pulled(self) -> None:
        """The loop has just stored a message: poll fast again."""
        self._last = self._clock()

    def wait_seconds(self) -> float:
        """The next idle wait."""
        return min(float(FLOWER_IDLE_SLEEP), max(self.fast, IDLE_SHARE * (self._clock() - self._last)))


def idle_poll_from_env(environ: Mapping[str, str]) -> float | None:
    """The idle poll interval the environment asks for, None for Flower's own waits
    (`CONCATFL_SUPERNODE_WAITS=flower`); ValueError naming the variable if a value is bad."""
    waits = environ.get(WAITS_ENV, "short")
    if waits not in ("short", "flower"):
        raise ValueError(f"{WAITS_ENV} must be 'short' or 'flower', got {waits!r}")
    if waits == "flower":
        return None
    text = environ.get(IDLE_POLL_ENV)
    if text is None:
        return DEFAULT_IDLE_POLL
    low, high = IDLE_POLL_RANGE
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise ValueError(f"{IDLE_POLL_ENV} must be a number of seconds from {low} to {high}, got {text!r}")
    return value


def short_sleep(seconds: float, polls: IdlePolls) -> float:
    """What one of the SuperNode loop's fixed sleeps becomes: its idle poll `polls`' next wait,
    its reply/object checks CHECK_INTERVAL; any other value (none in the tested version) is kept."""
    if seconds == FLOWER_IDLE_SLEEP:
        return polls.wait_seconds()
    if seconds == FLOWER_CHECK_SLEEP:
        return CHECK_INTERVAL
    return seconds


def shorten_waits(module: types.ModuleType, polls: IdlePolls, on_message: Callable[[], None] = lambda: None) -> None:
    """Replace the fixed sleeps and the object-pull backoff of Flower's SuperNode loop `module`
    (`flwr.supernode.start_client_internal`), and follow its message step: after every stored
    message `polls` polls fast again and `on_message()` is called. Nothing else in the process
    is touched."""
    clock = types.SimpleNamespace(sleep=lambda seconds: time.sleep(short_sleep(seconds, polls)))
    module.time = clock  # type: ignore[attr-defined]
    module.pull_objects = functools.partial(module.pull_objects, **SHORT_PULL_BACKOFF)  # type: ignore[attr-defined]
    pull_and_store = module._pull_and_store_message  # pylint: disable=protected-access

    @functools.wraps(pull_and_store)
    def pull_store_and_tell(*args, **kwargs):
        step = MessageStep(kwargs["state"])
        run_id = pull_and_store(*args, **{**kwargs, "state": step})
        if run_id is not None:
            polls.message_pulled()
            on_message()
        else:
            step.drop_abandoned(kwargs["object_store"])
        return run_id

    module._pull_and_store_message = pull_store_and_tell  # type: ignore[attr-defined]  # pylint: disable=protected-access


class MessageStep:
    """The SuperNode's state as one message step of its loop sees it: it remembers the task the
    step created, the message it stored and whether it finished a task; everything else is the
    state's own."""

    def __init__(self, state) -> None:
        self._state = state
        self.task_id: int | None = None
        self.message_id: str | None = None
        self.finished = False

    def __getattr__(self, name: str):
        return getattr(self._state, name)

    def create_task(self, *args, **kwargs) -> int | None:
        """The state's `create_task`, remembered."""
        self.task_id = self._state.create_task(*args, **kwargs)
        return self.task_id

    def store_message(self, message) -> str | None:
        """The state's `store_message`, remembered."""
        self.message_id = self._state.store_message(message)
        return self.message_id

    def finish_task(self, *args, **kwargs) -> bool:
        """The state's `finish_task`, remembered."""
        self.finished = True
        return self._state.finish_task(*args, **kwargs)

    def drop_abandoned(self, object_store) -> bool:
        """After a step that returned no run: if it created a task and stored a message and left
        both (Flower's "run is not in `RUNNING` status" path), drop the message and its objects
        and fail the task, as Flower's step does for a failed pull. Returns whether it did."""
        if self.task_id is None or self.message_id is None or self.finished:
            return False
        # pylint: disable=import-outside-toplevel
        from flwr.common.constant import SubStatus
        from flwr.supercore import log

        self._state.delete_messages(message_ids=[self.message_id])
        object_store.delete(self.message_id)
        self._state.finish_task(self.task_id, sub_status=SubStatus.FAILED,
                                details="The message's run is no longer running: message dropped")
        log(WARNING, "[concatfl] message %s dropped and task %s failed: the run is no longer running",
            self.message_id, self.task_id)
        return True


def adjust(module: types.ModuleType, idle_poll: float | None, on_message: Callable[[], None] = lambda: None) -> bool:
    """Shorten the waits of the SuperNode loop `module` when asked (`idle_poll` not None) and
    when its code has the shape this launcher knows (`on_message` is then called after every
    stored message); else leave Flower's waits (a warning says why, when they were asked for).
    Returns whether the waits were shortened."""
    if idle_poll is None:
        return False
    if (problem := supernode_loop_problem(module)) is not None:
        print(f"warning: this Flower's SuperNode loop is not the one concatfl's launcher adjusts ({problem}); "
              "running it with Flower's own waits", file=sys.stderr)
        return False
    shorten_waits(module, IdlePolls(idle_poll), on_message)
    return True


def runtime_connection(flower_args: Sequence[str]) -> tuple[RuntimeConnection, list[str]]:
    """How the in-process executor reaches this SuperNode's Runtime API (read from its flags), and
    the flags with `--isolation=process` added when missing. ValueError when they ask for
    `--isolation subprocess` (Flower's SuperExec would run the tasks)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--isolation", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9094)
    parser.add_argument("--ssl-certfile", default=None)
    parser.add_argument("--ssl-ca-certfile", default=None)
    parser.add_argument("--superexec-auth-secret-file", default=None)
    args, _ = parser.parse_known_args(flower_args)
    if args.isolation not in (None, "process"):
        raise ValueError(f"{WARM_EXECUTOR_FLAG} runs the ClientApp tasks itself: use --isolation=process "
                         f"or leave it out, not --isolation={args.isolation}")
    from flwr.supercore.auth.superexec_secret import load_superexec_auth_secret  # pylint: disable=import-outside-toplevel

    host = "127.0.0.1" if args.host in WILDCARD_HOSTS else args.host
    connection = RuntimeConnection(
        f"[{host}]:{args.port}" if ":" in host else f"{host}:{args.port}",
        insecure=args.ssl_certfile is None,
        root_certificates_path=args.ssl_ca_certfile,
        superexec_auth_secret=load_superexec_auth_secret(args.superexec_auth_secret_file),
    )
    return connection, [*flower_args, *([] if args.isolation else ["--isolation=process"])]


def without_isolation(flower_args: Sequence[str]) -> list[str]:
    """The flags without `--isolation` (and its value)."""
    kept, skip = [], False
    for arg in flower_args:
        if skip:
            skip = False
        elif arg == "--isolation":
            skip = True
        elif not arg.startswith("--isolation="):
            kept.append(arg)
    return kept


def start_warm_executor(connection: RuntimeConnection, wake: threading.Event | None) -> Supervisor:
    """The warm executor's supervisor in a thread of this process; its worker is stopped when
    Flower's SuperNode exits (and exits by itself when this process is gone)."""
    from flwr.supercore.exit import add_exit_handler  # pylint: disable=import-outside-toplevel

    supervisor = Supervisor(connection, WAKEFUL_EXECUTOR_POLL if wake is not None else DEFAULT_POLL_INTERVAL, wake)
    threading.Thread(target=supervisor.serve, name="warm-executor", daemon=True).start()
    add_exit_handler(supervisor.stop)
    return supervisor


def main(argv: Sequence[str] | None = None) -> int:
    """Read the settings, shorten the waits where the loop allows it, start the warm executor
    when asked, run `flower-supernode`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    warm = WARM_EXECUTOR_FLAG in argv
    flower_args = [arg for arg in argv if arg != WARM_EXECUTOR_FLAG]
    try:
        idle_poll = idle_poll_from_env(os.environ)
        if warm:
            connection, flower_args = runtime_connection(flower_args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # pylint: disable=import-outside-toplevel
    from flwr.supernode.cli import flower_supernode

    if warm and (problem := clientapp_steps_problem()) is not None:
        print(f"warning: this Flower's ClientApp steps differ from those the warm executor runs ({problem}); "
              "Flower's own SuperExec runs the tasks (--isolation subprocess)", file=sys.stderr)
        warm, flower_args = False, [*without_isolation(flower_args), "--isolation=subprocess"]
    wake = threading.Event()
    adjusted = adjust(importlib.import_module("flwr.supernode.start_client_internal"), idle_poll, wake.set)
    if warm:
        start_warm_executor(connection, wake if adjusted else None)
    sys.argv = ["flower-supernode", *flower_args]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
