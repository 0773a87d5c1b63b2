"""concatfl's ServerApp with two measurement hooks, configured by environment variables
(set on the SuperLink, inherited by the ServerApp process):

CONCATFL_HOP_LOG=<file>: append one JSON line per hop: wall seconds, messages, and the
    ClientApps' "train-seconds" (time inside the training loop).
CONCATFL_PULL_INTERVAL=<seconds>: poll for replies at this interval instead of Flower 1.42's
    fixed 3 s in `Grid.send_and_receive` (a prototype of a change to concatfl's relay).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.superlink.grid.http_grid import HttpGrid

import concatfl.strategies.base as base
from concatfl.server_app import app

__all__ = ["app"]  # the ServerApp Flower loads

_relay = base.relay


def logged_relay(grid, requests, timeout):  # type: ignore[no-untyped-def]
    """concatfl's relay, logging the hop's wall time and the replies' train-seconds."""
    hop = _relay(grid, requests, timeout)
    train_seconds = [float(reply.metrics["train-seconds"]) for reply in hop.replies if "train-seconds" in reply.metrics]
    with open(os.environ["CONCATFL_HOP_LOG"], "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"seconds": hop.seconds, "messages": len(requests), "train_seconds": train_seconds}) + "\n")
    return hop


def send_and_receive(self: HttpGrid, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
    """`HttpGrid.send_and_receive` polling every CONCATFL_PULL_INTERVAL seconds instead of 3."""
    interval = float(os.environ["CONCATFL_PULL_INTERVAL"])
    pending = set(self.push_messages(messages))
    end_time = time.time() + (timeout or 0.0)
    replies: list[Message] = []
    while timeout is None or time.time() < end_time:
        pulled = list(self.pull_messages(pending))
        replies.extend(pulled)
        pending.difference_update(message.metadata.reply_to_message_id for message in pulled)
        if not pending:
            break
        time.sleep(interval)
    return replies


if os.environ.get("CONCATFL_HOP_LOG"):
    base.relay = logged_relay
if os.environ.get("CONCATFL_PULL_INTERVAL"):
    HttpGrid.send_and_receive = send_and_receive
