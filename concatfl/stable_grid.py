"""`StableNodeGrid`: the ServerApp's view of the nodes under ids that survive a restart.

Flower gives every node a random 64-bit id when it connects: a new one in every simulation, and
in deployment a new one whenever a SuperNode without a registered key restarts. The strategies
key their state by node id (FedCat's groups and count table, FedSeq's superclients, FedConcat's
clusters), so with raw ids two runs with the same seed pick different clients and a checkpoint
cannot be matched to the nodes of a later run.

This Grid wraps Flower's and presents each node as its *stable id*: the node's `partition-id`,
which concatfl's ClientApp reports in answer to an identity query (asked once per new node).
A node that does not answer it (an ordinary ClientApp without that query, an error, a timeout)
keeps its Flower node id. When a restarted SuperNode reports a partition that another, older
node id still holds (Flower lists a dead node as online for up to two heartbeats), the newer
node takes the stable id and the older one is hidden.

It also polls for replies every `pull_interval` seconds: Flower 1.42's Grid sleeps 3 s between
pulls, on average 1.5 s lost per hop, which FedSeq pays again at every hop of its chains.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import WARNING

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

IDENTITY_QUERY = "identity"
PARTITION_ID_KEY = "partition-id"


class StableNodeGrid(Grid):
    """A Grid whose node ids are the nodes' partition ids (see the module docstring).

    Parameters
    ----------
    grid : Grid
        Flower's Grid, which every call is forwarded to.
    identify_timeout : float (default: 120.0)
        Seconds to wait for new nodes' answers to the identity query.
    pull_interval : float (default: 0.1)
        Seconds between two pulls for replies in `send_and_receive`.
    """

    def __init__(self, grid: Grid, identify_timeout: float = 120.0, pull_interval: float = 0.1) -> None:
        self.grid = grid
        self.identify_timeout = identify_timeout
        self.pull_interval = pull_interval
        self._stable_of: dict[int, int] = {}  # Flower node id -> stable id
        self._flower_of: dict[int, int] = {}  # stable id -> the Flower node id that serves it

    # ------------------------------------------------------------------ node ids
    def get_node_ids(self) -> Iterable[int]:
        """Stable ids of the connected nodes (new nodes are identified first)."""
        connected = [int(node_id) for node_id in self.grid.get_node_ids()]
        self._identify([node_id for node_id in connected if node_id not in self._stable_of])
        return sorted(
            stable for node_id in connected if self._flower_of.get(stable := self._stable_of[node_id]) == node_id
        )

    def identities(self) -> dict[int, int]:
        """Stable id -> current Flower node id, for every node identified so far."""
        return dict(self._flower_of)

    def _identify(self, node_ids: list[int]) -> None:
        if not node_ids:
            return
        messages = [
            Message(
                content=RecordDict({"config": ConfigRecord({"query": IDENTITY_QUERY})}),
                dst_node_id=node_id,
                message_type=MessageType.QUERY,
            )
            for node_id in node_ids
        ]
        replies = self._push_and_pull(messages, self.identify_timeout)
        # Flower sets message ids on push; a reply is matched by the id it answers, else by its source.
        asked = {m.metadata.message_id: node_id for m, node_id in zip(messages, node_ids) if m.metadata.message_id}
        answers: dict[int, int] = {}
        for reply in replies:
            node_id = asked.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
            partition = _reported_partition(reply)
            if partition is not None:
                answers[node_id] = partition
        for node_id in node_ids:
            stable = answers.get(node_id, node_id)
            if node_id not in answers:
                log(WARNING, "Node %s did not report a partition-id; it keeps its Flower node id", node_id)
            previous = self._flower_of.get(stable)
            if previous is not None and previous != node_id:
                log(
                    WARNING,
                    "Partition %s is now served by node %s; node %s, which served it, is hidden "
                    "(a restarted SuperNode, or two SuperNodes configured with the same partition-id)",
                    stable, node_id, previous,
                )
            self._stable_of[node_id] = stable
            self._flower_of[stable] = node_id

    # ------------------------------------------------------------------ messages
    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Send to the Flower nodes behind the stable ids and wait for the replies (at most
        `timeout` seconds; None waits for all); replies come back under stable ids."""
        return [self._to_stable(reply) for reply in self._push_and_pull(self._to_flower(messages), timeout)]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push to the Flower nodes behind the stable ids."""
        return self.grid.push_messages(self._to_flower(messages))

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Pull replies; their source is given as a stable id."""
        return [self._to_stable(reply) for reply in self.grid.pull_messages(message_ids)]

    def _push_and_pull(self, messages: list[Message], timeout: float | None) -> list[Message]:
        """Flower's send_and_receive on Flower node ids, polling every `pull_interval` seconds.

        Replies come back in the order of the messages they answer, whatever order they arrive
        in, so that aggregations sum in the same order in every run (and in a resumed one)."""
        position = {message_id: i for i, message_id in enumerate(self.grid.push_messages(messages)) if message_id}
        pending = set(position)
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            pulled = list(self.grid.pull_messages(list(pending)))
            replies.extend(pulled)
            pending.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            time.sleep(self.pull_interval)
        return sorted(replies, key=lambda reply: position.get(reply.metadata.reply_to_message_id, len(position)))

    def _to_flower(self, messages: Iterable[Message]) -> list[Message]:
        batch = list(messages)
        for message in batch:
            stable = message.metadata.dst_node_id
            if stable not in self._flower_of:
                raise ValueError(f"no connected node has the stable id {stable}")
            message.metadata.dst_node_id = self._flower_of[stable]
        return batch

    def _to_stable(self, reply: Message) -> Message:
        # Metadata offers no setter for the source; a reply from an unknown node (the SuperLink's
        # own error replies) keeps its id.
        source = reply.metadata.src_node_id
        if source in self._stable_of:
            reply.metadata.__dict__["_src_node_id"] = self._stable_of[source]
        return reply

    # ------------------------------------------------------------------ the rest of Grid
    def set_run(self, run_id: int) -> None:
        """Forwarded to Flower's Grid."""
        self.grid.set_run(run_id)

    @property
    def run(self):  # type: ignore[override]
        """Flower's Grid's run."""
        return self.grid.run

    def create_message(self, *args, **kwargs) -> Message:  # type: ignore[override]
        """Forwarded to Flower's Grid (the destination is a stable id, translated on sending)."""
        return self.grid.create_message(*args, **kwargs)


def _reported_partition(reply: Message) -> int | None:
    if reply.has_error():
        return None
    metrics = reply.content.metric_records.get("metrics")
    value = metrics.get(PARTITION_ID_KEY) if metrics is not None else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None
