"""A Grid that runs in-process, for exact tests of strategies without Flower's runtime.

Real Flower node ids are unsigned 64-bit numbers, many above 2**63: tests should use such ids
(see `BIG_IDS`) so that code which pushes node ids through numpy (and loses digits) fails here.
A message to a node the grid does not know raises, as Flower logs "Invalid destination node ID".

Each node is a Python callable `handler(message) -> Message | Later | None`; returning None
simulates a reply that never comes (node gone, timeout). Every message the strategy sent is kept
in `sent`. `send_and_receive` returns at once; with `push_messages`/`pull_messages` (what
concatfl's `StableNodeGrid` uses) a missing reply is awaited until the caller's timeout, as in
Flower, and a `Later(reply, seconds)` is pulled only once that many seconds have passed since
the push (a slow node).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flwr.app import Message
from flwr.serverapp import Grid


@dataclass
class Later:
    """A reply that can be pulled only `seconds` after its message was pushed."""

    reply: Message
    seconds: float


Handler = Callable[[Message], Message | Later | None]

# Sorted; the first below 2**63, the rest above, like Flower's mix: numpy stores such a mix as
# float64, so any two of them (the first included) expose code that routes ids through numpy.
BIG_IDS = [2**62 + 7919] + [2**63 + 7919 * i for i in range(1, 64)]


class FakeGrid(Grid):
    """In-process Grid: `handlers[node_id]` answers each message sent to that node."""

    def __init__(self, handlers: dict[int, Handler]) -> None:
        self.handlers = dict(handlers)
        self.sent: list[Message] = []
        self.hops: list[list[Message]] = []
        self._replies: dict[str, tuple[float, Message]] = {}  # message id -> (pullable from, reply)

    def set_run(self, run_id: int) -> None:
        raise NotImplementedError("not needed in tests")

    @property
    def run(self):  # type: ignore[override]
        raise NotImplementedError("not needed in tests")

    def create_message(self, *args, **kwargs) -> Message:  # type: ignore[override]
        raise NotImplementedError("not needed in tests")

    def get_node_ids(self) -> Iterable[int]:
        return list(self.handlers)

    def get_nodes(self):  # type: ignore[override]
        raise NotImplementedError("not needed in tests")

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Give each message an id (as Flower does on push) and answer it (a `Later` reply is
        held back for its seconds)."""
        batch = list(messages)
        for position, message in enumerate(batch, start=len(self.sent)):
            message.metadata.__dict__["_message_id"] = f"message-{position}"
        now = time.monotonic()
        for answer in self._answer(batch):
            reply, delay = (answer.reply, answer.seconds) if isinstance(answer, Later) else (answer, 0.0)
            self._replies[reply.metadata.reply_to_message_id] = (now + delay, reply)
        return [message.metadata.message_id for message in batch]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        now = time.monotonic()
        ready = [mid for mid in message_ids if mid in self._replies and self._replies[mid][0] <= now]
        return [self._replies.pop(message_id)[1] for message_id in ready]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return [answer.reply if isinstance(answer, Later) else answer for answer in self._answer(list(messages))]

    def _answer(self, batch: list[Message]) -> list[Message | Later]:
        self.sent.extend(batch)
        self.hops.append(batch)
        replies = []
        for message in batch:
            handler = self.handlers.get(message.metadata.dst_node_id)
            if handler is None:
                raise AssertionError(f"invalid destination node id {message.metadata.dst_node_id}")
            reply = handler(message)
            if reply is not None:
                replies.append(reply)
        return replies


def reply_with(message: Message, content) -> Message:
    """A reply to `message` as a ClientApp would send it (src node = the message's dst)."""
    reply = Message(content, reply_to=message)
    return reply
