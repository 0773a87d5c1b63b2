"""The bound on every reply (core.bounds, strategies.guard) and the robust aggregations, exactly."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from concatfl.core.bounds import (
    REJECT_BEYOND,
    bound_share,
    bounded_weight,
    move,
    outsized,
    outsized_alone,
    reference,
    scale,
    stream_reference,
    update_vector,
)
from concatfl.strategies.aggregation import Aggregation
from concatfl.strategies.common import Miss, Reply, Request, to_numpy, train_content
from concatfl.strategies.fedconcat_stage1 import distribution_problem
from concatfl.strategies.guard import WARN_AFTER_ROUNDS, ReplyGuard


def arrays(*weights: float, steps: int = 0) -> ArrayRecord:
    return ArrayRecord(
        {
            "w": Array(np.asarray(weights, dtype=np.float32)),
            "num_batches_tracked": Array(np.asarray(steps, dtype=np.int64)),
        }
    )


def reply(node: int, sent: ArrayRecord, returned: ArrayRecord, examples: int = 10) -> Reply:
    content = RecordDict({"arrays": returned, "metrics": MetricRecord({"num-examples": examples, "train-loss": 0.5})})
    return Reply(Request(node, train_content(sent, {})), content, examples)


# ------------------------------------------------------------------ pure rules


def test_reference_is_the_lower_median():
    assert reference([]) is None
    assert reference([1.0, 9.0, 2.0]) == 2.0
    assert reference([1.0, 2.0, 3.0, 10.0]) == 2.0
    assert reference([1.0, 1e6]) == 1.0  # one honest and one outsized value: the honest one


@pytest.mark.parametrize(
    ("length", "ref", "clip", "step", "expected"),
    [
        (1.0, 1.0, 4.0, 1.0, 1.0),  # an ordinary update: taken whole
        (4.0, 1.0, 4.0, 1.0, 1.0),  # exactly at the bound
        (1e6, 1.0, 4.0, 1.0, 4e-6),  # ×10⁶: scaled to the bound
        (6.0, 2.0, 1.0, 1.0, 1 / 3),
        (3.0, 1.0, 4.0, 0.5, 0.5),  # the strategy's own step is the largest share
        (12.0, 1.0, 4.0, 0.5, 1 / 3),  # … until the bound is tighter
        (1e6, 1.0, 0.0, 1.0, 1.0),  # clip 0: off
        (1e6, None, 4.0, 1.0, 1.0),  # no reference yet
        (0.0, 1.0, 4.0, 1.0, 1.0),  # the update did not move the model
    ],
)
def test_bound_share(length, ref, clip, step, expected):
    assert bound_share(length, ref, clip, step) == pytest.approx(expected)


def test_an_update_beyond_reject_beyond_bounds_is_outsized():
    assert REJECT_BEYOND == 25.0
    assert not outsized(100.0, 1.0, 4.0)  # 100 = 25 bounds of 4 × 1: still clipped
    assert outsized(100.1, 1.0, 4.0)
    assert not outsized(1e9, 1.0, 0.0)  # the bound off: nothing is outsized
    assert not outsized(1e9, None, 4.0) and not outsized(1e9, 0.0, 4.0)  # nothing to measure against


def test_an_update_with_nothing_to_measure_it_against_is_outsized_beyond_reject_beyond_bounds_of_its_model():
    origin = {"w": np.asarray([3.0, 4.0], dtype=np.float32), "steps": np.asarray(7)}  # norm 5 (counters do not count)
    assert not outsized_alone(500.0, origin, 4.0)  # 25 bounds of 4 × 5
    assert outsized_alone(500.1, origin, 4.0)
    assert not outsized_alone(1e9, origin, 0.0)  # the bound off
    assert not outsized_alone(1e9, None, 4.0)  # an update that is the reply itself: no model to measure against
    assert not outsized_alone(1e9, {"w": np.zeros(2)}, 4.0)  # a model of norm 0 gives no scale


def test_bounded_weight():
    assert bounded_weight(10**12, 100.0, 4.0) == 400.0
    assert bounded_weight(150, 100.0, 4.0) == 150
    assert bounded_weight(10**12, 100.0, 0.0) == 10**12
    assert bounded_weight(10**12, None, 4.0) == 10**12


def test_a_weight_that_jumps_beyond_its_nodes_previous_report_and_the_reference_counts_as_that_report():
    assert bounded_weight(10**12, 120.0, 4.0, previous=100) == 100
    assert bounded_weight(480, 120.0, 4.0, previous=100) == 480  # 4 × max(100, 120): no jump
    assert bounded_weight(481, 120.0, 4.0, previous=100) == 100
    assert bounded_weight(1000, 100.0, 4.0, previous=300) == 400  # within 4 times its own 300: capped
    assert bounded_weight(10**12, 100.0, 4.0, previous=10**12) == 400  # a report it keeps making: capped
    assert bounded_weight(10**12, 120.0, 4.0, previous=None) == 480  # a first report: capped
    assert bounded_weight(10**12, 120.0, 0.0, previous=100) == 10**12


def test_move_keeps_dtypes_and_takes_counters_from_the_reply():
    moved = move(to_numpy(arrays(0.0, 2.0, steps=3)), to_numpy(arrays(4.0, -2.0, steps=8)), 0.5)
    np.testing.assert_array_equal(moved["w"], [2.0, 0.0])
    assert moved["w"].dtype == np.float32 and int(moved["num_batches_tracked"]) == 8
    with pytest.raises(ValueError, match="share"):
        move(to_numpy(arrays(0.0)), to_numpy(arrays(1.0)), 0.0)


def test_update_vector_and_scale_cover_floating_point_arrays_only():
    assert update_vector(to_numpy(arrays(0.0, 0.0)), to_numpy(arrays(3.0, 4.0, steps=100))).tolist() == [3.0, 4.0]
    assert update_vector(None, to_numpy(arrays(3.0, 4.0, steps=100))).tolist() == [3.0, 4.0]
    scaled = scale(to_numpy(arrays(3.0, 4.0, steps=7)), 0.5)
    np.testing.assert_array_equal(scaled["w"], [1.5, 2.0])
    assert int(scaled["num_batches_tracked"]) == 7


# ------------------------------------------------------------------ ReplyGuard


def test_a_long_reply_is_scaled_to_the_bound_and_recorded():
    guard = ReplyGuard("FedAvg", update_clip=4.0, weight_clip=4.0)
    guard.begin_round(1)
    sent = arrays(1.0, 1.0)
    honest = [reply(node, sent, arrays(1.0 + node / 10, 1.0)) for node in (1, 2, 3)]  # lengths 0.1, 0.2, 0.3
    long = reply(4, sent, arrays(4.0, 5.0))  # length 5
    bounded = guard.bound([*honest, long])
    # Reference: the lower median of (0.1, 0.2, 0.3, 5) = 0.2; bound 4 × 0.2 = 0.8.
    assert [b.arrays for b in bounded[:3]] == [h.arrays for h in honest]  # untouched: the same objects
    update = to_numpy(bounded[3].arrays)["w"] - 1.0
    assert float(np.linalg.norm(update)) == pytest.approx(0.8, rel=1e-5)
    np.testing.assert_allclose(update, [0.8 * 3 / 5, 0.8 * 4 / 5], rtol=1e-5)  # in the direction the reply went
    (event,) = guard.round_record()["clipped"]
    assert (event["node"], event["stream"]) == (4, "model")
    assert event["bound"] == pytest.approx(0.8) and event["factor"] == pytest.approx(0.8 / bounded[3].length)
    assert guard.round_record()["streams"]["model"]["max_length_ratio"] == pytest.approx(25.0)


def test_a_reply_times_a_million_is_rejected_and_kept_out_of_the_references():
    rejected = []
    guard = ReplyGuard("FedAvg", update_clip=4.0, weight_clip=4.0, on_reject=lambda r, why: rejected.append((r, why)))
    guard.begin_round(1)
    sent = arrays(1.0, 1.0)
    honest = [reply(node, sent, arrays(1.0 + node / 10, 1.0)) for node in (1, 2, 3)]
    poisoned = reply(4, sent, arrays(1e6, 1e6), examples=10**6)
    bounded = guard.bound([*honest, poisoned])
    assert [b.node_id for b in bounded] == [1, 2, 3]
    ((reply_out, why),) = rejected
    assert reply_out is poisoned and "beyond 25 bounds, not an update" in why and "stream 'model'" in why
    assert "clipped" not in guard.round_record()
    # Its length did not join the reference: a later round measures against (0.1, 0.2, 0.3, 0.4),
    # not (0.1, 0.2, 0.3, 1.4e6, 0.4), whose lower median would be 0.3.
    (later,) = guard.bound([reply(5, sent, arrays(1.4, 1.0))])
    assert later.reference == pytest.approx(0.2)
    # The strategy's callback takes the reply out of the very list it passed (its hop's
    # replies): the others are bounded all the same, each against its own origin.
    listed = [poisoned, *honest]
    guard.on_reject = lambda r, why: listed.remove(r)
    assert [(b.node_id, b.share) for b in guard.bound(listed)] == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert listed == honest
    # Without a callback the guard logs it and leaves it out all the same.
    alone = ReplyGuard("FedAvg", update_clip=4.0)
    assert [b.node_id for b in alone.bound([*honest, poisoned])] == [1, 2, 3]


def test_the_first_reply_of_a_run_with_the_rest_of_its_hop_lost_is_measured_against_its_model():
    # FedCat's first hop, K = 2, one reply lost: the other has no length but its own to be measured against.
    rejected = []
    guard = ReplyGuard("FedCat", update_clip=4.0, weight_clip=4.0, on_reject=lambda r, why: rejected.append(why))
    guard.begin_round(1)
    sent = arrays(3.0, 4.0)  # norm 5: rejected beyond 25 × 4 × 5 = 500
    assert guard.bound([reply(1, sent, arrays(3e6, 4e6))]) == []
    assert "no other to measure it against" in rejected[0] and "not an update" in rejected[0]
    # An honest lone first reply is taken as sent, and its length is the stream's first.
    (honest,) = guard.bound([reply(2, sent, arrays(3.5, 4.0))])
    assert (honest.share, honest.reference) == (1.0, pytest.approx(0.5))
    # Later hops that only measure (a chain's) against an empty window are alone too.
    fresh = ReplyGuard("FedSeq", update_clip=4.0, weight_clip=0.0)
    later = fresh.bound([reply(1, sent, arrays(3e6, 4e6)), reply(2, sent, arrays(3.5, 4.0))], joins=False)
    assert [b.node_id for b in later] == [2]
    # The bound off: nothing is rejected.
    assert len(ReplyGuard("FedCat", update_clip=0.0, weight_clip=0.0).bound([reply(1, sent, arrays(3e6, 4e6))])) == 1


def test_a_reply_of_a_trillion_examples_gets_the_bounded_weight():
    guard = ReplyGuard("FedAvg", update_clip=4.0, weight_clip=4.0)
    guard.begin_round(1)
    sent = arrays(0.0)
    replies = [reply(1, sent, arrays(0.1), 100), reply(2, sent, arrays(0.1), 120), reply(3, sent, arrays(0.1), 10**12)]
    bounded = guard.bound(replies)
    # Reference weight: the lower median of (100, 120, 10¹²) = 120; bound 4 × 120 = 480.
    assert [b.num_examples for b in bounded] == [100, 120, 480]
    assert bounded[2].content["metrics"]["num-examples"] == 480  # what the metrics aggregation weighs
    assert guard.round_record()["down-weighted"] == [
        {"node": 3, "tag": None, "stream": "model", "factor": pytest.approx(480 / 10**12), "reported": 10**12, "weight": 480}
    ]


def test_a_down_weighted_reply_joins_the_weight_reference_with_its_bounded_weight():
    # FedCat, K = 2: round 1's copies come back with 108 and 10¹² examples; round 2's hop has one
    # reply, of 10¹² examples again. Had round 1's report joined as sent, the lower median of
    # (108, 10¹², 10¹²) would take it as it is.
    guard = ReplyGuard("FedCat", update_clip=4.0, weight_clip=4.0)
    sent = arrays(0.0)
    assert [b.num_examples for b in guard.bound([reply(1, sent, arrays(0.1), 108), reply(2, sent, arrays(0.1), 10**12)])] == [108, 432]
    (lone,) = guard.bound([reply(3, sent, arrays(0.1), 10**12)], joins=False)
    assert lone.num_examples == 4 * 432  # the lower median of (108, 432, 10¹²) is 432


def test_a_report_that_jumps_counts_as_its_nodes_previous_one_and_a_consistent_one_is_capped():
    guard = ReplyGuard("FedConcat")
    sent = arrays(0.0)

    def weights(*examples: int) -> list[tuple[int, int]]:
        replies = [reply(node, sent, arrays(0.1), n) for node, n in enumerate(examples, start=1)]
        return [(b.node_id, b.num_examples) for b in guard.bound(replies)]

    # A large first report is capped (4 × the lower median 120): a large client and a liar look alike.
    assert weights(100, 120, 2000) == [(1, 100), (2, 120), (3, 480)]
    # Node 1 jumps from 100 to 10¹²: beyond 4 × max(100, 120), it counts as its 100; node 3 keeps
    # its 2000: capped. Both replies are taken (their updates are not in doubt).
    guard.begin_round(2)
    assert weights(10**12, 120, 2000) == [(1, 100), (2, 120), (3, 480)]
    (jump, _) = guard.round_record()["down-weighted"]
    assert jump == {"node": 1, "tag": None, "stream": "model", "factor": pytest.approx(1e-10), "reported": 10**12,
                    "weight": 100, "previous": 100}
    # Its next report is measured against the one it made: the same again is capped.
    assert weights(10**12, 120, 2000) == [(1, 480), (2, 120), (3, 480)]


def test_with_both_clips_off_every_reply_is_taken_as_it_is():
    guard = ReplyGuard("FedAvg", update_clip=0.0, weight_clip=0.0)
    guard.begin_round(1)
    sent = arrays(0.0)
    replies = [reply(1, sent, arrays(0.1), 10), reply(2, sent, arrays(1e6), 10**12)]
    bounded = guard.bound(replies)
    assert [b.arrays for b in bounded] == [r.arrays for r in replies]
    assert [b.num_examples for b in bounded] == [10, 10**12]
    assert set(guard.round_record()) == {"streams"}


def test_replies_that_are_updates_themselves_are_bounded_from_zero():
    guard = ReplyGuard("Scaffold", update_clip=2.0, weight_clip=0.0)
    deltas = [reply(n, arrays(5.0), arrays(length)) for n, length in ((1, 1.0), (2, 1.0), (3, 40.0))]
    bounded = guard.bound(deltas, stream="model-delta", from_zero=True)
    assert [float(to_numpy(b.arrays)["w"][0]) for b in bounded] == pytest.approx([1.0, 1.0, 2.0])


def test_streams_keep_references_of_their_own_across_rounds():
    guard = ReplyGuard("FedConcat", update_clip=2.0, weight_clip=0.0)
    sent = arrays(0.0)
    guard.bound([reply(1, sent, arrays(1.0)), reply(2, sent, arrays(1.0))])  # "model": lengths 1
    guard.bound([reply(1, sent, arrays(100.0)), reply(2, sent, arrays(100.0))], stream="head")
    # A later round: the head's reference is 100 (not clipped), the model's window gives 1.
    (head,) = guard.bound([reply(3, sent, arrays(30.0))], stream="head")
    (model,) = guard.bound([reply(3, sent, arrays(30.0))])
    assert head.share == 1.0 and model.share == pytest.approx(2.0 / 30.0)


def test_a_stream_with_one_length_is_measured_against_the_others_too():
    assert stream_reference([5.0, 1e6], [1.0, 2.0]) == 5.0  # two of its own: the others do not count
    assert stream_reference([1e6], [1.0, 2.0, 3.0]) == 2.0  # alone: the lower median of (1, 2, 3, 10⁶)
    assert stream_reference([1e6], []) == 1e6  # the run's very first reply: nothing to measure against
    assert stream_reference([], [2.0]) == 2.0


def test_the_first_reply_of_a_cluster_of_one_cannot_pass_unbounded():
    # FedConcat: cluster 1 has one member, whose earlier replies were all rejected; its first
    # reply that arrives is 25 times too long. Its own length alone would be its reference.
    guard = ReplyGuard("FedConcat", update_clip=4.0, weight_clip=0.0)
    sent = arrays(0.0)
    clusters = ["cluster-0", "cluster-1"]
    guard.bound([reply(1, sent, arrays(1.0)), reply(2, sent, arrays(2.0))], stream="cluster-0", peers=clusters)
    (lone,) = guard.bound([reply(3, sent, arrays(50.0))], stream="cluster-1", peers=clusters)
    assert lone.reference == 2.0 and lone.share == pytest.approx(8.0 / 50.0)
    (second,) = guard.bound([reply(3, sent, arrays(3.0))], stream="cluster-1", peers=clusters)
    assert second.reference == 3.0  # (50, 3) of its own now: the lower median
    # × 10⁶ alone in its cluster: measured against the peers, and rejected.
    guard.bound([reply(5, sent, arrays(1.0)), reply(6, sent, arrays(2.0))], stream="cluster-0", peers=clusters)
    assert guard.bound([reply(7, sent, arrays(1e6))], stream="cluster-2", peers=[*clusters, "cluster-2"]) == []
    # A stream without peers is measured against its own lengths only (SCAFFOLD's Δc and Δy
    # differ in scale): a lone first length passes (its model, all zeros, gives `outsized_alone`
    # no scale either).
    (alone,) = guard.bound([reply(4, sent, arrays(50.0))], stream="control-delta")
    assert alone.reference == 50.0 and alone.share == 1.0


def test_a_node_bounded_or_rejected_in_several_rounds_is_named_once(caplog):
    guard = ReplyGuard("FedAvg", update_clip=2.0, weight_clip=0.0)
    sent = arrays(0.0)
    with caplog.at_level(logging.WARNING):
        for server_round in range(1, WARN_AFTER_ROUNDS + 2):
            guard.begin_round(server_round)
            if server_round == 2:  # a rejected reply counts too
                guard.note_rejected([Miss(Request(9, train_content(sent, {})), "rejected: non-finite values")])
            else:
                guard.bound([reply(1, sent, arrays(1.0)), reply(2, sent, arrays(1.0)), reply(9, sent, arrays(50.0))])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "node 9" in warnings[0] and "[1, 2, 3]" in warnings[0]
    # Absences are not counted against a node.
    guard.note_rejected([Miss(Request(7, train_content(sent, {})), "no reply before the round timeout")])
    assert "7" not in guard.state_dict()["node_rounds"]


def test_guard_state_round_trip():
    guard = ReplyGuard("FedAvg")
    guard.begin_round(1)
    sent = arrays(0.0)
    guard.bound([reply(1, sent, arrays(1.0), 10), reply(2, sent, arrays(3.0), 20)])
    restored = ReplyGuard("FedAvg")
    restored.load_state_dict(guard.state_dict())
    saved, again = guard.state_dict(), restored.state_dict()
    assert saved.pop("witnesses") == again.pop("witnesses") == [
        ["model", 1, np.float16([1.0]), np.float16([1.0])], ["model", 2, np.float16([1.0]), np.float16([1.0])]
    ] and saved == again
    for each in (guard, restored):
        (bounded,) = each.bound([reply(3, sent, arrays(100.0), 10**6)])
        # Reference: the lower median of the window (1, 3) and the new 100 = 3: bound 12, weight 4 × 20.
        assert (bounded.share, bounded.num_examples) == (pytest.approx(0.12), 80)


def test_a_reversed_update_is_rejected_and_its_node_is_believed_again_from_its_next():
    rejected = []
    guard = ReplyGuard("FedSeq", on_reject=lambda r, why: rejected.append((r.node_id, why)))
    guard.begin_round(1)
    sent = arrays(1.0, 1.0)
    honest, reversed_ = arrays(1.2, 1.1), arrays(0.8, 0.9)  # updates (0.2, 0.1) and (−0.2, −0.1)
    rounds = [guard.bound([reply(1, sent, returned)]) for returned in (honest, reversed_, honest, honest)]
    assert [len(taken) for taken in rounds] == [1, 0, 1, 1]
    ((node, why),) = rejected
    assert node == 1 and "update reversed against its node's own earlier ones in stream 'model'" in why
    assert "cosine -1.00 with its last update taken" in why
    # A node whose first update was reversed (taken: nothing to measure it against) loses its
    # first honest update (against both witnesses), and is believed from its second (its last seen).
    rejected.clear()
    rounds = [guard.bound([reply(2, sent, returned)]) for returned in (reversed_, honest, honest, reversed_)]
    assert [len(taken) for taken in rounds] == [1, 0, 1, 0] and [node for node, _ in rejected] == [2, 2]
    # The price of the second witness: a node that reverses twice in a row is believed the
    # second time (it agrees with its last seen), and so loses its next honest one too.
    rejected.clear()
    rounds = [guard.bound([reply(3, sent, returned)]) for returned in (honest, reversed_, reversed_, honest, honest)]
    assert [len(taken) for taken in rounds] == [1, 0, 1, 0, 1] and [node for node, _ in rejected] == [3, 3]
    # Streams keep their own witnesses, and the check can be turned off.
    assert guard.bound([reply(1, sent, reversed_)], stream="head") != []
    assert not ReplyGuard("FedSeq", history_check=False).history_check
    assert not ReplyGuard("FedSeq", update_clip=0.0).history_check  # the bounds off: every reply as it is


def test_later_hops_are_clipped_against_their_own_recent_lengths():
    guard = ReplyGuard("FedSeq", update_clip=4.0, weight_clip=0.0)
    guard.begin_round(1)
    sent = arrays(1.0, 1.0)
    firsts = guard.bound([reply(node, sent, arrays(1.1, 1.0)) for node in (1, 2, 3)])  # updates (0.1, 0): r = 0.1
    assert [b.share for b in firsts] == [1.0, 1.0, 1.0]
    # Later hops 6-8 r long (they start from a model fitted to other classes) are not clipped:
    # measured against their own lower median, 0.7 (bound 2.8). The hop clip still takes 1.5 r.
    starts = [arrays(1.1, 1.0), arrays(1.2, 1.0), arrays(1.3, 1.0)]
    hops = zip((1, 2, 3), starts, (1.1, 1.2, 1.3), (0.6, 0.7, 0.8))
    laters = guard.bound([reply(n, start, arrays(x + d, 1.0)) for n, start, x, d in hops], joins=False, hop_clip=1.5)
    assert [b.reference for b in laters] == pytest.approx([0.1] * 3)  # what the hop clip and the record use
    assert [b.share for b in laters] == pytest.approx([0.15 / 0.6, 0.15 / 0.7, 0.15 / 0.8])
    assert "clipped" not in guard.round_record()
    # One 5.7 times the later hops' lower median is clipped against it, in its own stream; the
    # first hops' reference is still 0.1.
    (long_,) = guard.bound([reply(4, starts[0], arrays(5.1, 1.0))], joins=False)
    assert long_.share == pytest.approx(4 * 0.7 / 4.0) and long_.reference == pytest.approx(0.1)
    assert guard.round_record()["clipped"] == [
        {"node": 4, "tag": None, "stream": "model/later", "factor": pytest.approx(0.7), "length": pytest.approx(4.0),
         "bound": pytest.approx(2.8)}
    ]
    (first,) = guard.bound([reply(5, sent, arrays(1.35, 1.0))])  # a first hop of 3.5 r: within the bound
    assert first.share == 1.0


@pytest.mark.parametrize("clip", [-1.0, 0.5])
def test_a_clip_below_one_is_refused(clip):
    with pytest.raises(ValueError, match="0 \\(off\\) or >= 1"):
        ReplyGuard("FedAvg", update_clip=clip)


# ------------------------------------------------------------------ label distributions


@pytest.mark.parametrize(
    ("values", "epsilon", "problem"),
    [
        ([0.5, 0.5, 0.0], 0.0, None),
        ([0.5, 0.5], 0.0, "must be a list of 3 numbers"),
        ("0.5", 0.0, "must be a list of 3 numbers"),
        ([0.5, float("nan"), 0.5], 0.0, "must be finite"),
        ([1.5, -0.5, 0.0], 0.0, "has a negative entry"),
        ([500.0, 500.0, 0.0], 0.0, "sums to 1000"),
        ([1.5, -0.5, 0.4], 1.0, None),  # Laplace noise: negative entries and any sum are honest
        ([1e6, 0.0, 0.0], 1.0, "strays beyond"),
    ],
)
def test_distribution_problem(values, epsilon, problem):
    found = distribution_problem(values, 3, epsilon)
    assert found == problem if problem is None else problem in found


# ------------------------------------------------------------------ aggregations


def three(values: list[list[float]]) -> list[dict[str, np.ndarray]]:
    return [to_numpy(arrays(*v)) for v in values]


def test_median_and_trimmed_mean_by_hand():
    models = three([[0.0, 10.0], [1.0, 20.0], [2.0, 30.0], [100.0, -1000.0], [3.0, 40.0]])
    median = to_numpy(Aggregation("median").combine(models, [1.0] * 5))
    np.testing.assert_array_equal(median["w"], [2.0, 20.0])
    # β = 0.2 of five values cuts one at each end: mean of (1, 2, 3) and (10, 20, 30).
    trimmed = to_numpy(Aggregation("trimmed-mean", trim=0.2).combine(models, [1.0] * 5))
    np.testing.assert_allclose(trimmed["w"], [2.0, 20.0])


def test_mean_is_the_weighted_average():
    mean = to_numpy(Aggregation().combine(three([[0.0], [3.0]]), [2.0, 1.0]))
    np.testing.assert_allclose(mean["w"], [1.0])


def test_krum_picks_the_model_closest_to_its_neighbours_and_multi_krum_averages_the_best():
    # n = 5, f = 1: each model's score sums the squared distances to its n − f − 2 = 2 nearest:
    # 0.05, 0.02, 0.05, 0.13 and (far) the outlier's.
    models = three([[0.0], [0.1], [0.2], [0.4], [50.0]])
    krum = to_numpy(Aggregation("krum", byzantine=1).combine(models, [1.0] * 5))
    np.testing.assert_allclose(krum["w"], [0.1])
    multi = to_numpy(Aggregation("multi-krum", byzantine=1).combine(models, [1.0, 1.0, 2.0, 1.0, 1.0]))
    np.testing.assert_allclose(multi["w"], [(0.0 + 0.1 + 2 * 0.2 + 0.4) / 5], rtol=1e-6)  # the outlier left out


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"method": "mode"}, "aggregation must be one of"), ({"method": "trimmed-mean", "trim": 0.5}, "trim"),
     ({"method": "krum", "byzantine": -1}, "byzantine")],
)
def test_bad_aggregations_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Aggregation(**kwargs)
