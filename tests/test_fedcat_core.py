"""Exact tests of FedCat's pure rules: K, schedule, grouping, count table, selection, dispatch."""

from __future__ import annotations

import numpy as np
import pytest

from concatfl.core.fedcat import (
    LEVEL_K,
    CountTable,
    cycle_offset,
    devices_per_round,
    dispatch,
    is_grouping_round,
    judged_late,
    long_cycle,
    make_groups,
    mbie_weights,
    pick_in_group,
    select_grouped,
    select_random,
)


def test_devices_per_round_follows_the_run_config_rule():
    assert devices_per_round(5, 0.2, 20) == 5  # explicit K wins
    assert devices_per_round(0, 0.2, 20) == 4  # round(0.2 · 20)
    assert devices_per_round(0, 0.1, 10) == 2  # round(1.0) = 1, raised to 2
    assert devices_per_round(0, 1.0, 7) == 7


def test_schedule_cycles_every_k_and_regroups_every_lambda_k():
    assert [cycle_offset(r, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [r for r in range(25) if is_grouping_round(r, 3, 2)] == [0, 6, 12, 18, 24]
    assert [r for r in range(25) if is_grouping_round(r, 4, 1)] == [0, 4, 8, 12, 16, 20, 24]


def test_groups_partition_the_nodes_into_nearly_equal_groups():
    nodes = [11, 12, 13, 14, 15, 16, 17, 2**63 + 5]
    groups = make_groups(nodes, 3, np.random.default_rng(0))
    assert len(groups) == 3
    assert sorted(len(g) for g in groups) == [2, 3, 3]
    assert sorted(n for g in groups for n in g) == sorted(nodes)
    assert all(type(n) is int for g in groups for n in g)
    # Same seed, same groups; another seed shuffles differently.
    assert make_groups(nodes, 3, np.random.default_rng(0)) == groups
    assert any(make_groups(nodes, 3, np.random.default_rng(s)) != groups for s in range(1, 5))
    with pytest.raises(ValueError):
        make_groups(nodes, 9, np.random.default_rng(0))


def test_dispatch_is_the_papers_rotation():
    selected = [10, 20, 30]
    assert dispatch(selected, 0) == [10, 20, 30]
    assert dispatch(selected, 1) == [20, 30, 10]
    assert dispatch(selected, 2) == [30, 10, 20]
    # The paper's 1-indexed rule: copy i in the j-th round of a cycle goes to the
    # ((i + j − 2) % K + 1)-th selected device.
    k = 4
    for j in range(1, k + 1):
        for i in range(1, k + 1):
            assert dispatch(list(range(1, k + 1)), j - 1)[i - 1] == (i + j - 2) % k + 1


def test_a_cycle_sends_every_copy_to_one_device_of_every_group_in_order():
    rng = np.random.default_rng(3)
    k = 3
    groups = make_groups(list(range(100, 109)), k, rng)
    table = CountTable(k)
    visits: list[list[int]] = [[] for _ in range(k)]
    for offset in range(k):
        selected = select_grouped(groups, table, offset, 0.5, rng)
        assert [next(g for g, members in enumerate(groups) if node in members) for node in selected] == [0, 1, 2]
        for copy, node in enumerate(dispatch(selected, offset)):
            visits[copy].append(node)
    for copy, nodes in enumerate(visits):
        assert len(set(nodes)) == k
        group_order = [next(g for g, members in enumerate(groups) if node in members) for node in nodes]
        assert group_order == [(copy + j) % k for j in range(k)]


def test_counts_increase_only_at_the_current_offset():
    table = CountTable(3)
    groups = [[1, 2], [3, 4]]
    selected = select_grouped(groups, table, 2, 0.5, np.random.default_rng(0))
    assert len(selected) == 2 and selected[0] in groups[0] and selected[1] in groups[1]
    nodes = [1, 2, 3, 4]
    assert list(table.counts(nodes, 0)) == list(table.counts(nodes, 1)) == [0, 0, 0, 0]
    assert list(table.counts(nodes, 2)) == [int(n in selected) for n in nodes]
    state = table.state_dict()
    assert state["counts"].shape == (2, 3)
    restored = CountTable.from_state(state)
    assert list(restored.counts(nodes, 2)) == list(table.counts(nodes, 2))


def test_mbie_weights_are_inverse_square_roots_with_inf_for_unvisited():
    np.testing.assert_allclose(mbie_weights(np.array([1, 4, 9])), [1.0, 0.5, 1 / 3])
    assert np.isinf(mbie_weights(np.array([0, 2]))[0])


def test_epsilon_one_always_takes_the_least_visited_device_breaking_ties_at_random():
    rng = np.random.default_rng(0)
    assert {pick_in_group(np.array([3, 1, 2]), 1.0, rng) for _ in range(50)} == {1}
    assert {pick_in_group(np.array([3, 0, 2, 0]), 1.0, rng) for _ in range(200)} == {1, 3}
    # Repeated selection at one offset with ε = 1 visits every device before any repeats.
    table, group = CountTable(2), [7, 8, 9, 10]
    first_four = [select_grouped([group], table, 1, 1.0, rng)[0] for _ in range(4)]
    assert sorted(first_four) == group
    assert list(table.counts(group, 1)) == [1, 1, 1, 1]
    assert list(table.counts(group, 0)) == [0, 0, 0, 0]


def _frequencies(counts: np.ndarray, epsilon: float, draws: int = 20_000) -> np.ndarray:
    rng = np.random.default_rng(1234)
    picks = [pick_in_group(counts, epsilon, rng) for _ in range(draws)]
    return np.bincount(picks, minlength=len(counts)) / draws


def test_epsilon_zero_samples_in_proportion_to_the_weights():
    counts = np.array([1, 4, 9, 16])
    weights = 1 / np.sqrt(counts)
    # 20 000 draws: the standard error of each frequency is below 0.0035; allow ~4 of them.
    np.testing.assert_allclose(_frequencies(counts, 0.0), weights / weights.sum(), atol=0.015)


def test_mixed_epsilon_is_greedy_with_probability_epsilon_and_sampled_otherwise():
    counts = np.array([1, 4, 9, 16])
    weights = 1 / np.sqrt(counts)
    expected = 0.3 * np.array([1.0, 0, 0, 0]) + 0.7 * weights / weights.sum()
    np.testing.assert_allclose(_frequencies(counts, 0.3), expected, atol=0.015)


def test_epsilon_zero_with_unvisited_devices_draws_uniformly_among_them():
    frequencies = _frequencies(np.array([2, 0, 5, 0, 0]), 0.0, draws=6_000)
    assert frequencies[0] == frequencies[2] == 0
    np.testing.assert_allclose(frequencies[[1, 3, 4]], [1 / 3] * 3, atol=0.03)


def test_random_selection_draws_k_distinct_nodes_uniformly():
    rng = np.random.default_rng(5)
    nodes = [3, 5, 7, 9, 11]
    draws = [select_random(nodes, 2, rng) for _ in range(5_000)]
    assert all(len(set(d)) == 2 and set(d) <= set(nodes) for d in draws)
    frequencies = np.array([sum(node in d for d in draws) for node in nodes]) / len(draws)
    np.testing.assert_allclose(frequencies, [2 / 5] * 5, atol=0.03)


def test_a_cycle_longer_than_the_longest_measured_level_with_fedavg_is_told_whatever_the_rounds():
    assert LEVEL_K == 3
    assert [k for k in range(2, 12) if long_cycle(k) is None] == [2, 3]
    reason = long_cycle(10)
    assert reason.startswith("K = 10: each copy takes 10 hops between averages, where FedAvg(fraction_train=K/N)")
    assert reason.endswith("Use k <= 3 (k=, fraction_train=), FedAvg(fraction_train=K/N), or FedSeq")
    assert long_cycle(4).startswith("K = 4: each copy takes 4 hops between averages")


@pytest.mark.parametrize(
    "k, num_rounds, told",
    [
        (2, 20, None),  # the second average at round 4 of 20
        (5, 20, None),  # at round 10: half the run
        (6, 20, "20 rounds give 3 averages, so no check can compare this run with FedAvg before round 12"),
        (10, 20, "20 rounds give 2 averages, so no check can compare this run with FedAvg before round 20"),
        (100, 20, "20 rounds give 0 averages, so no check can compare this run with FedAvg before round 20"),
        (20, 20, "20 rounds give 1 average, so no check can compare this run with FedAvg before round 20"),
    ],
)
def test_a_run_whose_second_average_comes_after_half_its_rounds_is_judged_late(k, num_rounds, told):
    reason = judged_late(k, num_rounds)
    if told is None:
        assert reason is None
    else:
        assert reason.startswith(f"K = {k} copies are averaged every {k} rounds: {told}; ")
        assert reason.endswith("Use a smaller K (k=, fraction_train=), more rounds, or FedAvg")
