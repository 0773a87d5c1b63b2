"""Exact tests of FedSeq's pure core: approximators, metrics, groupings and the report."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from concatfl.core import superclients as sc

NUM_CLASSES = 10


def one_hot(labels: list[int], num_classes: int = NUM_CLASSES) -> np.ndarray:
    return np.eye(num_classes)[labels]


def classes_of(group: list[int], labels: list[int]) -> list[int]:
    return [labels[c] for c in group]


# ---------------------------------------------------------------------- confidence approximator
def test_exemplar_indices_takes_per_class_samples_without_repeats():
    labels = np.array([0] * 30 + [1] * 5 + [2] * 12)
    chosen = sc.exemplar_indices(labels, 10, np.random.default_rng(0))
    assert list(chosen) == sorted(set(chosen))
    assert np.bincount(labels[chosen]).tolist() == [10, 5, 10]  # class 1 has only 5


def test_class_confidences_is_the_mean_own_class_probability():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.copy_(torch.log(torch.tensor([1.0, 3.0, 4.0])))  # softmax = 1/8, 3/8, 4/8
    x, y = torch.rand(5, 1, 2, 2), torch.tensor([0, 0, 1, 1, 1])
    conf = sc.class_confidences(model, x, y, 4, normalization=lambda t: t)
    assert conf == pytest.approx([1 / 8, 3 / 8, 0.0, 0.0])  # classes 2 and 3 have no exemplar


def test_class_confidences_applies_the_normalization():
    model = nn.Sequential(nn.Flatten(), nn.Linear(1, 2))
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([[1.0], [-1.0]]))
        model[1].bias.zero_()
    x, y = torch.full((1, 1, 1, 1), 0.5), torch.tensor([0])
    plain = sc.class_confidences(model, x, y, 2, normalization=lambda t: t)
    shifted = sc.class_confidences(model, x, y, 2, normalization=lambda t: t - 0.5)
    assert plain[0] == pytest.approx(1 / (1 + math.exp(-1.0)))
    assert shifted[0] == pytest.approx(0.5)


def test_confidence_vector_sum_and_softmax():
    p = np.array([0.5, 0.25, 0.25, 0.0])
    assert sc.confidence_vector(p, "sum") == pytest.approx([0.5, 0.25, 0.25, 0.0])
    assert sc.confidence_vector(2 * p, "sum") == pytest.approx([0.5, 0.25, 0.25, 0.0])
    soft = np.exp(p) / np.exp(p).sum()
    assert sc.confidence_vector(p, "softmax") == pytest.approx(soft)
    with pytest.raises(ValueError, match="normalize"):
        sc.confidence_vector(p, "max")


# ---------------------------------------------------------------------- classifier approximator
def test_select_fc_layers():
    names = ["encoder.fc1", "encoder.fc2", "classifier"]
    assert sc.select_fc_layers(names, "all") == names
    assert sc.select_fc_layers(names, "last2") == ["encoder.fc2", "classifier"]
    assert sc.select_fc_layers(names, "last") == ["classifier"]


def test_classifier_vector_concatenates_the_selected_layers():
    state = {
        "encoder.conv1.weight": np.full((2, 2), 9.0),
        "encoder.fc1.weight": np.array([[1.0, 2.0]]),
        "encoder.fc1.bias": np.array([3.0]),
        "classifier.weight": np.array([[4.0]]),
        "classifier.bias": np.array([5.0]),
    }
    assert sc.classifier_vector(state, ["encoder.fc1", "classifier"]).tolist() == [1, 2, 3, 4, 5]
    assert sc.classifier_vector(state, ["classifier"]).tolist() == [4, 5]
    with pytest.raises(ValueError, match="no parameters"):
        sc.classifier_vector(state, ["encoder.fc9"])


def test_pca_keeps_at_least_90_percent_of_the_variance_with_fewer_components():
    rng = np.random.default_rng(0)
    # 30 clients whose 500 weights lie near a 3-dimensional subspace.
    vectors = rng.normal(size=(30, 3)) @ rng.normal(size=(3, 500)) + 0.01 * rng.normal(size=(30, 500))
    reduced, explained = sc.reduce_pca(vectors)
    assert explained >= 0.9
    assert reduced.shape[0] == 30 and reduced.shape[1] <= 3
    assert sc.reduce_pca(vectors[:1]) == (pytest.approx(vectors[:1]), 1.0)


# ---------------------------------------------------------------------- metrics
def test_metrics_on_known_vectors():
    assert sc.kl_divergence([1, 0], [0.5, 0.5]) == pytest.approx(math.log(2), abs=1e-4)
    assert sc.kl_divergence([0.3, 0.7], [0.3, 0.7]) == pytest.approx(0.0)
    assert math.isfinite(sc.kl_divergence([1, 0], [0, 1])) and sc.kl_divergence([1, 0], [0, 1]) > 10
    assert sc.cosine_distance([1, 0], [0, 1]) == pytest.approx(1.0)
    assert sc.cosine_distance([1, 1], [1, 0]) == pytest.approx(1 - 1 / math.sqrt(2))
    assert sc.euclidean_distance([0, 0], [3, 4]) == pytest.approx(5.0)
    assert sc.class_wasserstein([1, 0, 0], [0, 0, 1]) == pytest.approx(2.0)
    assert sc.class_wasserstein([1, 0, 0], [0, 1, 0]) == pytest.approx(1.0)
    assert sc.gini_index([0.25] * 4) == pytest.approx(0.0)
    assert sc.gini_index([1, 0, 0, 0]) == pytest.approx(0.75)
    assert sc.gini_merge_score([1, 0], [0, 1]) == pytest.approx(1.0)  # merged: uniform
    assert sc.gini_merge_score([1, 0], [1, 0]) == pytest.approx(0.5)  # merged: one-hot of 2
    assert sc.dissimilarity("euclidean", np.zeros(2), np.array([3.0, 4.0])) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="metric"):
        sc.dissimilarity("l1", np.zeros(2), np.zeros(2))


# ---------------------------------------------------------------------- groupings
@pytest.mark.parametrize("metric", ["kl", "cosine", "euclidean", "gini"])
def test_greedy_on_ten_one_class_clients_gives_superclients_of_distinct_classes(metric):
    labels = list(range(NUM_CLASSES))
    groups = sc.greedy_grouping(one_hot(labels), [10] * 10, metric, 50, 11, np.random.default_rng(1))
    assert [len(g) for g in groups] == [5, 5]
    assert sorted(c for g in groups for c in g) == labels


@pytest.mark.parametrize("metric", ["kl", "cosine", "euclidean", "gini"])
def test_greedy_adds_clients_of_uncovered_classes_first(metric):
    labels = [c % NUM_CLASSES for c in range(20)]  # two one-class clients per class
    groups = sc.greedy_grouping(one_hot(labels), [10] * 20, metric, 50, 11, np.random.default_rng(1))
    assert [len(g) for g in groups] == [5, 5, 5, 5]
    # The first superclient could choose among all classes: five different ones.
    assert len(set(classes_of(groups[0], labels))) == 5


@pytest.mark.parametrize("metric", ["kl", "cosine", "euclidean", "gini"])
def test_greedy_builds_superclients_covering_every_class(metric):
    labels = [c % NUM_CLASSES for c in range(20)]
    groups = sc.greedy_grouping(one_hot(labels), [10] * 20, metric, 100, 11, np.random.default_rng(2))
    assert len(groups) == 2
    for group in groups:
        assert sorted(classes_of(group, labels)) == list(range(NUM_CLASSES))


@pytest.mark.parametrize(("merge", "expected"), [("half", [[0, 1], [2]]), ("weighted", [[0, 2], [1]])])
def test_greedy_gini_ranks_candidates_by_the_merge_it_then_makes(merge, expected):
    # From [1, 0] of 100 samples: a ½/½ merge with [0, 1] is uniform, but weighted by size the
    # 10-sample [0, 1] hardly moves it while the 1000-sample [½, ½] nearly evens it out.
    vectors = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    seed = next(s for s in range(100) if np.random.default_rng(s).integers(3) == 0)  # client 0 starts
    groups = sc.greedy_grouping(vectors, [100, 10, 1000], "gini", 10_000, 2, np.random.default_rng(seed), merge)
    assert groups == expected


def test_greedy_wasserstein_adds_the_farthest_class_first():
    labels = list(range(NUM_CLASSES))
    groups = sc.greedy_grouping(one_hot(labels), [10] * 10, "wasserstein", 20, 11, np.random.default_rng(0))
    seed, partner = groups[0]
    assert partner == (NUM_CLASSES - 1 if seed <= 4 else 0)


def test_merge_distribution():
    a, b = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    assert sc.merge_distribution(a, 30, b, 10, "half") == pytest.approx([0.5, 0.5])
    assert sc.merge_distribution(a, 30, b, 10, "weighted") == pytest.approx([0.75, 0.25])
    with pytest.raises(ValueError, match="merge"):
        sc.merge_distribution(a, 30, b, 10, "max")


def test_weighted_merge_accounts_for_client_sizes():
    # Client 0 (class 0) holds 100 samples, the others 10. After {0, 1}, `half` sees classes 0
    # and 1 as equally present (a tie, broken by index: client 2 of class 0), `weighted` sees
    # class 1 as scarce and adds client 3 of class 1.
    vectors, sizes = one_hot([0, 1, 0, 1], 2), [100, 10, 10, 10]
    assert int(np.random.default_rng(11).integers(4)) == 0  # seed 11 starts with client 0
    half = sc.greedy_grouping(vectors, sizes, "kl", 115, 3, np.random.default_rng(11), "half")
    weighted = sc.greedy_grouping(vectors, sizes, "kl", 115, 3, np.random.default_rng(11), "weighted")
    assert half == [[0, 1, 2], [3]] and weighted == [[0, 1, 3], [2]]


def test_greedy_respects_min_samples_and_max_clients():
    rng = np.random.default_rng(3)
    vectors = rng.dirichlet(np.ones(NUM_CLASSES), size=40)
    sizes = rng.integers(5, 60, size=40).tolist()
    groups = sc.greedy_grouping(vectors, sizes, "kl", 120, 4, np.random.default_rng(0))
    assert sorted(c for g in groups for c in g) == list(range(40))
    for group in groups[:-1]:
        assert len(group) <= 4
        assert sum(sizes[c] for c in group) >= 120 or len(group) == 4
    assert len(groups[-1]) <= 4


def scalar_greedy_grouping(vectors, sizes, metric, min_samples, max_clients, rng, merge="half"):
    """The greedy grouping as it was written before it was vectorised: τ evaluated by its scalar
    definition for every remaining client at every addition (≈ n²/2 calls)."""
    vectors = np.asarray(vectors, dtype=np.float64)
    remaining = list(range(len(vectors)))
    groups = []
    while remaining:
        seed = remaining.pop(int(rng.integers(len(remaining))))
        group, merged, samples = [seed], vectors[seed].copy(), sizes[seed]
        while remaining and samples < min_samples and len(group) < max_clients:
            if metric == "gini":
                merges = (sc.merge_distribution(merged, samples, vectors[j], sizes[j], merge) for j in remaining)
                scores = [1.0 - sc.gini_index(candidate) for candidate in merges]
            else:
                scores = [sc.dissimilarity(metric, vectors[j], merged) for j in remaining]
            chosen = remaining.pop(int(np.argmax(scores)))
            group.append(chosen)
            merged = sc.merge_distribution(merged, samples, vectors[chosen], sizes[chosen], merge)
            samples += sizes[chosen]
        groups.append(group)
    return sc.absorb_leftovers(groups, sizes, min_samples, max_clients)


def grouping_inputs(kind: str, seed: int, n: int, classes: int = NUM_CLASSES) -> np.ndarray:
    """Client vectors of one kind: Dirichlet confidence vectors (continuous), one-hot label
    vectors (ties by the dozen), exact duplicates of a few vectors, or signed PCA-like vectors."""
    rng = np.random.default_rng(seed)
    if kind == "dirichlet":
        return rng.dirichlet(np.full(classes, 0.3), size=n)
    if kind == "one-hot":
        return one_hot(rng.integers(classes, size=n).tolist(), classes)
    if kind == "duplicates":
        return rng.dirichlet(np.ones(classes), size=4)[rng.integers(4, size=n)]
    return rng.normal(size=(n, 5))


@pytest.mark.parametrize("merge", sc.GREEDY_MERGES)
@pytest.mark.parametrize("metric", list(sc.METRICS))
def test_vectorised_greedy_groups_exactly_as_the_scalar_definition(metric, merge):
    kinds = ["dirichlet", "one-hot", "duplicates"] + (["signed"] if metric in ("cosine", "euclidean") else [])
    for kind in kinds:
        for seed in range(4):
            n = 12 + 8 * seed
            vectors = grouping_inputs(kind, seed, n)
            sizes = np.random.default_rng(100 + seed).integers(1, 40, size=n).tolist()
            for min_samples, max_clients in ((60, 5), (10_000, 7)):
                expected = scalar_greedy_grouping(vectors, sizes, metric, min_samples, max_clients,
                                                  np.random.default_rng(seed), merge)
                got = sc.greedy_grouping(vectors, sizes, metric, min_samples, max_clients,
                                         np.random.default_rng(seed), merge)
                assert got == expected, (kind, seed, min_samples, max_clients)


@pytest.mark.parametrize("metric", ["kl", "cosine", "euclidean"])
def test_vectorised_greedy_keeps_the_scalar_result_where_estimates_cannot_go(metric):
    # A NaN, negative entries for KL, a zero vector for cosine: every candidate is scored by
    # the scalar definition, with whatever it gives (NaN ranks first, as np.argmax has it; the
    # Euclidean metric refuses a NaN).
    vectors = np.random.default_rng(4).normal(size=(15, 4))
    vectors[3] = 0.0
    vectors[7, 1] = np.nan
    sizes = [5] * 15

    def outcome(grouping):
        try:
            return grouping(vectors, sizes, metric, 20, 6, np.random.default_rng(1))
        except ValueError as error:
            return str(error)

    with np.errstate(all="ignore"):
        assert outcome(sc.greedy_grouping) == outcome(scalar_greedy_grouping)


def test_greedy_grouping_of_10000_clients_scores_about_one_candidate_per_addition(monkeypatch):
    # Scale: today's scalar loop scores every remaining client at every addition (≈ 5·10⁷ calls
    # for 10,000 clients, minutes); the vectorised one scores only the candidates rounding could
    # make the best: about one per addition.
    calls = []
    scalar = sc.dissimilarity
    monkeypatch.setattr(sc, "dissimilarity", lambda *args: calls.append(1) or scalar(*args))
    n = 10_000
    vectors = grouping_inputs("dirichlet", 0, n)
    sizes = np.random.default_rng(1).integers(3, 9, size=n).tolist()
    groups = sc.greedy_grouping(vectors, sizes, "kl", 60, 11, np.random.default_rng(0))
    assert sorted(c for g in groups for c in g) == list(range(n))
    assert len(calls) < 1.1 * n


def test_kmeans_grouping_takes_clusters_round_robin_across_superclients():
    labels = [c % NUM_CLASSES for c in range(20)]
    groups = sc.kmeans_grouping(one_hot(labels), [10] * 20, NUM_CLASSES, 30, 11, np.random.default_rng(0))
    # 6 full superclients of 3, then a leftover of 2 (20 < 30 samples) given to the first two.
    assert [len(g) for g in groups] == [4, 4, 3, 3, 3, 3]
    # K-means finds the classes; j carries on between superclients, so the first three
    # superclients plus the next pick visit the ten clusters once each.
    first_cycle = [c for g in groups[:3] for c in g[:3]] + [groups[3][0]]
    assert sorted(classes_of(first_cycle, labels)) == list(range(NUM_CLASSES))


def test_kmeans_grouping_with_min_samples_builds_full_class_superclients():
    labels = [c % NUM_CLASSES for c in range(20)]
    groups = sc.kmeans_grouping(one_hot(labels), [10] * 20, NUM_CLASSES, 100, 11, np.random.default_rng(5))
    assert len(groups) == 2
    for group in groups:
        assert sorted(classes_of(group, labels)) == list(range(NUM_CLASSES))


def test_kmeans_grouping_skips_emptied_clusters():
    labels = [0] * 6 + [1, 2]  # cluster of class 0 outlives the others
    groups = sc.kmeans_grouping(one_hot(labels, 3), [10] * 8, 3, 40, 11, np.random.default_rng(0))
    assert sorted(c for g in groups for c in g) == list(range(8))
    assert [len(g) for g in groups] == [4, 4]


def test_random_grouping_cuts_a_random_permutation_by_the_stopping_rule():
    sizes = [10, 20, 10, 30, 10, 10, 20]
    groups = sc.random_grouping(sizes, 30, 11, np.random.default_rng(7))
    order = np.random.default_rng(7).permutation(7).tolist()
    expected, group, total = [], [], 0
    for client in order:
        group.append(client)
        total += sizes[client]
        if total >= 30:
            expected.append(group)
            group, total = [], 0
    assert groups == sc.absorb_leftovers(expected + ([group] if group else []), sizes, 30, 11)
    assert all(sum(sizes[c] for c in g) >= 30 for g in groups)


def test_random_grouping_respects_max_clients():
    groups = sc.random_grouping([1] * 10, 1000, 3, np.random.default_rng(0))
    # Every superclient hits max-clients first; the last one has no room to go to and stays.
    assert [len(g) for g in groups] == [3, 3, 3, 1]


def test_leftovers_go_to_the_superclients_with_fewest_samples():
    sizes = [10, 10, 10, 5, 6, 4]
    groups = [[0, 1], [2, 3], [4, 5]]  # last: 10 < 20 samples
    assert sc.absorb_leftovers(groups, sizes, 20, 11) == [[0, 1, 5], [2, 3, 4]]
    # No superclient has room under max-clients: the leftover stays.
    assert sc.absorb_leftovers(groups, sizes, 20, 2) == groups
    # Room for one: the other client stays behind.
    assert sc.absorb_leftovers([[0, 1], [2], [4, 5]], sizes, 20, 2) == [[0, 1], [2, 4], [5]]
    # A lone superclient is never dissolved, a big enough last one is kept.
    assert sc.absorb_leftovers([[3]], sizes, 20, 11) == [[3]]
    assert sc.absorb_leftovers([[0], [1, 2]], sizes, 20, 11) == [[0], [1, 2]]


def test_group_clients_dispatches_and_rejects_unknown_methods():
    labels = list(range(4))
    vectors, sizes = one_hot(labels, 4), [10] * 4
    for method in sc.GROUPINGS:
        groups = sc.group_clients(
            method, vectors, sizes, metric="kl", num_clusters=4, min_samples=20, max_clients=11,
            rng=np.random.default_rng(0),
        )
        assert sorted(c for g in groups for c in g) == labels
    with pytest.raises(ValueError, match="grouping"):
        sc.group_clients("spectral", vectors, sizes, metric="kl", num_clusters=4, min_samples=20,
                         max_clients=11, rng=np.random.default_rng(0))


# ---------------------------------------------------------------------- report
def test_balance_and_coverage():
    assert sc.balance_ratio([10, 5, 20]) == pytest.approx(0.25)
    assert sc.balance_ratio([0, 5]) == 0.0
    assert sc.covered_classes([3, 0, 1]) == [0, 2]
    assert sc.covered_classes([0.9, 0.04, 0.06], min_share=0.05) == [0, 2]
    counts = np.array([[10, 0, 0], [0, 5, 0], [0, 0, 20]])
    report = sc.describe_superclients([[0, 1], [2]], [10, 5, 20], counts)
    assert report == [
        {"clients": 2, "samples": 15, "balance_ratio": 0.0, "covered_classes": 2, "classes": [0, 1]},
        {"clients": 1, "samples": 20, "balance_ratio": 0.0, "covered_classes": 1, "classes": [2]},
    ]


def test_a_late_client_joins_the_open_superclient_that_lacks_its_classes_most():
    estimates = {0: np.array([5.0, 5.0, 0.0, 0.0]), 1: np.array([0.0, 5.0, 5.0, 0.0]), 2: None}
    samples, members = {0: 10, 1: 10, 2: 3}, {0: 2, 1: 2, 2: 1}
    # Class 0: superclient 1 has none of it (0 has half); class 3: a tie, the lower id.
    assert sc.fitting_superclient(np.eye(4)[0], estimates, samples, members, "kl", 3) == 1
    assert sc.fitting_superclient(np.eye(4)[3], estimates, samples, members, "kl", 3) == 0
    # A full superclient is no candidate; without an approximation: the fewest samples.
    assert sc.fitting_superclient(np.eye(4)[0], estimates, samples, {0: 2, 1: 3, 2: 1}, "kl", 3) == 0
    assert sc.fitting_superclient(None, estimates, samples, members, "kl", 3) == 2
    assert sc.fitting_superclient(np.eye(4)[0], estimates, samples, {0: 3, 1: 3, 2: 3}, "kl", 3) is None


@pytest.mark.parametrize(
    "groups, singles",
    [
        ([[0], [1], [2, 3]], 2),  # two of three: FedSeqInter would relay between single clients
        ([[0], [1, 2]], 1),  # half
        ([[0], [1, 2], [3, 4]], None),  # one of three
        ([[0, 1], [2, 3]], None),
        ([], None),
    ],
)
def test_fedseq_inter_is_told_off_where_at_least_half_the_superclients_are_single_clients(groups, singles):
    reason = sc.single_client_relay(groups, 800)
    if singles is None:
        assert reason is None
    else:
        assert reason.startswith(
            f"{singles} of {len(groups)} superclients are single clients (they hold min-samples=800 samples alone): "
            f"each model travels from client to client for {len(groups)} rounds"
        )
        assert reason.endswith("Use FedSeq (a single-client superclient trains as a FedAvg client) or a larger min_samples")


@pytest.mark.parametrize(
    "superclients, rounds, told",
    [
        (39, 20, "20 rounds give 0 averages, so no check can compare this run with FedAvg before round 20"),
        (6, 20, "20 rounds give 3 averages, so no check can compare this run with FedAvg before round 12"),
        (5, 20, None),  # the second average at round 10: half the run
        (5, 30, None),  # fedseq-digits: 5 superclients, 30 rounds
        (1, 1, None),  # one superclient: averaged every round, FedSeq
    ],
)
def test_fedseq_inter_is_told_where_its_slots_are_averaged_too_rarely_for_its_checks(superclients, rounds, told):
    reason = sc.slots_judged_late(superclients, rounds)
    if told is None:
        assert reason is None
    else:
        assert reason.startswith(f"the slots (one per superclient) are averaged every {superclients} rounds: {told}; ")
        assert reason.endswith("Use FedSeq, more rounds, or a larger min_samples (fewer superclients)")
