"""strategies.common: reply validation, weighted averaging, the relay hop, node sampling."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from concatfl.strategies.common import (
    NO_REPLY,
    NOT_SENT,
    HopResult,
    Request,
    collect,
    live_node_ids,
    message_bytes,
    relay,
    relay_in_batches,
    reply_problem,
    sample_nodes,
    to_messages,
    to_numpy,
    train_content,
    weighted_average,
)
from tests.fakes import BIG_IDS, FakeGrid, Later, reply_with

TEMPLATE = ArrayRecord(
    {"w": Array(np.zeros((2, 3), np.float32)), "b": Array(np.zeros(3, np.float32)),
     "n": Array(np.zeros((), np.int64))}
)


def _arrays(**overrides: np.ndarray) -> ArrayRecord:
    values = {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32), "n": np.array(4, np.int64)}
    values.update(overrides)
    return ArrayRecord({key: Array(value) for key, value in values.items()})


def _content(arrays: ArrayRecord | None = None, num_examples=10) -> RecordDict:
    content = RecordDict()
    if arrays is not None:
        content["arrays"] = arrays
    if num_examples is not None:
        content["metrics"] = MetricRecord({"num-examples": num_examples})
    return content


# ----------------------------------------------------------------------------- reply_problem


def test_reply_problem_accepts_a_good_reply():
    assert reply_problem(_content(_arrays()), TEMPLATE) is None


def test_reply_problem_missing_arrays():
    assert "no ArrayRecord" in reply_problem(_content(None), TEMPLATE)


def test_reply_problem_different_keys_names_missing_and_extra():
    arrays = ArrayRecord({"w": Array(np.ones((2, 3), np.float32)), "x": Array(np.ones(3, np.float32)),
                          "n": Array(np.array(1, np.int64))})
    problem = reply_problem(_content(arrays), TEMPLATE)
    assert "keys differ" in problem and "['b']" in problem and "['x']" in problem


def test_reply_problem_wrong_shape():
    problem = reply_problem(_content(_arrays(w=np.ones((3, 2), np.float32))), TEMPLATE)
    assert problem == "shape of 'w' is (3, 2), expected (2, 3)"


def test_reply_problem_wrong_dtype():
    problem = reply_problem(_content(_arrays(b=np.ones(3, np.float64))), TEMPLATE)
    assert problem == "dtype of 'b' is float64, expected float32"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_reply_problem_non_finite(bad):
    w = np.ones((2, 3), np.float32)
    w[1, 2] = bad
    assert "non-finite" in reply_problem(_content(_arrays(w=w)), TEMPLATE)


def test_reply_problem_data_that_contradicts_its_header():
    # The header says (2, 3) float32, the bytes hold 5 float32s: averaging would broadcast them.
    w = Array(dtype="float32", shape=(2, 3), stype=TEMPLATE["w"].stype, data=Array(np.ones(5, np.float32)).data)
    arrays = _arrays()
    arrays["w"] = w
    assert reply_problem(_content(arrays), TEMPLATE) == "data of 'w' is (5,) float32, not the (2, 3) float32 its header declares"


@pytest.mark.parametrize(("stype", "data"), [("numpy.ndarray", b"not an npy file"), ("torch.Tensor", b"")])
def test_reply_problem_undecodable_array_is_a_reason_not_a_crash(stype, data):
    arrays = _arrays()
    arrays["b"] = Array(dtype="float32", shape=(3,), stype=stype, data=data)
    assert reply_problem(_content(arrays), TEMPLATE).startswith("'b' does not decode as a numpy array")


@pytest.mark.parametrize("num_examples", [0, -5, 0.0, 0.5, 2.5, float("nan"), float("inf"), [1, 2]])
def test_reply_problem_bad_num_examples(num_examples):
    assert "whole positive number" in reply_problem(_content(_arrays(), num_examples), TEMPLATE)


def test_reply_problem_accepts_a_whole_float_num_examples():
    assert reply_problem(_content(_arrays(), 12.0), TEMPLATE) is None


def test_reply_problem_missing_num_examples():
    content = _content(_arrays(), None)
    assert "num-examples" in reply_problem(content, TEMPLATE)
    content["metrics"] = MetricRecord({"loss": 1.0})
    assert "num-examples" in reply_problem(content, TEMPLATE)


def test_reply_problem_missing_num_examples_ok_when_not_required():
    assert reply_problem(_content(_arrays(), None), TEMPLATE, require_num_examples=False) is None


def test_reply_problem_without_template_skips_array_checks():
    assert reply_problem(_content(None, 3), None) is None


# ----------------------------------------------------------------------------- weighted_average


def test_weighted_average_exact_and_dtype_preserved():
    a = {"w": np.array([1.0, 2.0], np.float32), "n": np.array([0, 10], np.int64)}
    b = {"w": np.array([4.0, 8.0], np.float32), "n": np.array([3, 1], np.int64)}
    avg = weighted_average([a, b], [1, 2])
    assert avg["w"].dtype == "float32" and avg["n"].dtype == "int64"
    np.testing.assert_array_equal(avg["w"].numpy(), np.array([3.0, 6.0], np.float32))
    # (0 + 2·3)/3 = 2 ; (10 + 2·1)/3 = 4 exactly
    np.testing.assert_array_equal(avg["n"].numpy(), np.array([2, 4], np.int64))


def test_weighted_average_rounds_integer_arrays():
    a = {"n": np.array([0, 0], np.int64)}
    b = {"n": np.array([10, 1], np.int64)}
    avg = weighted_average([a, b], [1, 2])  # 20/3 = 6.67 → 7 ; 2/3 = 0.67 → 1
    np.testing.assert_array_equal(avg["n"].numpy(), np.array([7, 1], np.int64))


def test_weighted_average_single_record_is_identity_and_keeps_key_order():
    record = _arrays(n=np.array([4, 5], np.int64))
    avg = weighted_average([to_numpy(record)], [5])
    assert list(avg.keys()) == list(record.keys())
    for key in record:
        np.testing.assert_array_equal(avg[key].numpy(), record[key].numpy())


def test_weighted_average_handles_0d_arrays_like_batchnorm_num_batches_tracked():
    # BatchNorm's num_batches_tracked is a 0-d int64 tensor (resnet18, vgg9 models).
    a = {"n": np.array(3, np.int64), "s": np.array(1.0, np.float32)}
    b = {"n": np.array(6, np.int64), "s": np.array(4.0, np.float32)}
    avg = weighted_average([a, b], [2, 1])
    assert avg["n"].shape == () and avg["n"].dtype == "int64" and int(avg["n"].numpy()) == 4
    assert avg["s"].shape == () and avg["s"].dtype == "float32" and float(avg["s"].numpy()) == 2.0


def test_weighted_average_rejects_empty_and_zero_weights():
    with pytest.raises(ValueError):
        weighted_average([], [])
    with pytest.raises(ValueError):
        weighted_average([to_numpy(_arrays()), to_numpy(_arrays())], [0, 0])


# ----------------------------------------------------------------------------- relay / collect


def _good(message: Message) -> Message:
    arrays = message.content.array_records["arrays"]
    doubled = ArrayRecord({key: Array(2 * value.numpy()) for key, value in arrays.items()})
    return reply_with(message, _content(doubled, 7))


def _requests(nodes, size: int = 4) -> list[Request]:
    arrays = ArrayRecord({"w": Array(np.arange(size, dtype=np.float32))})
    return [Request(node, train_content(arrays, {"lr": 0.1}), tag=f"t{i}") for i, node in enumerate(nodes)]


def test_relay_all_good_replies():
    nodes = BIG_IDS[:3]
    hop = relay(FakeGrid({node: _good for node in nodes}), _requests(nodes), timeout=None)
    assert [reply.node_id for reply in hop.replies] == nodes
    assert hop.misses == []
    assert all(reply.num_examples == 7 and type(reply.num_examples) is int for reply in hop.replies)
    np.testing.assert_array_equal(hop.replies[0].arrays["w"].numpy(), [0, 2, 4, 6])
    assert hop.bytes_sent > 0 and hop.bytes_received > 0


def test_relay_turns_missing_error_and_bad_replies_into_misses():
    nodes = BIG_IDS[:4]

    def error(message: Message) -> Message:
        return Message(Error(code=0, reason="client crashed"), reply_to=message)

    def bad(message: Message) -> Message:
        return reply_with(message, _content(ArrayRecord({"w": Array(np.full(4, np.nan, np.float32))}), 7))

    grid = FakeGrid({nodes[0]: _good, nodes[1]: lambda m: None, nodes[2]: error, nodes[3]: bad})
    hop = relay(grid, _requests(nodes), timeout=5.0)
    assert [reply.node_id for reply in hop.replies] == [nodes[0]]
    reasons = {miss.request.node_id: miss.reason for miss in hop.misses}
    assert set(reasons) == set(nodes[1:])
    assert reasons[nodes[1]] == "no reply before the round timeout"
    assert reasons[nodes[2]] == "error reply: client crashed"
    assert reasons[nodes[3]].startswith("rejected: non-finite")
    record = hop.as_record()
    assert record["sent"] == 4 and record["replies"] == 1
    assert {m["node"] for m in record["misses"]} == set(nodes[1:])


def test_relay_bytes_grow_with_model_size():
    nodes = BIG_IDS[:2]
    grid = FakeGrid({node: _good for node in nodes})
    small = relay(grid, _requests(nodes, size=10), timeout=None)
    large = relay(grid, _requests(nodes, size=10_000), timeout=None)
    assert 0 < small.bytes_sent < large.bytes_sent
    assert large.bytes_sent - small.bytes_sent >= 2 * 4 * (10_000 - 10)
    assert large.bytes_received - small.bytes_received >= 2 * 4 * (10_000 - 10)


def test_relay_sends_one_message_per_request_to_the_big_ids():
    nodes = BIG_IDS[-3:]
    grid = FakeGrid({node: _good for node in nodes})
    relay(grid, _requests(nodes), timeout=None)
    assert [m.metadata.dst_node_id for m in grid.sent] == nodes
    assert all(m.metadata.message_type == MessageType.TRAIN for m in grid.sent)


def test_relay_with_no_requests_sends_nothing():
    grid = FakeGrid({BIG_IDS[0]: _good})
    hop = relay(grid, [], timeout=None)
    assert grid.sent == [] and hop.replies == [] and hop.misses == [] and hop.bytes_sent == 0


def test_relay_in_batches_gives_each_pull_as_it_arrives_and_the_misses_last():
    nodes = BIG_IDS[:5]

    def slow(message: Message) -> Later:
        return Later(_good(message), 0.3)

    def bad(message: Message) -> Message:
        return reply_with(message, _content(ArrayRecord({"w": Array(np.full(4, np.nan, np.float32))}), 7))

    handlers = {nodes[0]: slow, nodes[1]: _good, nodes[2]: lambda m: None, nodes[3]: bad, nodes[4]: _good}
    parts = list(relay_in_batches(FakeGrid(handlers), _requests(nodes), timeout=1.0))
    # The first pull brings the three answers that were there at once (in request order, the
    # malformed one a miss), the second the slow one, the last the node that never answered.
    assert [[reply.node_id for reply in part.replies] for part in parts] == [[nodes[1], nodes[4]], [nodes[0]], []]
    assert [[miss.request.node_id for miss in part.misses] for part in parts] == [[nodes[3]], [], [nodes[2]]]
    assert parts[2].misses[0].reason == "no reply before the round timeout"
    whole = HopResult()
    for part in parts:
        whole.add(part)
    assert whole.bytes_sent == parts[-1].bytes_sent == relay(FakeGrid(handlers), _requests(nodes), timeout=1.0).bytes_sent
    assert whole.bytes_received > 0 and whole.seconds >= 0.3
    assert whole.as_record()["sent"] == 5 and whole.as_record()["replies"] == 3


def test_relay_in_batches_sends_the_next_requests_as_earlier_ones_are_answered():
    nodes = BIG_IDS[:5]
    grid = FakeGrid({node: _good for node in nodes})
    parts = list(relay_in_batches(grid, _requests(nodes), timeout=1.0, in_flight=2))
    assert [[m.metadata.dst_node_id for m in batch] for batch in grid.hops] == [nodes[:2], nodes[2:4], nodes[4:]]
    assert [[reply.node_id for reply in part.replies] for part in parts] == [nodes[:2], nodes[2:4], nodes[4:], []]
    assert parts[-1].bytes_sent == relay(FakeGrid({node: _good for node in nodes}), _requests(nodes), 1.0).bytes_sent


def test_relay_in_batches_counts_requests_that_hung_nodes_held_back_as_not_sent():
    nodes = BIG_IDS[:4]
    grid = FakeGrid({nodes[0]: lambda m: None, nodes[1]: lambda m: None, nodes[2]: _good, nodes[3]: _good})
    parts = list(relay_in_batches(grid, _requests(nodes), timeout=0.3, in_flight=2))
    assert [[m.metadata.dst_node_id for m in batch] for batch in grid.hops] == [nodes[:2]]
    assert [(miss.request.node_id, miss.reason) for miss in parts[-1].misses] == [
        (nodes[0], NO_REPLY), (nodes[1], NO_REPLY), (nodes[2], NOT_SENT), (nodes[3], NOT_SENT)]
    assert not any(miss.answered for miss in parts[-1].misses)


def test_relay_in_batches_without_requests_yields_nothing():
    grid = FakeGrid({BIG_IDS[0]: _good})
    assert list(relay_in_batches(grid, [], timeout=None)) == [] and grid.sent == []


def test_collect_ignores_unexpected_and_duplicate_replies():
    nodes = BIG_IDS[:2]
    requests = _requests(nodes)
    messages = to_messages(requests)
    stranger = Message(train_content(ArrayRecord({"w": Array(np.zeros(4, np.float32))}), {}),
                       dst_node_id=BIG_IDS[9], message_type=MessageType.TRAIN)
    replies = [_good(messages[0]), _good(messages[0]), _good(stranger)]
    hop = collect(requests, replies)
    assert [reply.node_id for reply in hop.replies] == [nodes[0]]
    assert [miss.request.node_id for miss in hop.misses] == [nodes[1]]


def test_collect_uses_expect_arrays_over_the_sent_arrays():
    node = BIG_IDS[0]
    expect = ArrayRecord({"head": Array(np.zeros(2, np.float32))})
    request = Request(node, train_content(ArrayRecord({"w": Array(np.zeros(4, np.float32))}), {}),
                      expect_arrays=expect)
    (message,) = to_messages([request])
    good = reply_with(message, _content(ArrayRecord({"head": Array(np.ones(2, np.float32))}), 3))
    assert len(collect([request], [good]).replies) == 1
    assert "keys differ" in collect([request], [_good(message)]).misses[0].reason


def test_message_bytes_counts_the_array_payload():
    (small,) = to_messages(_requests(BIG_IDS[:1], size=1))
    (large,) = to_messages(_requests(BIG_IDS[:1], size=1001))
    assert message_bytes(large) - message_bytes(small) >= 4000


def _serialized_size(message: Message) -> int:
    """What Flower 1.42 ships: every distinct object of the message's tree, deflated."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


