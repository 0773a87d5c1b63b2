"""Flower's SuperNode with short fixed waits:  python -m concatfl.deployment.supernode [flower-supernode flags]

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
- the idle poll by `CONCATFL_SUPERNODE_IDLE_POLL` seconds (default 0.2; 0.01 to 3). Each idle
  poll is one small request to the SuperLink. Measured in two paired runs: 0.1 s polls gave the
  same mean hop as 0.2 s (overhead 0.47 and 0.50 s against 0.51 and 0.46 s) for 0.006 cores
  more per idle node, so the cheaper interval is the default;
- the 0.5 s checks by 0.05 s (they read the SuperNode's own memory);
- the object-pull backoff by `SHORT_PULL_BACKOFF` (0.05 s doubling up to 0.1 s).
Before it changes anything it reads the installed loop's source
(`concatfl.deployment.compat.supernode_loop_problem`): a Flower whose loop has exactly these
sleeps and this pull is adjusted, whatever its version; one whose loop changed runs with
Flower's own waits and a warning. `CONCATFL_SUPERNODE_WAITS=flower` keeps Flower's waits (the
comparison in scripts/deploy_latency.py).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import time
import types
from collections.abc import Mapping

from .compat import supernode_loop_problem
from .warm_executor import SHORT_PULL_BACKOFF

WAITS_ENV = "CONCATFL_SUPERNODE_WAITS"  # "short" (default) or "flower"
IDLE_POLL_ENV = "CONCATFL_SUPERNODE_IDLE_POLL"
DEFAULT_IDLE_POLL = 0.2
IDLE_POLL_RANGE = (0.01, 3.0)
# Flower's idle poll and its reply/object checks, as written in start_client_internal.py
# (compat.SUPERNODE_SLEEPS).
FLOWER_IDLE_SLEEP = 3
FLOWER_CHECK_SLEEP = 0.5
CHECK_INTERVAL = 0.05


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


def short_sleep(seconds: float, idle_poll: float) -> float:
    """What one of the SuperNode loop's fixed sleeps becomes: its idle poll `idle_poll`, its
    reply/object checks CHECK_INTERVAL; any other value (none in the tested version) is kept."""
    if seconds == FLOWER_IDLE_SLEEP:
        return idle_poll
    if seconds == FLOWER_CHECK_SLEEP:
        return CHECK_INTERVAL
    return seconds


def shorten_waits(module: types.ModuleType, idle_poll: float) -> None:
    """Replace the fixed sleeps and the object-pull backoff of Flower's SuperNode loop `module`
    (`flwr.supernode.start_client_internal`); nothing else in the process is touched."""
    clock = types.SimpleNamespace(sleep=lambda seconds: time.sleep(short_sleep(seconds, idle_poll)))
    module.time = clock  # type: ignore[attr-defined]
    module.pull_objects = functools.partial(module.pull_objects, **SHORT_PULL_BACKOFF)  # type: ignore[attr-defined]


def adjust(module: types.ModuleType, idle_poll: float | None) -> bool:
    """Shorten the waits of the SuperNode loop `module` when asked (`idle_poll` not None) and
    when its code has the shape this launcher knows; else leave Flower's waits (a warning says
    why, when they were asked for). Returns whether the waits were shortened."""
    if idle_poll is None:
        return False
    if (problem := supernode_loop_problem(module)) is not None:
        print(f"warning: this Flower's SuperNode loop is not the one concatfl's launcher adjusts ({problem}); "
              "running it with Flower's own waits", file=sys.stderr)
        return False
    shorten_waits(module, idle_poll)
    return True


def main() -> int:
    """Read the setting, shorten the waits where the loop allows it, run `flower-supernode`."""
    try:
        idle_poll = idle_poll_from_env(os.environ)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # pylint: disable=import-outside-toplevel
    from flwr.supernode.cli import flower_supernode

    adjust(importlib.import_module("flwr.supernode.start_client_internal"), idle_poll)
    sys.argv[0] = "flower-supernode"
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
