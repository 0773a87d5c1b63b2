"""The fuzzing mod (concatfl.fuzz): each kind does what it says, and the server sees it so."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from concatfl.fuzz import HUGE_EXAMPLES, KINDS, LABEL_MALFORMED, MALFORMED, POISONED, TRAIN_MALFORMED, corrupt, fuzz_mod, parse_kinds
from concatfl.protocol import LABEL_DISTRIBUTION, LABELS_MESSAGE_TYPE
from concatfl.strategies.common import reply_problem, to_numpy
from concatfl.strategies.fedconcat_stage1 import distribution_problem

SENT = ArrayRecord({"w": Array(np.ones((2, 3), dtype=np.float32)), "n": Array(np.asarray(4, dtype=np.int64))})


def received(message_type: str = MessageType.TRAIN, content: RecordDict | None = None, server_round: int = 1) -> Message:
    """A message as a ClientApp receives it (with an id and a source node), so it can be replied to."""
    content = content or RecordDict({"arrays": SENT, "config": ConfigRecord({"server-round": server_round})})
    message = Message(content, dst_node_id=7, message_type=message_type)
    message.metadata.__dict__["_message_id"] = message.object_id
    message.metadata.__dict__["_src_node_id"] = 0
    return message


def train_reply(message: Message, _context: Context | None = None) -> Message:
    """An honest reply: the model moved by +0.5, 20 examples."""
    trained = ArrayRecord({"w": Array(np.full((2, 3), 1.5, dtype=np.float32)), "n": Array(np.asarray(5, dtype=np.int64))})
    return Message(RecordDict({"arrays": trained, "metrics": MetricRecord({"num-examples": 20})}), reply_to=message)


def context(node_config: dict | None = None, **run_config) -> Context:
    return Context(run_id=1, node_id=7, node_config={"partition-id": 3, **(node_config or {})}, state=RecordDict(),
                   run_config=run_config)


def test_kind_groups_and_lists():
    assert parse_kinds("all") == MALFORMED + POISONED and parse_kinds("malformed") == MALFORMED
    assert parse_kinds("poisoned") == POISONED and set(KINDS) == {*MALFORMED, *POISONED, "hang"}
    assert parse_kinds("nan, scaled") == ("nan", "scaled")
    with pytest.raises(ValueError, match="unknown fuzz kinds \\['bogus'\\]"):
        parse_kinds("nan,bogus")


@pytest.mark.parametrize("kind", TRAIN_MALFORMED)
def test_every_malformed_train_kind_is_one_that_validation_rejects(kind):
    message = received()
    content = corrupt(message, train_reply(message).content, kind, np.random.default_rng(0))
    assert reply_problem(content, SENT) is not None


def test_poisoned_train_kinds_are_well_formed_and_do_what_they_say():
    message = received()
    rng = np.random.default_rng(0)
    honest = train_reply(message).content
    scaled = corrupt(message, honest, "scaled", rng)
    flipped = corrupt(message, honest, "sign-flip", rng)
    huge = corrupt(message, honest, "huge-examples", rng)
    for content in (scaled, flipped, huge):
        assert reply_problem(content, SENT) is None
    np.testing.assert_allclose(to_numpy(scaled["arrays"])["w"], 1.5e6)
    np.testing.assert_allclose(to_numpy(flipped["arrays"])["w"], 0.5)  # 1 − (1.5 − 1)
    assert int(to_numpy(flipped["arrays"])["n"]) == 5  # counters are not weights
    assert huge["metrics"]["num-examples"] == HUGE_EXAMPLES


@pytest.mark.parametrize("kind", [*LABEL_MALFORMED, "label-lie"])
def test_label_kinds(kind):
    message = received(LABELS_MESSAGE_TYPE, RecordDict({"config": ConfigRecord({"fedconcat-dp-epsilon": 0.0})}))
    honest = RecordDict({"metrics": MetricRecord({LABEL_DISTRIBUTION: [0.5, 0.5, 0.0, 0.0]})})
    content = corrupt(message, honest, kind, np.random.default_rng(1))
    values = content["metrics"][LABEL_DISTRIBUTION]
    problem = distribution_problem(values, 4, 0.0)
    if kind == "label-lie":  # well-formed: a one-hot on some class
        assert problem is None and sorted(values) == [0.0, 0.0, 0.0, 1.0]
    else:
        assert problem is not None


def test_the_mod_does_nothing_unless_switched_on():
    message = received()
    assert fuzz_mod(message, context(), train_reply).content["metrics"]["num-examples"] == 20
    assert fuzz_mod(message, context(**{"fuzz-share": 0.0}), train_reply).content["metrics"]["num-examples"] == 20


def test_every_reply_replaced_at_share_one_logged_as_ground_truth(tmp_path):
    log_file = tmp_path / "fuzz.jsonl"
    node = context(**{"fuzz-share": 1.0, "fuzz-kinds": "huge-examples", "fuzz-log": str(log_file)})
    for server_round in (1, 2):
        reply = fuzz_mod(received(server_round=server_round), node, train_reply)
        assert reply.content["metrics"]["num-examples"] == HUGE_EXAMPLES
    entries = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert [(e["server_round"], e["kind"], e["partition_id"], e["message_type"]) for e in entries] == [
        (1, "huge-examples", 3, "train"), (2, "huge-examples", 3, "train")
    ]


def test_node_config_wins_and_other_messages_pass():
    node = context({"fuzz-share": 1.0, "fuzz-kinds": "nan"}, **{"fuzz-share": 0.0})
    assert reply_problem(fuzz_mod(received(), node, train_reply).content, SENT) is not None
    evaluate = received(MessageType.EVALUATE)
    metrics = Message(RecordDict({"metrics": MetricRecord({"num-examples": 5, "accuracy": 0.5})}), reply_to=evaluate)
    assert fuzz_mod(evaluate, node, lambda m, c: metrics) is metrics  # no kind applies: untouched
    # Label kinds only apply to the label query; a train-only list leaves it alone.
    query = received(LABELS_MESSAGE_TYPE, RecordDict({"config": ConfigRecord({})}))
    labels = Message(RecordDict({"metrics": MetricRecord({LABEL_DISTRIBUTION: [1.0, 0.0]})}), reply_to=query)
    assert fuzz_mod(query, node, lambda m, c: labels) is labels


def test_draws_are_seeded_per_node_and_message_count():
    def kinds(seed: int) -> list[str]:
        node = context(**{"fuzz-share": 0.5, "fuzz-seed": seed})
        drawn = []
        for server_round in range(1, 13):
            content = fuzz_mod(received(server_round=server_round), node, train_reply).content
            drawn.append("clean" if reply_problem(content, SENT) is None and content["metrics"]["num-examples"] == 20
                         and float(to_numpy(content["arrays"])["w"][0, 0]) == 1.5 else "fuzzed")
        return drawn

    assert kinds(0) == kinds(0)
    assert kinds(0) != kinds(1)
    assert 0 < kinds(0).count("fuzzed") < 12


def test_a_hang_is_asked_for_by_name_and_delays_the_reply(monkeypatch):
    import concatfl.fuzz as fuzz

    assert "hang" not in parse_kinds("all") and parse_kinds("hang") == ("hang",)
    slept = []
    monkeypatch.setattr(fuzz.time, "sleep", slept.append)
    reply = fuzz_mod(received(), context(**{"fuzz-share": 1.0, "fuzz-kinds": "hang"}), train_reply)
    assert slept == [fuzz.HANG_SECONDS] and reply.content["metrics"]["num-examples"] == 20  # the honest reply, late