def _model_arrays(seed: int) -> ArrayRecord:
    """A small CNN-like state: weights, biases and two BatchNorm layers whose equal running
    statistics (zeros, ones) are one object each on the wire."""
    rng = np.random.default_rng(seed)
    arrays = {
        "conv.weight": rng.normal(size=(8, 3, 3, 3)).astype(np.float32),
        "conv.bias": rng.normal(size=8).astype(np.float32),
        "bn1.running_mean": np.zeros(8, np.float32),
        "bn1.running_var": np.ones(8, np.float32),
        "bn1.num_batches_tracked": np.array(3, np.int64),
        "bn2.running_mean": np.zeros(8, np.float32),
        "bn2.running_var": np.ones(8, np.float32),
        "bn2.num_batches_tracked": np.array(3, np.int64),
        "fc.weight": rng.normal(size=(10, 72)).astype(np.float32),
        "fc.bias": np.zeros(10, np.float64),
    }
    return ArrayRecord({key: Array(value) for key, value in arrays.items()})


def _message_shapes() -> dict[str, Message]:
    node = BIG_IDS[3]
    train = Message(
        content=train_content(_model_arrays(0), {"lr": 0.05, "local-epochs": 2, "mode": "é", "flag": True}),
        dst_node_id=node,
        message_type=MessageType.TRAIN,
    )
    model = _model_arrays(1)
    control = ArrayRecord({key: Array(np.zeros_like(model[key].numpy())) for key in ("conv.weight", "fc.weight")})
    scaffold = Message(
        content=RecordDict({"arrays": model, "control": control, "config": ConfigRecord({"lr": 0.1})}),
        dst_node_id=node,
        message_type=MessageType.TRAIN,
    )
    empty = Message(
        content=RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({})}),
        dst_node_id=node,
        message_type="train.custom",
    )
    # 16 MiB: four of Flower's 5 MiB chunks, the 2nd and 3rd equal (zeros), one object on the wire.
    large = ArrayRecord({"big": Array(np.zeros(4 * 1024 * 1024, np.float32)), "small": Array(np.arange(5.0))})
    reply = _content(_model_arrays(2), num_examples=12)
    reply["extra"] = MetricRecord({"loss": [0.5, 0.25]})
    return {
        "train": train,
        "reply with arrays and metrics": reply_with(train, reply),
        "scaffold's two ArrayRecords": scaffold,
        "scaffold's reply": reply_with(scaffold, RecordDict({"arrays": model, "control": control,
                                                             "metrics": MetricRecord({"num-examples": 4})})),
        "error reply": Message(Error(code=0, reason="ClientApp raised ValueError: boom"), reply_to=train),
        "empty arrays": empty,
        "empty content": Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.EVALUATE),
        "multi-chunk array": Message(content=RecordDict({"arrays": large}), dst_node_id=node,
                                     message_type=MessageType.TRAIN),
    }


