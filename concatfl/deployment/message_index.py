"""A per-node index of the messages in the simulation's link state: a sweep that costs the nodes, not nodes × messages.

Flower 1.42's simulation engine (`flwr/server/superlink/fleet/vce/vce_api.py`,
`add_messages_to_queue`) asks the in-memory LinkState for the next message of *every* node every
0.1 s, and `InMemoryLinkState.get_message_ins` finds a node's message by scanning every stored
message, checking each one's expiry and federation on the way, under the lock that the
ServerApp's own pushes and pulls wait for. One sweep costs N nodes × the messages stored: with
10,000 clients and a round's 100 messages, 10⁶ checks per sweep, so a round's server-side seconds
grew with the federation (5.6 s at 10,000 clients against 2.0 s at 1,000, m = 100), and the
identity query at start-up, one message per node, made it N² (518 s to start 10,000 clients).

`index_messages_by_node(state)` gives one InMemoryLinkState's `store_message_ins` and
`get_message_ins` an index: storing a message files its id under its destination node, and asking
for a node's messages checks only the ids filed under that node, in the order they were stored,
each with Flower's own `_check_stored_messages` (expired ones are deleted as Flower deletes them).
A node is given exactly the messages Flower's scan would give it; what a call no longer does is
check, on the way, the messages of the other nodes that the scan passed over (each is checked
when its own node is asked, in the same sweep). Ids whose message was delivered or deleted leave
the index the next time their node is asked.

It replaces two methods of one state object (the simulation's, which lives in the ServerApp's
process), only where that object has the shape it was written for (`compat.linkstate_problem`);
otherwise Flower's scan stays, with one WARNING. A deployment's SuperLink (SQLite state, each
SuperNode asking for its own messages) has no such sweep and is not touched.
"""

from __future__ import annotations

from collections.abc import Callable
from logging import WARNING
from typing import Any

from flwr.app import Message
from flwr.supercore import log
from flwr.supercore.date import now

from .compat import linkstate_problem


def index_messages_by_node(state: Any) -> bool:
    """Index `state`'s stored messages by destination node (see the module docstring); return
    whether it was done."""
    if getattr(state.get_message_ins, "indexed_by_node", False):
        return True  # a second grid over the same state
    if (problem := linkstate_problem(state)) is not None:
        log(WARNING, "Flower's in-memory link state differs from the one concatfl indexes (%s): the "
            "simulation finds each node's messages by Flower's scan of all of them", problem)
        return False
    # node id -> ids of the messages stored for it and not yet given (a dict: ordered, no duplicates)
    filed: dict[int, dict[str, None]] = {}
    with state.lock:
        for message_id, message in state.message_ins_store.items():
            if message.metadata.delivered_at == "":
                filed.setdefault(message.metadata.dst_node_id, {})[message_id] = None
    state.store_message_ins = _filing(state, state.store_message_ins, filed)
    state.get_message_ins = _indexed_get(state, filed)
    return True


def _filing(state: Any, store: Callable[[Message], str | None], filed: dict[int, dict[str, None]]) -> Callable[[Message], str | None]:
    def store_message_ins(message: Message) -> str | None:
        message_id = store(message)
        if message_id is not None:
            with state.lock:
                filed.setdefault(message.metadata.dst_node_id, {})[message_id] = None
        return message_id

    return store_message_ins


def _indexed_get(state: Any, filed: dict[int, dict[str, None]]) -> Callable[..., list[Message]]:
    def get_message_ins(node_id: int, limit: int | None, *, run_id: int | None = None) -> list[Message]:
        if limit is not None and limit < 1:
            raise AssertionError("`limit` must be >= 1")
        given: list[Message] = []
        with state.lock:
            ids = filed.get(node_id, {})
            for message_id in list(ids):
                state._check_stored_messages({message_id})  # pylint: disable=protected-access
                message = state.message_ins_store.get(message_id)
                if message is None or message.metadata.delivered_at != "":
                    del ids[message_id]
                elif run_id is None or message.metadata.run_id == run_id:
                    del ids[message_id]
                    given.append(message)
                    if limit and len(given) == limit:
                        break
            if not ids:
                filed.pop(node_id, None)
            delivered_at = now().isoformat()
            for message in given:
                message.metadata.delivered_at = delivered_at
        return given

    get_message_ins.indexed_by_node = True  # type: ignore[attr-defined]
    return get_message_ins
