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

from flwr.app import Message

from concatfl.bench.inprocess import Handler, InProcessGrid, Later  # noqa: F401  (Later: for the tests)

# Sorted; the first below 2**63, the rest above, like Flower's mix: numpy stores such a mix as
# float64, so any two of them (the first included) expose code that routes ids through numpy.
BIG_IDS = [2**62 + 7919] + [2**63 + 7919 * i for i in range(1, 64)]


class FakeGrid(InProcessGrid):
    """In-process Grid: `handlers[node_id]` answers each message sent to that node; every message
    sent is kept in `sent`, and each batch in `hops`. `arrivals[node] = (after_round, handler)`:
    a node that connects once the strategy has sent a message of round `after_round` (so it is
    first listed when round `after_round` + 1 starts)."""

    def __init__(self, handlers: dict[int, Handler], arrivals: dict[int, tuple[int, Handler]] | None = None) -> None:
        super().__init__(handlers)
        self.sent: list[Message] = []
        self.hops: list[list[Message]] = []
        self.arrivals = dict(arrivals or {})
        self.latest_round = 0

    def get_node_ids(self):
        for node, (after_round, handler) in list(self.arrivals.items()):
            if self.latest_round >= after_round:
                self.handlers[node] = handler
                del self.arrivals[node]
        return super().get_node_ids()

    def _answer(self, batch: list[Message]) -> list[Message | Later]:
        self.sent.extend(batch)
        self.hops.append(batch)
        for message in batch:
            config = message.content.config_records.get("config", {})
            self.latest_round = max(self.latest_round, int(config.get("server-round", 0)))
        return super()._answer(batch)


def reply_with(message: Message, content) -> Message:
    """A reply to `message` as a ClientApp would send it (src node = the message's dst)."""
    reply = Message(content, reply_to=message)
    return reply
