"""`StableNodeGrid`: the ServerApp's view of the nodes under ids that survive a restart.

Flower gives every node a random 64-bit id when it connects: a new one in every simulation, and
in deployment a new one whenever a SuperNode without a registered key restarts. The strategies
key their state by node id (FedCat's groups and count table, FedSeq's superclients, FedConcat's
clusters), so with raw ids two runs with the same seed pick different clients and a checkpoint
cannot be matched to the nodes of a later run.

This Grid wraps Flower's and presents each node as its *stable id*: the node's `partition-id`,
which concatfl's ClientApp reports in answer to an identity query (asked once per new node).
A node whose ClientApp answers without a partition-id (an ordinary ClientApp without that
query answers with an error) keeps its Flower node id. A node that has not answered yet is not
listed: `get_node_ids` waits up to `identify_timeout` for a new node's answer, and a node that
answers later (a loaded machine) is identified and listed from the first call after its answer
came. When Flower reports the query itself lost (the node went offline, the message expired,
the ClientApp process crashed), the node is asked again at the next call. When a restarted
SuperNode reports a partition that another, older node id still holds (Flower lists a dead node
as online for up to two heartbeats), the newer node takes the stable id and the older one is
hidden. `identity_report()` says which nodes were identified late, kept their Flower ids, or
never answered (metrics.json's `node_identity`).

It also polls for replies every `pull_interval` seconds: Flower 1.42's Grid sleeps 3 s between
pulls, on average 1.5 s lost per hop, which FedSeq pays again at every hop of its chains. And in
deployment it pulls a reply's objects with a short backoff (`short_reply_backoff`): the SuperLink
lists a reply as soon as its metadata is stored, before the SuperNode has pushed its arrays, and
Flower's Grid then retries after 1 s, doubling up to 10 s; and for at most one more timeout past
the hop's deadline, where Flower's Grid retries for up to 2 h: a push the SuperLink failed to
store (its SQLite database locked under load) otherwise made a fault-free FedConcat round of a
loopback deployment take 192 s with a 20 s round timeout. The same lock can refuse one of the
ServerApp's own pushes; it pushes such an object again (`retry_object_pushes`) where Flower's
grid fails the run.

In simulation it gives the in-memory link state an index of the messages by node
(`message_index`): Flower's simulation engine otherwise scans every stored message for every node
every 0.1 s, a cost that grows with the federation's size times the messages in flight.
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import flwr.superlink.grid.http_grid as http_grid
from flwr.superlink.grid.inmemory_grid import InMemoryGrid
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore import log
from flwr.supercore.inflatable.inflatable_protobuf_utils import make_push_object_fn_protobuf
from flwr.supercore.inflatable.inflatable_utils import ObjectPushError, pull_objects

from ..protocol import IDENTITY_QUERY, PARTITION_ID_KEY
from .compat import grid_pull_problem, grid_push_problem
from .message_index import index_messages_by_node
from .warm_executor import SHORT_PULL_BACKOFF

# Errors that say the query or its reply was lost on the way, not what the ClientApp answered.
LOST_QUERY_ERRORS = (
    ErrorCode.MESSAGE_UNAVAILABLE,
    ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
    ErrorCode.NODE_UNAVAILABLE,
    ErrorCode.CLIENT_APP_CRASHED,
)


# How often the ServerApp pushes one object the SuperLink did not store, and the first wait
# between two tries (doubled each time: 0.1 + 0.2 + 0.4 + 0.8 s at most in all).
PUSH_TRIES = 5
PUSH_RETRY_WAIT = 0.1

# Until when (time.monotonic()) the current thread's pulls wait for a listed reply's objects;
# `_push_and_pull` sets it for its hop, None outside one.
_objects_deadline = threading.local()


def pull_objects_in_time(*args: Any, **kwargs: Any) -> dict[str, bytes]:
    """Flower's `pull_objects` with SHORT_PULL_BACKOFF, giving up at the current hop's objects
    deadline (at least one try; `ObjectPullError` then, which Flower's Grid turns into an error
    reply, as when the sender died mid-upload)."""
    until = getattr(_objects_deadline, "at", None)
    if until is not None:
        kwargs.setdefault("max_time", max(0.0, until - time.monotonic()))
    return pull_objects(*args, **{**SHORT_PULL_BACKOFF, **kwargs})


@dataclass
class _Query:
    """An identity query whose answer has not come yet."""

    node_id: int
    deadline: float | None  # until when `get_node_ids` waits for it (None: no limit)
    late: bool = False  # a call already gave up waiting for it


class StableNodeGrid(Grid):
    """A Grid whose node ids are the nodes' partition ids (see the module docstring).

    Parameters
    ----------
    grid : Grid
        Flower's Grid, which every call is forwarded to.
    identify_timeout : float | None (default: 120.0)
        Seconds `get_node_ids` waits for a new node's answer to the identity query (concatfl's
        ServerApp passes `round-timeout`); None waits until every node has answered. A node
        that answers later is identified when its answer comes; until then it is not listed.
    pull_interval : float (default: 0.1)
        Seconds between two pulls for replies in `send_and_receive` and while identifying.
    short_reply_backoff : bool (default: True)
        When `grid` is Flower's deployment Grid (`HttpGrid`) of a tested Flower version, pull
        reply objects that are not uploaded yet again after 0.05 s (doubling up to 0.1 s;
        `warm_executor.SHORT_PULL_BACKOFF`) instead of Flower's 1 s (up to 10 s), and within
        `send_and_receive` for at most one more timeout past its deadline instead of Flower's
        2 h (`pull_objects_in_time`). This changes `HttpGrid`'s pulls for the whole process: a
        ServerApp process serves one run. Other versions keep Flower's, with a warning.
    """

    def __init__(
        self,
        grid: Grid,
        identify_timeout: float | None = 120.0,
        pull_interval: float = 0.1,
        short_reply_backoff: bool = True,
    ) -> None:
        if short_reply_backoff and isinstance(grid, http_grid.HttpGrid):
            use_short_reply_backoff()
        if isinstance(grid, http_grid.HttpGrid):
            retry_object_pushes()
        if isinstance(grid, InMemoryGrid):
            index_messages_by_node(grid.state)
        self.grid = grid
        self.identify_timeout = identify_timeout
        self.pull_interval = pull_interval
        self._stable_of: dict[int, int] = {}  # Flower node id -> stable id
        self._flower_of: dict[int, int] = {}  # stable id -> the Flower node id that serves it
        self._queries: dict[str, _Query] = {}  # message id -> identity query not answered yet
        self._late: set[int] = set()  # stable ids of nodes identified after a call gave up on them

    # ------------------------------------------------------------------ node ids
    def get_node_ids(self) -> Iterable[int]:
        """Stable ids of the connected, identified nodes (new nodes are asked first; see
        `identify_timeout`)."""
        connected = [int(node_id) for node_id in self.grid.get_node_ids()]
        self._identify(connected)
        return sorted(
            stable
            for node_id in connected
            if node_id in self._stable_of and self._flower_of.get(stable := self._stable_of[node_id]) == node_id
        )

    def identities(self) -> dict[int, int]:
        """Stable id -> current Flower node id, for every node identified so far."""
        return dict(self._flower_of)

    def identity_report(self) -> dict[str, Any]:
        """JSON-ready: how many nodes were identified by partition id, which of them only after
        a wait had given up on them (`late`, stable ids), which kept their Flower ids (answered
        without a partition-id) and which never answered (`unanswered`, Flower ids, not used)."""
        return {
            "identified": sum(1 for node_id, stable in self._stable_of.items() if stable != node_id),
            "late": sorted(self._late),
            "flower_ids": sorted(node_id for node_id, stable in self._stable_of.items() if stable == node_id),
            "unanswered": sorted({query.node_id for query in self._queries.values()}),
        }

    def _identify(self, connected: list[int]) -> None:
        """Ask new nodes (and nodes whose query was lost) for their partition, then take the
        answers that come while any query is within its wait (at least one pull)."""
        live = set(connected)
        self._queries = {mid: query for mid, query in self._queries.items() if query.node_id in live}
        waiting = {query.node_id for query in self._queries.values()}
        self._ask([node for node in connected if node not in self._stable_of and node not in waiting])
        while self._queries:
            for reply in self.grid.pull_messages(list(self._queries)):
                query = self._queries.pop(reply.metadata.reply_to_message_id, None)
                if query is not None:
                    self._absorb(query, reply)
            now = time.monotonic()
            if not any(query.deadline is None or now < query.deadline for query in self._queries.values()):
                break
            time.sleep(self.pull_interval)
        for query in self._queries.values():
            if not query.late:
                query.late = True
                log(WARNING, "Node %s has not answered the identity query yet; it is not used until it does",
                    query.node_id)

    def _ask(self, node_ids: list[int]) -> None:
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
        deadline = None if self.identify_timeout is None else time.monotonic() + self.identify_timeout
        for message_id, node_id in zip(self.grid.push_messages(messages), node_ids):
            if message_id:
                self._queries[message_id] = _Query(node_id, deadline)

    def _absorb(self, query: _Query, reply: Message) -> None:
        """Take one node's answer: its partition, its Flower id, or (lost query) nothing yet."""
        node_id = query.node_id
        if reply.has_error() and reply.error.code in LOST_QUERY_ERRORS:
            log(WARNING, "Identity query to node %s was lost (%s); asking again", node_id, reply.error.reason)
            return  # not identified: the next `get_node_ids` asks again
        partition = _reported_partition(reply)
        stable = node_id if partition is None else partition
        if partition is None:
            log(WARNING, "Node %s did not report a partition-id; it keeps its Flower node id", node_id)
        elif query.late:
            self._late.add(stable)
            log(INFO, "Node %s answered the identity query late: partition %s", node_id, stable)
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
        in, so that aggregations sum in the same order in every run (and in a resumed one).

        The last pull starts after the deadline: a pull can itself take long (Flower retries the
        objects of a reply whose sender died mid-upload), and replies that arrived meanwhile
        were in time. A reply listed by then gets one more `timeout` to deliver its objects."""
        position = {message_id: i for i, message_id in enumerate(self.grid.push_messages(messages)) if message_id}
        pending = set(position)
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        _objects_deadline.at = None if deadline is None or timeout is None else deadline + timeout
        try:
            while pending:
                past_deadline = deadline is not None and time.monotonic() >= deadline
                pulled = list(self.grid.pull_messages(list(pending)))
                replies.extend(pulled)
                pending.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
                if not pending or past_deadline:
                    break
                time.sleep(self.pull_interval)
        finally:
            _objects_deadline.at = None
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


def use_short_reply_backoff(module: types.ModuleType = http_grid) -> bool:
    """Make Flower's deployment grid `module` pull reply objects with `pull_objects_in_time`
    (SHORT_PULL_BACKOFF: 0.05 s, doubling up to 0.1 s; the hop's objects deadline) if its code has
    the shape this adjusts (`compat.grid_pull_problem`: one `pull_objects` call with the default
    backoff); return whether it does."""
    return _adjust_grid(module, grid_pull_problem(module), "pull_objects", pull_objects_in_time,
                        "reply objects are pulled with Flower's own backoff")


def make_push_object_fn_retrying(*args: Any, **kwargs: Any) -> Callable[[str, bytes], None]:
    """Flower's `make_push_object_fn_protobuf`, whose pushes are tried again (PUSH_TRIES times in
    all) when the SuperLink answers that it did not store the object: a SuperLink whose SQLite
    database was locked for a moment rolls the store back and keeps the object pending, and the
    same push then succeeds, where Flower's grid raises `ObjectPushError` out of the ServerApp
    and the run fails."""
    push = make_push_object_fn_protobuf(*args, **kwargs)

    def push_object_fn(object_id: str, object_content: bytes) -> None:
        for attempt in range(PUSH_TRIES):
            try:
                return push(object_id, object_content)
            except ObjectPushError:
                if attempt == PUSH_TRIES - 1:
                    raise
                log(WARNING, "The SuperLink did not store object %s: pushing it again", object_id[:12])
                time.sleep(PUSH_RETRY_WAIT * 2**attempt)

    return push_object_fn


def retry_object_pushes(module: types.ModuleType = http_grid) -> bool:
    """Make Flower's deployment grid `module` push objects with `make_push_object_fn_retrying` if
    its code has the shape this adjusts (`compat.grid_push_problem`); return whether it does."""
    return _adjust_grid(module, grid_push_problem(module), "make_push_object_fn_protobuf",
                        make_push_object_fn_retrying, "an object the SuperLink fails to store ends the run")


def _adjust_grid(module: types.ModuleType, problem: str | None, name: str, replacement: Any, otherwise: str) -> bool:
    """Replace `module.name` by `replacement` unless Flower's grid has another shape (`problem`),
    which is logged with what the run does `otherwise`."""
    if problem is not None:
        log(WARNING, "Flower's deployment grid differs from the one concatfl adjusts (%s): %s", problem, otherwise)
        return False
    setattr(module, name, replacement)
    return True


def _reported_partition(reply: Message) -> int | None:
    if reply.has_error():
        return None
    metrics = reply.content.metric_records.get("metrics")
    value = metrics.get(PARTITION_ID_KEY) if metrics is not None else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None
