"""`StableNodeGrid`: nodes under their partition ids, messages routed to the right Flower node,
replies polled until they come or the timeout ends."""

from __future__ import annotations

import time

import pytest
from flwr.app import Error, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, ObjectUnavailableError

from concatfl.deployment import grid as grid_module
from concatfl.deployment.grid import StableNodeGrid, pull_objects_in_time

from .fakes import BIG_IDS, FakeGrid, Later, reply_with


def _identity_node(partition: int | None, answer_after: float = 0.0):
    """A node answering the identity query with `partition` (None: an ordinary ClientApp
    without that query, which answers with an error), `answer_after` seconds after it was asked."""

    def handle(message: Message) -> Message | Later:
        if message.metadata.message_type != MessageType.QUERY:
            return reply_with(message, RecordDict({"metrics": MetricRecord({"num-examples": 1})}))
        if partition is None:
            return Message(error=Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="no query handler"),
                           reply_to=message)
        reply = reply_with(message, RecordDict({"metrics": MetricRecord({"partition-id": partition})}))
        return Later(reply, answer_after) if answer_after else reply

    return handle


def _silent(message: Message) -> None:
    return None


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



def _identified_grid(count: int, reply_after: float) -> tuple[FakeGrid, StableNodeGrid]:
    """A StableNodeGrid over `count` identified nodes (partitions 0, 1, …) that answer every
    later message after `reply_after` seconds."""
    nodes = BIG_IDS[1:count + 1]
    fake = FakeGrid({node: _identity_node(partition) for partition, node in enumerate(nodes)})
    grid = StableNodeGrid(fake, pull_interval=0.05)
    list(grid.get_node_ids())
    for node in nodes:
        fake.handlers[node] = lambda message: Later(reply_with(message, RecordDict()), reply_after)
    return fake, grid


def test_replies_that_arrive_while_a_slow_pull_overruns_the_deadline_are_taken():
    # Flower's grid retries the objects of a reply whose sender died mid-upload with a growing
    # backoff: that pull returns after the deadline, when the other node's reply is there.
    fake, grid = _identified_grid(2, reply_after=0.3)
    pull = fake.pull_messages
    pulls = []

    def slow_first_pull(message_ids):
        pulls.append(time.monotonic())
        if len(pulls) == 1:
            time.sleep(0.6)  # past the 0.5 s deadline, with nothing pulled
            return []
        return pull(message_ids)

    fake.pull_messages = slow_first_pull
    sent = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN) for node in (0, 1)]
    replies = list(grid.send_and_receive(sent, timeout=0.5))
    assert len(pulls) == 2  # one more pull after the deadline, then no more
    assert [reply.metadata.src_node_id for reply in replies] == [0, 1]


def test_a_listed_replys_objects_are_pulled_until_one_more_timeout_past_the_deadline():
    fake, grid = _identified_grid(1, reply_after=0.2)
    pull = fake.pull_messages
    bounds = []

    def pull_noting_the_bound(message_ids):
        bounds.append(grid_module._objects_deadline.at - time.monotonic())
        return pull(message_ids)

    fake.pull_messages = pull_noting_the_bound
    sent = [Message(RecordDict(), dst_node_id=0, message_type=MessageType.TRAIN)]
    assert len(list(grid.send_and_receive(sent, timeout=0.5))) == 1
    assert 0.5 < bounds[-1] <= bounds[0] <= 1.0  # the deadline, 0.5 s away, plus one more 0.5 s
    assert grid_module._objects_deadline.at is None  # outside a hop: Flower's own bound

    def never_uploaded(object_id):
        raise ObjectUnavailableError(object_id)

    grid_module._objects_deadline.at = time.monotonic() + 0.3
    started = time.monotonic()
    try:
        with pytest.raises(ObjectPullError):
            pull_objects_in_time(["abc"], never_uploaded)
    finally:
        grid_module._objects_deadline.at = None
    assert 0.3 <= time.monotonic() - started < 1.0


def test_a_node_answering_within_the_limit_is_waited_for():
    fake = FakeGrid({BIG_IDS[1]: _identity_node(0), BIG_IDS[2]: _identity_node(1, answer_after=0.4)})
    grid = StableNodeGrid(fake, identify_timeout=5.0, pull_interval=0.05)
    started = time.monotonic()
    assert list(grid.get_node_ids()) == [0, 1]
    assert 0.4 <= time.monotonic() - started < 2.0
    assert grid.identity_report() == {"identified": 2, "late": [], "flower_ids": [], "unanswered": []}


def test_a_late_node_is_left_out_until_it_answers_then_identified_without_being_asked_again():
    fake = FakeGrid({BIG_IDS[1]: _identity_node(0), BIG_IDS[2]: _identity_node(1, answer_after=0.8)})
    grid = StableNodeGrid(fake, identify_timeout=0.2, pull_interval=0.05)
    started = time.monotonic()
    assert list(grid.get_node_ids()) == [0]  # node 1 is not used under its Flower id meanwhile
    assert 0.2 <= time.monotonic() - started < 0.7
    assert grid.identity_report()["unanswered"] == [BIG_IDS[2]]
    assert list(grid.get_node_ids()) == [0]  # still not answered: one pull, no wait, no new query
    assert time.monotonic() - started < 0.7
    time.sleep(0.9)
    assert list(grid.get_node_ids()) == [0, 1]
    assert grid.identities() == {0: BIG_IDS[1], 1: BIG_IDS[2]}
    queries = [m for m in fake.sent if m.metadata.message_type == MessageType.QUERY]
    assert len(queries) == 2  # each node was asked once
    assert grid.identity_report() == {"identified": 2, "late": [1], "flower_ids": [], "unanswered": []}


def test_nodes_that_never_answer_or_answer_without_a_partition_are_reported():
    fake = FakeGrid({BIG_IDS[1]: _identity_node(0), BIG_IDS[2]: _silent, BIG_IDS[3]: _identity_node(None)})
    grid = StableNodeGrid(fake, identify_timeout=0.2, pull_interval=0.05)
    assert list(grid.get_node_ids()) == [0, BIG_IDS[3]]
    report = grid.identity_report()
    assert report == {"identified": 1, "late": [], "flower_ids": [BIG_IDS[3]], "unanswered": [BIG_IDS[2]]}
    del fake.handlers[BIG_IDS[2]]  # the silent node disconnects: no longer reported as waiting
    list(grid.get_node_ids())
    assert grid.identity_report()["unanswered"] == []


def test_a_lost_identity_query_is_asked_again():
    answers = iter(["lost", "partition"])

    def flaky(message: Message) -> Message:
        if next(answers) == "lost":  # as the SuperLink answers for a node that went away meanwhile
            return Message(error=Error(code=ErrorCode.NODE_UNAVAILABLE, reason="node unavailable"), reply_to=message)
        return reply_with(message, RecordDict({"metrics": MetricRecord({"partition-id": 4})}))

    fake = FakeGrid({BIG_IDS[1]: _identity_node(0), BIG_IDS[2]: flaky})
    grid = StableNodeGrid(fake, identify_timeout=1.0, pull_interval=0.05)
    assert list(grid.get_node_ids()) == [0]
    assert list(grid.get_node_ids()) == [0, 4]
    assert grid.identity_report()["flower_ids"] == []


def test_without_a_limit_every_answer_is_awaited():
    fake = FakeGrid({BIG_IDS[1]: _identity_node(0, answer_after=0.3), BIG_IDS[2]: _identity_node(1, answer_after=0.5)})
    grid = StableNodeGrid(fake, identify_timeout=None, pull_interval=0.05)
    assert list(grid.get_node_ids()) == [0, 1]
