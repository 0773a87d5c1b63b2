"""The sequential strategies' guard: bounded hop steps, the divergence record and its warning."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, MetricRecord

from concatfl.core.sequential import (
    REFERENCE_HOPS,
    STALL_AGGREGATIONS,
    damp,
    diverged,
    divergence,
    hop_step_size,
    reference_length,
    update_norm,
)
from concatfl.strategies.sequential import ChainGuard, to_numpy, to_record


def model(weight: list[float], bias: float = 0.0, steps: int = 0) -> dict[str, np.ndarray]:
    return {
        "w": np.asarray(weight, dtype=np.float32),
        "b": np.asarray([bias], dtype=np.float32),
        "num_batches_tracked": np.asarray(steps, dtype=np.int64),
    }


# ------------------------------------------------------------------ pure rules


def test_a_half_step_moves_a_copy_half_way_and_counters_take_the_reply():
    damped = damp(model([0.0, 2.0], 1.0, steps=3), model([4.0, -2.0], 3.0, steps=8), 0.5)
    np.testing.assert_array_equal(damped["w"], np.asarray([2.0, 0.0], dtype=np.float32))
    np.testing.assert_array_equal(damped["b"], np.asarray([2.0], dtype=np.float32))
    assert damped["w"].dtype == np.float32
    assert int(damped["num_batches_tracked"]) == 8


def test_a_full_step_is_the_reply_itself():
    returned = model([4.0, -2.0], 3.0)
    damped = damp(model([0.0, 2.0]), returned, 1.0)
    for key, value in returned.items():
        np.testing.assert_array_equal(damped[key], value)


@pytest.mark.parametrize("step", [0.0, -0.5, 1.5])
def test_a_step_outside_0_1_is_refused(step):
    with pytest.raises(ValueError, match="hop step"):
        damp(model([0.0]), model([1.0]), step)


def test_update_norm_counts_floating_point_arrays_only():
    # ‖(3, 4, 0)‖ = 5; the integer counter is not a weight.
    assert update_norm(model([0.0, 0.0], 0.0, steps=0), model([3.0, 4.0], 0.0, steps=100)) == 5.0


def test_reference_is_the_median_of_first_hop_lengths():
    assert reference_length([]) is None
    assert reference_length([1.0, 9.0, 2.0]) == 2.0
    assert reference_length([1.0, 2.0, 3.0, 10.0]) == 2.5


@pytest.mark.parametrize(
    ("length", "reference", "hop_step", "hop_clip", "expected"),
    [
        (1.0, 1.0, 1.0, 1.5, 1.0),  # no longer than a first hop: taken whole
        (1.5, 1.0, 1.0, 1.5, 1.0),  # exactly at the bound
        (3.0, 1.0, 1.0, 1.5, 0.5),  # twice the bound: half the update
        (6.0, 2.0, 1.0, 1.0, 1 / 3),  # bound c·r = 2 of a length-6 hop
        (3.0, 1.0, 0.25, 1.5, 0.25),  # η is the largest step
        (3.0, 1.0, 0.8, 0.0, 0.8),  # c = 0: no bound
        (3.0, None, 1.0, 1.5, 1.0),  # no reference yet
        (0.0, 1.0, 1.0, 1.5, 1.0),  # the hop did not move the model
    ],
)
def test_hop_step_size(length, reference, hop_step, hop_clip, expected):
    assert hop_step_size(length, reference, hop_step, hop_clip) == pytest.approx(expected)


def test_divergence_of_copies_that_moved_in_opposite_directions():
    start = model([0.0, 0.0])
    # Both moved 2 away from the start, in opposite directions: their average is the start,
    # each is 2 from it, so the spread equals the update (ratio 1).
    signal = divergence(start, [model([2.0, 0.0]), model([-2.0, 0.0])], [1.0, 1.0])
    assert (signal.update, signal.spread, signal.ratio) == pytest.approx((2.0, 2.0, 1.0))


def test_divergence_weights_the_average():
    start = model([0.0])
    # Weighted average 0.75·4 + 0.25·0 = 3: spreads 1 and 3, mean 2; updates 4 and 0, mean 2.
    signal = divergence(start, [model([4.0]), model([0.0])], [3.0, 1.0])
    assert (signal.update, signal.spread, signal.ratio) == pytest.approx((2.0, 2.0, 1.0))


def test_copies_that_moved_alike_do_not_diverge():
    signal = divergence(model([0.0]), [model([1.0]), model([1.0])], [1.0, 5.0])
    assert (signal.spread, signal.ratio) == (0.0, 0.0)


def test_diverged_names_a_stalled_average_and_an_average_worse_than_its_parts():
    assert diverged(5, 0.1, None, []) is None  # nothing evaluated: no verdict
    # Stalled: under 1.5x the start model's 0.1 from the third aggregation on, not before.
    assert diverged(STALL_AGGREGATIONS - 1, 0.1, 0.12, [0.12]) is None
    assert "after 3 aggregations" in diverged(STALL_AGGREGATIONS, 0.1, 0.12, [0.12])
    assert diverged(STALL_AGGREGATIONS, 0.1, 0.16, [0.16]) is None
    assert diverged(STALL_AGGREGATIONS, None, 0.12, [0.12]) is None  # start model not evaluated
    # The average is more than 0.15 below the mean of its parts, at any aggregation.
    assert "0.100" in diverged(1, 0.1, 0.1, [0.4, 0.5])
    assert diverged(1, 0.1, 0.4, [0.45, 0.5]) is None


# ------------------------------------------------------------------ ChainGuard


def record(weight: list[float]) -> ArrayRecord:
    return to_record(model(weight))


def test_guard_bounds_later_hops_by_the_first_hops():
    guard = ChainGuard("FedCat", hop_step=1.0, hop_clip=1.5, keys=("fedcat-hop-step", "fedcat-hop-clip"))
    start = record([0.0, 0.0])
    # Two first hops of lengths 1 and 3: reference (median) 2, bound 1.5·2 = 3.
    first = guard.step(start, record([1.0, 0.0]), first_hop=True)
    guard.step(start, record([0.0, 3.0]), first_hop=True)
    np.testing.assert_array_equal(to_numpy(first)["w"], [1.0, 0.0])  # first hops are never bounded
    # A later hop of length 12 is scaled to length 3 (a quarter of its update).
    later = guard.step(first, record([1.0, 12.0]), first_hop=False)
    np.testing.assert_allclose(to_numpy(later)["w"], [1.0, 3.0])
    # A later hop within the bound is the reply itself (the same object).
    reply = record([1.0, 2.0])
    assert guard.step(first, reply, first_hop=False) is reply


def test_guard_without_bound_takes_every_reply_as_it_is():
    guard = ChainGuard("FedSeq", hop_step=1.0, hop_clip=0.0, keys=("fedseq-hop-step", "fedseq-hop-clip"))
    start = record([0.0])
    guard.step(start, record([1.0]), first_hop=True)
    reply = record([100.0])
    assert guard.step(start, reply, first_hop=False) is reply


def test_guard_keeps_the_last_first_hops_as_reference():
    guard = ChainGuard("FedCat", 1.0, 1.0, ("a", "b"))
    start = record([0.0])
    for length in [100.0] * 3 + [1.0] * REFERENCE_HOPS:  # the early long hops fall out of the window
        guard.step(start, record([length]), first_hop=True)
    later = guard.step(start, record([10.0]), first_hop=False)
    np.testing.assert_allclose(to_numpy(later)["w"], [1.0])


def test_guard_check_records_divergence_and_warns_once(caplog):
    guard = ChainGuard("FedCat", 1.0, 0.0, ("fedcat-hop-step", "fedcat-hop-clip"))
    start = record([0.0, 0.0])
    guard.step(start, record([1.0, 0.0]), first_hop=True)
    guard.step(record([1.0, 0.0]), record([1.0, 4.0]), first_hop=False)  # 4× a first hop
    scores = {1.0: 0.5, -1.0: 0.5, 0.0: 0.1}  # w[0] → accuracy: both copies 0.5, their average 0.1
    evaluated = []

    def evaluate(arrays: ArrayRecord) -> MetricRecord:
        evaluated.append(float(to_numpy(arrays)["w"][0]))
        return MetricRecord({"accuracy": scores[evaluated[-1]]})

    copies = [record([1.0, 0.0]), record([-1.0, 0.0])]
    with caplog.at_level(logging.WARNING):
        first = guard.check(start, copies, [1.0, 1.0], record([0.0, 0.0]), evaluate)
        second = guard.check(start, copies, [1.0, 1.0], record([0.0, 0.0]), evaluate)
    assert first == {
        "update": 1.0,
        "spread": 1.0,
        "ratio": 1.0,
        "hop_length_ratio": 4.0,
        "hop_steps": {"min": 1.0, "mean": 1.0},
        "part_accuracy": [0.5, 0.5],
        "average_accuracy": 0.1,
        "diverged": True,
    }
    # The start model once, then the two copies and the average at each check.
    assert evaluated == [0.0, 1.0, -1.0, 0.0, 1.0, -1.0, 0.0]
    # The hops were counted once: the second check sees none, but the average is still worse.
    assert "hop_length_ratio" not in second and second["diverged"] is True
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "FedCat" in warnings[0] and "fedcat-hop-clip" in warnings[0] and "0.100" in warnings[0]


def test_guard_warns_when_the_average_stalls_near_the_start_model(caplog):
    guard = ChainGuard("FedSeq", 1.0, 1.5, ("fedseq-hop-step", "fedseq-hop-clip"))
    start, chain = record([0.0]), record([1.0])

    def evaluate(arrays: ArrayRecord) -> MetricRecord:  # the start model 0.1, the chain's 0.12
        return MetricRecord({"accuracy": 0.1 if float(to_numpy(arrays)["w"][0]) == 0.0 else 0.12})

    with caplog.at_level(logging.WARNING):
        verdicts = [guard.check(start, [chain], [1.0], chain, evaluate)["diverged"] for _ in range(4)]
    assert verdicts == [False, False, True, True]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "after 3 aggregations" in warnings[0] and "fedseq-hop-step" in warnings[0]


def test_guard_state_round_trip_bounds_the_next_hop_identically():
    guard = ChainGuard("FedSeq", 0.9, 1.5, ("a", "b"))
    start = record([0.0])
    guard.step(start, record([2.0]), first_hop=True)
    restored = ChainGuard("FedSeq", 0.9, 1.5, ("a", "b"))
    restored.load_state_dict(guard.state_dict())
    for each in (guard, restored):
        np.testing.assert_allclose(to_numpy(each.step(start, record([30.0]), first_hop=False))["w"], [3.0])
    assert guard.state_dict() == restored.state_dict()


@pytest.mark.parametrize(("hop_step", "hop_clip"), [(0.0, 1.0), (1.2, 1.0), (1.0, -1.0)])
def test_guard_refuses_bad_parameters(hop_step, hop_clip):
    with pytest.raises(ValueError, match="hop_"):
        ChainGuard("FedCat", hop_step, hop_clip, ("a", "b"))
