"""The sequential strategies' guard: bounded hop steps, the divergence record and its warning."""

from __future__ import annotations

import math

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from concatfl.core.bounds import REFERENCE_WINDOW
from concatfl.core.sequential import (
    STALL_AGGREGATIONS,
    adapt_step,
    chain_step,
    averaged_too_rarely,
    chance_level,
    check_affordable,
    diverged,
    divergence,
    even_share,
    fedavg_as_low,
    parts_due,
    running_mean_share,
    scored_parts,
    relative_hop,
    sized_step,
    witness_due,
    witness_lost,
    witness_warns,
)
from concatfl.strategies.common import Reply, Request, to_numpy, to_record, train_content
from concatfl.strategies.guard import ReplyGuard
from concatfl.strategies.sequential import ChainGuard, CheckBudget, FirstHopWitness


def model(weight: list[float], bias: float = 0.0, steps: int = 0) -> dict[str, np.ndarray]:
    return {
        "w": np.asarray(weight, dtype=np.float32),
        "b": np.asarray([bias], dtype=np.float32),
        "num_batches_tracked": np.asarray(steps, dtype=np.int64),
    }


# ------------------------------------------------------------------ pure rules


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
    # Stalled: under 1.5x chance from the fifth aggregation on, not before.
    assert diverged(STALL_AGGREGATIONS - 1, 0.1, 0.12, [0.12]) is None
    assert "after 5 aggregations" in diverged(STALL_AGGREGATIONS, 0.1, 0.12, [0.12])
    assert diverged(STALL_AGGREGATIONS, 0.1, 0.16, [0.16]) is None
    # The run's last aggregation, however early it comes (FedCat with K = N over 2K rounds): under 2x.
    assert diverged(1, 0.1, 0.19, [0.19]) is None and "after 1 aggregation the" in diverged(1, 0.1, 0.19, [0.19], last=True)
    assert diverged(2, 0.1, 0.21, [0.21], last=True) is None
    assert diverged(STALL_AGGREGATIONS, None, 0.12, [0.12]) is None  # no chance level: a trained start, or none evaluated
    # The average is more than 0.15 below the mean of its parts, at any aggregation.
    assert "0.100" in diverged(1, 0.1, 0.1, [0.4, 0.5])
    assert diverged(1, 0.1, 0.4, [0.45, 0.5]) is None


# ------------------------------------------------------------------ ChainGuard


def record(weight: list[float]) -> ArrayRecord:
    return to_record(model(weight))


def chain_guard(hop_step: float, hop_clip: float, update_clip: float = 0.0, name: str = "FedCat") -> ChainGuard:
    keys = ("fedcat-hop-step", "fedcat-hop-clip") if name == "FedCat" else ("fedseq-hop-step", "fedseq-hop-clip")
    guard = ChainGuard(name, ReplyGuard(name, update_clip, 0.0), hop_step, hop_clip, keys)
    guard.budget.clock = lambda: 0.0  # a frozen clock: every check is free, so the schedule alone decides
    return guard


def hop(sent: ArrayRecord, returned: ArrayRecord, examples: int = 10, node: int = 1) -> Reply:
    """A reply of `node` that returned `returned` for `sent`."""
    request = Request(node, train_content(sent, {}))
    return Reply(request, RecordDict({"arrays": returned, "metrics": MetricRecord({"num-examples": examples})}), examples)


def fold(guard: ChainGuard, sent: ArrayRecord, returned: ArrayRecord, first_hop: bool) -> ArrayRecord:
    return guard.fold([hop(sent, returned)], first_hop)[0].arrays


def test_guard_bounds_later_hops_by_the_first_hops():
    guard = chain_guard(hop_step=1.0, hop_clip=1.5)
    start = record([0.0, 0.0])
    # Two first hops of lengths 1 and 3: reference (lower median) 1, bound 1.5·1 = 1.5.
    first, _ = guard.fold([hop(start, record([1.0, 0.0])), hop(start, record([0.0, 3.0]), node=2)], first_hop=True)
    np.testing.assert_array_equal(to_numpy(first.arrays)["w"], [1.0, 0.0])  # the hop clip spares first hops
    # A later hop of length 12 is scaled to length 1.5 (an eighth of its update).
    np.testing.assert_allclose(to_numpy(fold(guard, first.arrays, record([1.0, 12.0]), False))["w"], [1.0, 1.5])
    # A later hop within the bound is the reply itself (the same object).
    reply = record([1.0, 1.0])
    assert fold(guard, first.arrays, reply, False) is reply


