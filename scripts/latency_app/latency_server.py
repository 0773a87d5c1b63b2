"""concatfl's ServerApp with two measurement hooks, configured by environment variables
(set on the SuperLink, inherited by the ServerApp process):

CONCATFL_HOP_LOG=<file>: append one JSON line per hop: wall seconds, Unix time it ended,
    messages, and the ClientApps' "train-seconds" (time inside the training loop).
CONCATFL_FLOWER_GRID=1: wait for replies as Flower 1.42's own `Grid.send_and_receive` does (a
    pull every 3 s, reply objects pulled with Flower's 1 s backoff) instead of concatfl's
    `StableNodeGrid` (0.1 s, 0.05 s backoff).
"""

from __future__ import annotations

import json
import os
import time
from functools import partial

import concatfl.server_app as server_app
import concatfl.strategies.base as base
from concatfl.server_app import app
from concatfl.deployment.grid import StableNodeGrid

__all__ = ["app"]  # the ServerApp Flower loads

_relay = base.relay


def logged_relay(grid, requests, timeout):  # type: ignore[no-untyped-def]
    """concatfl's relay, logging the hop's wall time and the replies' train-seconds."""
    hop = _relay(grid, requests, timeout)
    train_seconds = [float(reply.metrics["train-seconds"]) for reply in hop.replies if "train-seconds" in reply.metrics]
    record = {"seconds": hop.seconds, "ended_at": time.time(), "messages": len(requests), "train_seconds": train_seconds}
    with open(os.environ["CONCATFL_HOP_LOG"], "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
    return hop


if os.environ.get("CONCATFL_HOP_LOG"):
    base.relay = logged_relay
if os.environ.get("CONCATFL_FLOWER_GRID") == "1":
    server_app.StableNodeGrid = partial(StableNodeGrid, pull_interval=3.0, short_reply_backoff=False)