def test_message_bytes_equals_the_serialized_size():
    for shape, message in _message_shapes().items():
        assert message_bytes(message) == _serialized_size(message), shape


def test_message_bytes_counts_an_array_shipped_twice_in_one_message_once():
    arrays = _model_arrays(0)
    twice = Message(content=RecordDict({"a": arrays, "b": ArrayRecord(dict(arrays.items()))}),
                    dst_node_id=BIG_IDS[0], message_type=MessageType.TRAIN)
    once = Message(content=RecordDict({"a": arrays}), dst_node_id=BIG_IDS[0], message_type=MessageType.TRAIN)
    assert message_bytes(twice) == _serialized_size(twice)
    assert message_bytes(twice) - message_bytes(once) < 200  # one more reference, not the arrays again


# ----------------------------------------------------------------------------- to_messages / nodes


def test_to_messages_rejects_two_requests_to_the_same_node():
    with pytest.raises(ValueError, match="at most one message per node"):
        to_messages(_requests([BIG_IDS[1], BIG_IDS[2], BIG_IDS[1]]))


def test_to_messages_keeps_node_ids_and_message_types_exact():
    requests = [Request(BIG_IDS[5], RecordDict(), message_type=MessageType.EVALUATE),
                Request(BIG_IDS[6], RecordDict(), message_type="query.custom")]
    messages = to_messages(requests)
    assert [m.metadata.dst_node_id for m in messages] == [BIG_IDS[5], BIG_IDS[6]]
    assert [m.metadata.message_type for m in messages] == [MessageType.EVALUATE, "query.custom"]