def test_the_update_clip_bounds_first_hops_too():
    guard = chain_guard(hop_step=1.0, hop_clip=0.0, update_clip=2.0)
    start = record([0.0])
    replies = [hop(start, record([x]), node=i) for i, x in enumerate([1.0, 1.0, 40.0])]
    folded = guard.fold(replies, first_hop=True)
    # Reference: the lower median of (1, 1, 40) = 1; the hop of length 40 moves the copy 2 at most.
    assert [float(to_numpy(r.arrays)["w"][0]) for r in folded] == pytest.approx([1.0, 1.0, 2.0])
    assert [r.share for r in folded] == pytest.approx([1.0, 1.0, 0.05])


def test_guard_without_bound_takes_every_reply_as_it_is():
    guard = chain_guard(hop_step=1.0, hop_clip=0.0, name="FedSeq")
    start = record([0.0])
    fold(guard, start, record([1.0]), True)
    reply = record([100.0])
    assert fold(guard, start, reply, False) is reply


def test_guard_keeps_the_last_first_hops_as_reference():
    guard = chain_guard(1.0, 1.0)
    start = record([0.0])
    for length in [100.0] * 3 + [1.0] * REFERENCE_WINDOW:  # the early long hops fall out of the window
        fold(guard, start, record([length]), True)
    np.testing.assert_allclose(to_numpy(fold(guard, start, record([10.0]), False))["w"], [1.0])


def test_guard_check_records_divergence_and_warns_once(caplog):
    guard = chain_guard(1.0, 0.0)
    start = record([0.0, 0.0])
    fold(guard, start, record([1.0, 0.0]), True)
    fold(guard, record([1.0, 0.0]), record([1.0, 4.0]), False)  # 4× a first hop
    scores = {1.0: 0.5, -1.0: 0.5, 0.0: 0.1}  # w[0] → accuracy: both copies 0.5, their average 0.1
    evaluated = []

    def evaluate(arrays: ArrayRecord) -> MetricRecord:
        evaluated.append(float(to_numpy(arrays)["w"][0]))
        return MetricRecord({"accuracy": scores[evaluated[-1]]})

    copies = [record([1.0, 0.0]), record([-1.0, 0.0])]
    with caplog.at_level(logging.WARNING):
        first = guard.check(start, [to_numpy(c) for c in copies], [1.0, 1.0], record([0.0, 0.0]), evaluate)
        second = guard.check(start, [to_numpy(c) for c in copies], [1.0, 1.0], record([0.0, 0.0]), evaluate)
    assert first == {
        "update": 1.0,
        "spread": 1.0,
        "ratio": 1.0,
        "hop_length_ratio": 4.0,
        "own_hop_ratio": 4.0,  # the later hop against the same node's first hop
        "hop_steps": {"min": 1.0, "mean": 1.0},
        "part_accuracy": [0.5, 0.5],
        "average_accuracy": 0.1,
        "checks": {"seconds": 0.0, "evaluations": 3, "skipped": 0},
        "diverged": True,
    }
    # The start model once, the average at each check, the copies at the first (`parts_due`).
    assert evaluated == [0.0, 0.0, 1.0, -1.0, 0.0]
    # The hops were counted once; the second check scores no copies, so only a stall could warn.
    assert "hop_length_ratio" not in second and "part_accuracy" not in second and second["diverged"] is False
    later = [guard.check(start, [to_numpy(c) for c in copies], [1.0, 1.0], record([0.0, 0.0]), evaluate) for _ in range(3)]
    assert ["part_accuracy" in check for check in later] == [False, False, True]  # the 5th aggregation
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "FedCat" in warnings[0] and "fedcat-hop-clip" in warnings[0] and "0.100" in warnings[0]
    assert "share of its chain" not in warnings[0]  # FedCat's hops have no share floor


