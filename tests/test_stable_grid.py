"""`StableNodeGrid`: nodes under their partition ids, messages routed to the right Flower node,
replies polled until they come or the timeout ends."""

from __future__ import annotations

import time

import pytest
from flwr.app import Error, Message, MessageType, MetricRecord, RecordDict

from concatfl.stable_grid import StableNodeGrid

from .fakes import BIG_IDS, FakeGrid, reply_with


def _identity_node(partition: int | None):
    """A node answering the identity query with `partition` (None: an ordinary ClientApp
    without that query, which answers with an error)."""

    def handle(message: Message) -> Message:
        if message.metadata.message_type != MessageType.QUERY:
            return reply_with(message, RecordDict({"metrics": MetricRecord({"num-examples": 1})}))
        if partition is None:
            return Message(error=Error(code=0, reason="no query handler"), reply_to=message)
        return reply_with(message, RecordDict({"metrics": MetricRecord({"partition-id": partition})}))

    return handle


def test_nodes_appear_under_their_partition_ids_and_messages_reach_them():
    fake = FakeGrid({BIG_IDS[1]: _identity_node(1), BIG_IDS[2]: _identity_node(0), BIG_IDS[3]: _identity_node(None)})
    grid = StableNodeGrid(fake)
    assert list(grid.get_node_ids()) == [0, 1, BIG_IDS[3]]  # the ordinary node keeps its Flower id
    assert len(fake.hops) == 1  # one identity query per new node, asked once
    list(grid.get_node_ids())
    assert len(fake.hops) == 1
    sent = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN) for node in (0, BIG_IDS[3])]
    replies = list(grid.send_and_receive(sent))
    assert [m.metadata.dst_node_id for m in fake.hops[-1]] == [BIG_IDS[2], BIG_IDS[3]]
    assert [reply.metadata.src_node_id for reply in replies] == [0, BIG_IDS[3]]
    with pytest.raises(ValueError, match="no connected node has the stable id 5"):
        grid.send_and_receive([Message(RecordDict(), dst_node_id=5, message_type=MessageType.TRAIN)])


def test_a_restarted_node_takes_over_its_partition_and_the_stale_id_is_hidden():
    fake = FakeGrid({BIG_IDS[1]: _identity_node(0), BIG_IDS[2]: _identity_node(1)})
    grid = StableNodeGrid(fake)
    assert list(grid.get_node_ids()) == [0, 1]
    fake.handlers[BIG_IDS[5]] = _identity_node(0)  # partition 0 again, under a new Flower id
    assert list(grid.get_node_ids()) == [0, 1]
    assert grid.identities() == {0: BIG_IDS[5], 1: BIG_IDS[2]}
    list(grid.send_and_receive([Message(RecordDict(), dst_node_id=0, message_type=MessageType.TRAIN)]))
    assert fake.hops[-1][0].metadata.dst_node_id == BIG_IDS[5]


def test_replies_are_polled_until_the_timeout_and_a_missing_one_is_left_out():
    fake = FakeGrid({BIG_IDS[1]: _identity_node(0), BIG_IDS[2]: _identity_node(1)})
    grid = StableNodeGrid(fake, pull_interval=0.05)
    list(grid.get_node_ids())
    fake.handlers[BIG_IDS[2]] = lambda message: None  # node 1's reply never comes
    started = time.monotonic()
    sent = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN) for node in (0, 1)]
    replies = list(grid.send_and_receive(sent, timeout=0.5))
    assert 0.5 <= time.monotonic() - started < 2.0
    assert [reply.metadata.src_node_id for reply in replies] == [0]