def test_sample_nodes_returns_exact_distinct_python_ints():
    rng = np.random.default_rng(0)
    chosen = sample_nodes(rng, BIG_IDS, 20)
    assert len(chosen) == 20 == len(set(chosen))
    assert all(type(node) is int and node in BIG_IDS for node in chosen)


def test_sample_nodes_full_count_is_a_permutation_and_seeded():
    chosen = sample_nodes(np.random.default_rng(3), BIG_IDS, len(BIG_IDS))
    assert sorted(chosen) == sorted(BIG_IDS)
    assert chosen == sample_nodes(np.random.default_rng(3), BIG_IDS, len(BIG_IDS))


def test_live_node_ids_sorted_exact_ints():
    grid = FakeGrid({node: _good for node in reversed(BIG_IDS[:5])})
    assert live_node_ids(grid) == BIG_IDS[:5]


def test_empty_hop_record():
    assert HopResult().as_record() == {"sent": 0, "replies": 0, "misses": [], "bytes_sent": 0,
                                       "bytes_received": 0, "seconds": 0.0}


def test_superlink_error_reply_is_filed_under_the_node_it_was_sent_to():
    """A node that went away is answered by the SuperLink itself (source node 0): the miss
    must name the node and carry the error, matched through the id of the message it answers."""
    requests = [Request(node, train_content(_arrays(), {})) for node in BIG_IDS[:2]]
    messages = to_messages(requests)
    for message in messages:  # what Flower's grid does on push
        message.metadata.__dict__["_message_id"] = message.object_id
    unavailable = Message(Error(code=0, reason="Node Unavailable"), reply_to=messages[1])
    unavailable.metadata.__dict__["_src_node_id"] = 0
    hop = collect(requests, [unavailable], messages)
    reasons = {miss.request.node_id: miss.reason for miss in hop.misses}
    assert reasons[BIG_IDS[1]] == "error reply: Node Unavailable"
    assert reasons[BIG_IDS[0]] == "no reply before the round timeout"