def test_guard_warns_when_the_average_stalls_near_chance(caplog):
    guard = chain_guard(1.0, 1.5, name="FedSeq")
    start, chain = record([0.0]), record([1.0])

    def evaluate(arrays: ArrayRecord) -> MetricRecord:
        # The start model: accuracy 0.08 but loss ln 10, so chance is 0.1; the chain's 0.14.
        if float(to_numpy(arrays)["w"][0]) == 0.0:
            return MetricRecord({"accuracy": 0.08, "loss": math.log(10.0)})
        return MetricRecord({"accuracy": 0.14, "loss": 2.0})

    with caplog.at_level(logging.WARNING):
        verdicts = [guard.check(start, [to_numpy(chain)], [1.0], chain, evaluate)["diverged"] for _ in range(6)]
    assert verdicts == [False, False, False, False, True, True]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "after 5 aggregations" in warnings[0] and "fedseq-hop-step" in warnings[0]
    assert "models diverge" in warnings[0] and "Run FedAvg" not in warnings[0]
    # A run that ends with a single aggregation is judged at it.
    short = chain_guard(1.0, 1.5, name="FedCat")
    assert short.check(start, [to_numpy(chain)], [1.0], chain, evaluate, last=True)["diverged"] is True


def test_a_stall_beside_a_first_hops_round_as_low_asks_for_a_fedavg_run_before_blaming_the_chains(caplog):
    guard = chain_guard(0.25, 1.5, name="FedSeq")
    start, chain = record([0.0]), record([1.0])

    def evaluate(arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({"accuracy": 0.1 if float(to_numpy(arrays)["w"][0]) == 0.0 else 0.12})

    with caplog.at_level(logging.WARNING):
        # The witness's last FedAvg round scored 0.14 (under 1.5x chance) at the fifth aggregation.
        verdicts = [
            guard.check(start, [to_numpy(chain)], [1.0], chain, evaluate, first_hops_accuracy=0.14)["diverged"]
            for _ in range(5)
        ]
    assert verdicts == [False, False, False, False, True]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("FedSeq: the run is not leaving chance: after 5 aggregations the averaged model scores 0.120")
    assert "Run FedAvg with the same settings" in warning and "models diverge" not in warning


def test_an_average_worse_than_its_parts_blames_the_chains_however_low_the_first_hops_round(caplog):
    guard = chain_guard(0.25, 1.5, name="FedSeq")
    start, chain = record([0.0]), record([1.0])

    def evaluate(arrays: ArrayRecord) -> MetricRecord:  # the start and the average 0.1, the chain 0.4
        return MetricRecord({"accuracy": 0.4 if float(to_numpy(arrays)["w"][0]) == 2.0 else 0.1})

    with caplog.at_level(logging.WARNING):
        check = guard.check(start, [model([2.0])], [1.0], chain, evaluate, first_hops_accuracy=0.1)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert check["diverged"] is True and check["part_accuracy"] == [0.4]
    assert warning.startswith("FedSeq: the sequentially trained models diverge: the average scores 0.100 while")


def test_chance_is_the_start_models_accuracy_or_its_loss_level_and_none_for_a_trained_start():
    assert chance_level(0.08, math.log(10.0)) == pytest.approx(0.1)
    assert chance_level(0.12, math.log(10.0)) == 0.12
    assert chance_level(0.08) == 0.08 and chance_level(0.08, float("nan")) == 0.08
    assert chance_level(0.9, 0.3) is None


def test_guard_state_round_trip_bounds_the_next_hop_identically():
    guard = chain_guard(0.9, 1.5, name="FedSeq")
    start = record([0.0])
    fold(guard, start, record([2.0]), True)
    restored = chain_guard(0.9, 1.5, name="FedSeq")
    restored.load_state_dict(guard.state_dict())
    restored.replies.load_state_dict(guard.replies.state_dict())
    for each in (guard, restored):
        np.testing.assert_allclose(to_numpy(fold(each, start, record([30.0]), False))["w"], [3.0])
    assert guard.state_dict() == restored.state_dict()
    assert guard.replies.state_dict() == restored.replies.state_dict()


@pytest.mark.parametrize(("hop_step", "hop_clip"), [(0.0, 1.0), (1.2, 1.0), (1.0, -1.0)])
def test_guard_refuses_bad_parameters(hop_step, hop_clip):
    with pytest.raises(ValueError, match="hop_"):
        ChainGuard("FedCat", ReplyGuard("FedCat"), hop_step, hop_clip, ("a", "b"))


# ------------------------------------------------------------------ the adaptive step


@pytest.mark.parametrize(
    ("step", "hop_ratio", "expected"),
    [
        (0.5, 1.3, 0.5),  # later hops at the target (1.3 first hops): η stays
        (0.5, 2.6, 0.25),  # twice the target: η halves
        (1.0, 2.6, 0.5),
        (0.2, 5.2, 0.125),  # … at least 1/8
        (0.5, 1.0, 0.65),  # shorter: η × 1.3
        (0.9, 0.5, 1.0),  # … at most 1
    ],
)
def test_adapt_step(step, hop_ratio, expected):
    assert adapt_step(step, hop_ratio) == pytest.approx(expected)


def test_the_auto_step_follows_the_later_hops_length_with_or_without_server_data():
    def steps(evaluate) -> list[tuple[float, float]]:
        guard = ChainGuard("FedCat", ReplyGuard("FedCat", 0.0, 0.0), "auto", 0.0, ("a", "b"))
        start, rules = record([0.0]), []
        for later in (2.6, 2.6, 0.5):  # a first hop of length 1, then the same node's later hop of this length
            first = fold(guard, start, record([1.0]), True)
            fold(guard, first, record([float(to_numpy(first)["w"][0]) + later]), False)
            rules.append(guard.check(start, [to_numpy(first)], [1.0], first, evaluate)["hop_rule"])
        return [(r["step"], r["next_step"]) for r in rules]

    def evaluate(arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({"accuracy": 0.5})

    # The ratio is the median over the recent later hops: 2.6, then 2.6, then (2.6, 2.6, 0.5) → 2.6.
    assert steps(None) == steps(evaluate) == [(0.5, 0.25), (0.25, 0.125), (0.125, 0.125)]


def test_the_auto_step_is_the_share_hops_are_given_and_survives_a_restart():
    guard = ChainGuard("FedSeq", ReplyGuard("FedSeq", 0.0, 0.0), "auto", 0.0, ("a", "b"))
    start = record([0.0])
    np.testing.assert_allclose(to_numpy(fold(guard, start, record([1.0]), True))["w"], [0.5])  # η starts at 0.5
    guard.step = 0.3
    restored = ChainGuard("FedSeq", ReplyGuard("FedSeq", 0.0, 0.0), "auto", 0.0, ("a", "b"))
    restored.load_state_dict(guard.state_dict())
    np.testing.assert_allclose(to_numpy(fold(restored, start, record([1.0]), True))["w"], [0.3])


# ------------------------------------------------------------------ the sized step


def test_the_sized_step_takes_hops_whole_when_their_median_is_short_against_the_model():
    def step(lengths: list[float], norm: float, damped: float) -> float:
        return sized_step(relative_hop(lengths, norm), damped)

    assert relative_hop([0.5, 1.0, 9.0], 10.0) == 0.1
    assert step([0.5, 1.0, 9.0], 10.0, 0.25) == 1.0  # median 1: a tenth of the norm
    assert step([1.5], 10.0, 0.25) == 1.0  # 0.15 of it: still short
    assert step([0.1, 2.0, 3.0], 10.0, 0.25) == 0.25  # median 2: long, whatever the shortest
    assert step([2.0], 10.0, 0.4) == 0.4
    assert step([], 10.0, 0.25) == 0.25 and step([0.1], 0.0, 0.25) == 0.25  # nothing to measure


@pytest.mark.parametrize(("later", "next_step"), [(0.2, 1.0), (3.0, 0.25)])
def test_fedseqs_sized_step_is_damped_until_the_first_aggregation_then_sized_by_its_hops(caplog, later, next_step):
    guard = chain_guard("sized", 0.0, name="FedSeq")
    start = record([10.0, 0.0])  # norm 10
    caplog.set_level(logging.INFO)
    first = fold(guard, start, record([11.0, 0.0]), True)  # length 1, taken at the damped 0.25
    np.testing.assert_allclose(to_numpy(first)["w"], [10.25, 0.0])
    last = fold(guard, first, record([10.25, later]), False)
    rule = guard.check(start, [to_numpy(last)], [1.0], last, None)["hop_rule"]
    median = (1.0 + later) / 2
    assert rule == {"step": 0.25, "next_step": next_step, "relative_hop": round(median / 10.0, 4)}
    assert f"moved the model by {median / 10:.3f} of its norm" in caplog.text
    restored = chain_guard("sized", 0.0, name="FedSeq")
    restored.load_state_dict(guard.state_dict())
    for each in (guard, restored):  # sized once: later aggregations keep the step
        np.testing.assert_allclose(to_numpy(fold(each, start, record([12.0, 0.0]), True))["w"], [10.0 + 2 * next_step, 0.0])
        assert "relative_hop" not in each.check(start, [to_numpy(start)], [1.0], start, None).get("hop_rule", {})


def test_the_running_mean_and_even_shares():
    # Running mean: hop j of equal clients takes 1/j, so the chain ends at the mean of its models.
    assert [running_mean_share(10, held) for held in (0, 10, 20, 30)] == [1.0, 0.5, 1 / 3, 0.25]
    assert running_mean_share(30, 10) == 0.75  # by examples, not by hops
    # Even: each hop weighs its client's share of the chain's data (FedAvg's weights), at most 1.
    assert even_share(10, 50) == 0.2 and even_share(30, 60) == 0.5 and even_share(80, 50) == 1.0
    model = lambda values: {"w": np.asarray(values, dtype=np.float64)}  # noqa: E731
    chain = model([0.0])
    for share, trained in ((even_share(10, 20), [4.0]), (even_share(10, 20), [6.0])):
        chain = {"w": chain["w"] + share * (model(trained)["w"] - chain["w"])}
    assert chain["w"].tolist() == [4.0]  # 0 → 2 (half the way to 4), then 2 → 4 (half the way to 6)


def test_a_chain_of_one_hop_is_taken_whole_and_a_hop_counts_at_least_its_share_of_the_chain():
    assert chain_step(0.25, 1, 400, 400) == 1.0 and chain_step(0.25, 1, 390, 400) == 1.0
    assert [chain_step(0.25, 2, 400, 800), chain_step(0.25, 3, 400, 1200)] == [0.5, 400 / 1200]
    assert chain_step(0.25, 5, 160, 800) == 0.25  # five equal clients: 0.2 < η
    # One client of 747 images beside one of 4,018: the large one weighs its share, the small one η.
    assert [chain_step(0.25, 2, 747, 4765), chain_step(0.25, 2, 4018, 4765)] == [0.25, 4018 / 4765]
    assert chain_step(1.0, 2, 10, 20) == 1.0  # the paper's undamped hops stay undamped


def test_the_witness_compares_at_the_first_three_aggregations_then_every_fifth_and_at_the_last():
    assert [aggregation for aggregation in range(1, 21) if witness_due(aggregation)] == [1, 2, 3, 5, 10, 15, 20]
    assert [aggregation for aggregation in range(1, 13) if witness_due(aggregation, last=aggregation == 12)] == [
        1, 2, 3, 5, 10, 12,
    ]


def test_losses_to_the_first_hops_are_said_twice_in_a_row_or_once_at_the_runs_end():
    assert [witness_warns(losses, last=False) for losses in (0, 1, 2, 3)] == [False, False, True, True]
    assert [witness_warns(losses, last=True) for losses in (0, 1, 2)] == [False, True, True]


def test_the_chains_lose_a_comparison_only_by_more_than_the_margin():
    assert [witness_lost(0.5, 0.52), witness_lost(0.5, 0.53), witness_lost(0.6, 0.5)] == [False, True, False]


def test_a_first_hops_round_below_one_and_a_half_times_chance_is_as_low_as_a_stall():
    assert [fedavg_as_low(0.1, 0.1), fedavg_as_low(0.1, 0.149), fedavg_as_low(0.1, 0.151), fedavg_as_low(0.1, 0.4)] == [
        True, True, False, False,
    ]
    assert [fedavg_as_low(None, 0.1), fedavg_as_low(0.1, None)] == [False, False]  # a trained start; never compared


def test_the_averaged_models_are_scored_at_the_first_every_fifth_and_the_last_aggregation():
    assert [aggregation for aggregation in range(1, 13) if parts_due(aggregation, last=aggregation == 12)] == [1, 5, 10, 12]


def test_a_check_runs_when_free_or_within_a_twentieth_of_the_run():
    # 0.05 s is free whatever was spent; 1.4 s fits once the run has lasted 20x the checks' seconds.
    assert [check_affordable(50.0, 0.05, 1.0), check_affordable(5.0, 1.4, 127.9), check_affordable(5.0, 1.4, 128.0)] == [
        True, False, True,
    ]


def test_the_budget_skips_the_scheduled_checks_it_cannot_afford():
    # A 20-round run of 12.5 s rounds whose evaluations take 1.4 s each (CIFAR-10's test set
    # against FedSeq's rounds of 100 clients): the first aggregation scores the start model and
    # three parts (5.6 s); later parts wait until the checks fit in 5 % of the run.
    now = [0.0]
    budget = CheckBudget(clock=lambda: now[0])

    def evaluate(arrays: ArrayRecord) -> MetricRecord:
        now[0] += 1.4
        return MetricRecord({"accuracy": 0.5})

    scored = []
    budget.begin()
    for aggregation in range(1, 21):
        now[0] += 12.5
        if aggregation == 1:
            budget.timed(evaluate)(record([0.0]))  # the start model, once
        if parts_due(aggregation, last=aggregation == 20) and budget.affords(3, early=aggregation == 1):
            scored.append(aggregation)
            for _ in range(3):
                budget.timed(evaluate)(record([1.0]))
    # Due at 1, 5, 10, 15, 20: after 5.6 s of checks the next 4.2 s fit from 196 s of run on.
    assert scored == [1, 20]
    assert budget.as_record() == {"seconds": 9.8, "evaluations": 7, "skipped": 3}


def witness_schedule(rounds: int, evaluation_seconds: float, last: int | None = None):
    """A witness over `rounds` aggregations of 12.5 s rounds whose evaluations take
    `evaluation_seconds` (`last`: the aggregation told it is the run's last): the witness, its
    guard, and the aggregations it compared at."""
    now = [0.0]
    guard = chain_guard(1.0, 0.0, name="FedSeq")
    guard.budget.clock = lambda: now[0]
    witness = FirstHopWitness("FedSeq", 0.0, "Use FedAvg.", guard.budget)

    def evaluate(arrays: ArrayRecord) -> MetricRecord:
        now[0] += evaluation_seconds
        return MetricRecord({"accuracy": 0.5})

    compared = []
    for aggregation in range(1, rounds + 1):
        start = record([0.0])
        witness.begin(to_numpy(start))
        sent = [hop(start, record([1.0]))]
        witness.note(sent, guard.fold(sent, first_hop=True))
        now[0] += 12.5
        if witness.compare(aggregation, record([2.0]), evaluate, last=aggregation == last):
            compared.append(aggregation)
    return witness, guard, compared


def test_the_witness_always_compares_at_its_first_three_aggregations_then_within_the_budget():
    witness, guard, compared = witness_schedule(20, 1.4)
    # Due at 1, 2, 3, 5, 10, 15, 20; at the 5th (70.9 s) the 4.2 s spent leave no room for 1.4 s more.
    assert compared == [1, 2, 3, 10, 15, 20]
    assert guard.budget.as_record() == {"seconds": 8.4, "evaluations": 6, "skipped": 1}
    assert witness.first_hops_accuracy == 0.5  # the last comparison's, for the guard's warning
    resumed = FirstHopWitness("FedSeq", 0.0, "Use FedAvg.", guard.budget)
    resumed.load_state_dict(witness.state_dict())
    assert resumed.state_dict() == witness.state_dict()


def test_the_witness_compares_at_the_runs_last_aggregation_whatever_the_budget():
    # An evaluation as long as a round: only the comparisons that always run fit.
    _, guard, compared = witness_schedule(6, 10.0, last=6)
    assert compared == [1, 2, 3, 6]
    assert guard.budget.as_record() == {"seconds": 40.0, "evaluations": 4, "skipped": 1}


def test_at_most_the_three_heaviest_averaged_models_are_scored():
    assert scored_parts([5.0, 1.0, 9.0, 7.0, 2.0]) == [0, 2, 3]
    assert scored_parts([1.0, 1.0]) == [0, 1]


def test_a_run_that_averages_rarely_is_judged_only_from_its_second_average_when_that_comes_late():
    told = "the models are averaged every {} rounds: {} rounds give {}, so no check can compare this run with FedAvg "
    cases = {
        (2, 20): None, (5, 20): None, (10, 40): None, (1, 1): None,  # the second average by half the run; every round
        (6, 20): told.format(6, 20, "3 averages") + "before round 12",
        (10, 20): told.format(10, 20, "2 averages") + "before round 20",
        (20, 20): told.format(20, 20, "1 average") + "before round 20",
        (39, 20): told.format(39, 20, "0 averages") + "before round 20",
    }
    assert {case: averaged_too_rarely("the models", *case) for case in cases} == cases
