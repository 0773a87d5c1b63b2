"""Exact tests of FedConcat's stage-1 core: distributions, DP noise, K-means, elbow, balancing, P^ID."""

import numpy as np
import pytest
import torch

from concatfl.core.clustering import (
    Clustering,
    assign_clusters,
    balance,
    balanced_cap,
    cluster_distributions,
    elbow,
    head_agreement,
    head_update_believed,
    infer_label_distribution,
    kmeans,
    label_distribution,
    laplace_noise,
    nearest_cluster,
)
from concatfl.models import build_model
from concatfl.training import Normalization, train


A = [0.5, 0.5, 0.0, 0.0]
B = [0.0, 0.0, 0.5, 0.5]
C = [0.0, 1.0, 0.0, 0.0]


def groups(clustering: Clustering) -> set[frozenset[int]]:
    return {frozenset(clustering.members(c)) for c in range(clustering.k)}


def test_label_distribution_is_counts_over_total():
    np.testing.assert_allclose(label_distribution([3, 1, 0, 4]), [0.375, 0.125, 0.0, 0.5])
    np.testing.assert_array_equal(label_distribution([0, 0]), [0.0, 0.0])


def test_identical_distributions_share_a_cluster():
    points = np.array([A, B, A, C, B, A, C])
    clustering = kmeans(points, 3, seed=0)
    assert groups(clustering) == {frozenset({0, 2, 5}), frozenset({1, 4}), frozenset({3, 6})}
    for cluster in range(3):
        members = clustering.members(cluster)
        np.testing.assert_allclose(clustering.centres[cluster], points[members[0]])


def test_more_clusters_than_distinct_distributions_drops_the_empty_ones():
    points = np.array([A, B, A, B])
    clustering = kmeans(points, 5, seed=0)
    assert clustering.requested == 5 and clustering.k == 2
    assert groups(clustering) == {frozenset({0, 2}), frozenset({1, 3})}
    assert clustering.sizes() == [2, 2]


def test_balanced_cap_is_1_2_times_average_or_the_smallest_feasible():
    assert balanced_cap(10, 2) == 6  # 1.2 * 5
    assert balanced_cap(20, 5) == 4  # 1.2 * 4 = 4.8
    assert balanced_cap(5, 4) == 2  # 1.2 * 1.25 = 1.5 < ceil(1.25)


def test_balance_moves_the_farthest_member_to_the_nearest_cluster_with_room():
    # Seven clients near A (client 6 the farthest from their centre), three exactly at B.
    near_a = [[0.5 - d, 0.5 + d, 0.0, 0.0] for d in (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.2)]
    points = np.array(near_a + [B, B, B])
    clustering = kmeans(points, 2, seed=0)
    assert sorted(clustering.sizes()) == [3, 7]
    balanced = balance(points, clustering)
    assert sorted(balanced.sizes()) == [4, 6]  # cap = 1.2 * 10 / 2 = 6
    assert balanced.labels[6] == balanced.labels[7]  # the outlier joined B's cluster
    np.testing.assert_allclose(balanced.centres[balanced.labels[7]], points[[6, 7, 8, 9]].mean(axis=0))


def test_balanced_clustering_never_exceeds_the_cap():
    rng = np.random.default_rng(3)
    skewed = np.concatenate([rng.dirichlet([0.1] * 10, size=24), rng.dirichlet([5.0] * 10, size=6)])
    for k in (3, 4, 5):
        clustering = cluster_distributions(skewed, k, balanced=True, seed=0)
        assert clustering.k == k
        assert max(clustering.sizes()) <= balanced_cap(30, k) <= 1.2 * 30 / k
        assert sum(clustering.sizes()) == 30


def test_laplace_noise_has_scale_one_over_epsilon():
    rng = np.random.default_rng(0)
    epsilon = 2.0
    base = np.full(200_000, 0.1)
    noise = laplace_noise(base, epsilon, rng) - base
    # Laplace(0, b): mean 0, E|X| = b, Var = 2 b^2 with b = 1/epsilon = 0.5.
    assert abs(noise.mean()) < 0.005
    assert np.abs(noise).mean() == pytest.approx(0.5, rel=0.01)
    assert noise.var() == pytest.approx(0.5, rel=0.02)
    with pytest.raises(ValueError):
        laplace_noise(base, 0.0, rng)


def test_elbow_picks_the_bend_of_the_curve():
    assert elbow([100.0, 20.0, 15.0, 12.0, 10.0]) == 2
    assert elbow([100.0, 70.0, 10.0, 8.0, 7.0, 6.0]) == 3
    assert elbow([0.0, 0.0, 0.0]) == 1  # all distributions equal
    assert elbow([5.0, 1.0]) == 1  # fewer than three candidates


def test_auto_k_finds_three_separated_groups():
    rng = np.random.default_rng(1)
    centres = np.array([[0.9, 0.05, 0.05], [0.05, 0.9, 0.05], [0.05, 0.05, 0.9]])
    points = np.concatenate([centre + rng.normal(0, 0.01, size=(5, 3)) for centre in centres])
    clustering = cluster_distributions(points, None, seed=0)
    assert clustering.k == 3 and clustering.requested == 3
    assert len(clustering.inertias) == 10 and clustering.inertias[0] > clustering.inertias[2]
    assert groups(clustering) == {frozenset(range(0, 5)), frozenset(range(5, 10)), frozenset(range(10, 15))}


@pytest.mark.parametrize("groups_of_clients", [2, 3])
def test_auto_k_finds_groups_of_identical_distributions(groups_of_clients):
    # #C=k partitions give many clients exactly the same distribution: K-means can only fit
    # as many clusters as there are distinct points, and the elbow must still see them.
    centres = np.eye(3)[:groups_of_clients] * 0.9 + 0.1 / 3
    points = np.repeat(centres, 4, axis=0)
    clustering = cluster_distributions(points, None, seed=0)
    assert clustering.k == groups_of_clients
    assert len(clustering.inertias) == min(10, len(points))
    assert set(clustering.inertias[groups_of_clients - 1:]) == {0.0} and clustering.inertias[0] > 0


def test_nearest_cluster():
    centres = np.array([A, B, C])
    assert nearest_cluster(np.array([0.4, 0.4, 0.1, 0.1]), centres) == 0
    assert nearest_cluster(np.array([0.0, 0.9, 0.0, 0.1]), centres) == 2


def test_label_inference_finds_the_only_trained_class():
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    normalization = Normalization((0.3,), (0.4,))
    x = torch.rand(64, 1, 8, 8)
    y = torch.full((64,), 3)
    train(
        model,
        x,
        y,
        epochs=5,
        batch_size=16,
        lr=0.1,
        normalization=normalization,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(0),
    )
    p_id = infer_label_distribution(model, 2000, (1, 8, 8), normalization, torch.Generator().manual_seed(1))
    assert p_id.shape == (10,)
    assert p_id.sum() == pytest.approx(1.0)
    assert int(p_id.argmax()) == 3 and p_id[3] > 0.5
    again = infer_label_distribution(
        model, 2000, (1, 8, 8), normalization, torch.Generator().manual_seed(1), batch_size=300
    )
    np.testing.assert_allclose(again, p_id, atol=1e-6)  # same inputs whatever the batching


def test_assign_clusters_keeps_big_node_ids_and_sends_silent_nodes_to_the_cluster_nearest_the_mean():
    big = [2**63 + 11, 2**63 + 13, 2**62 + 1, 2**64 - 1, 2**63 + 17]
    distributions = {
        big[0]: np.array([1.0, 0.0, 0.0]),
        big[1]: np.array([0.9, 0.1, 0.0]),
        big[2]: np.array([0.0, 0.0, 1.0]),
    }
    result = assign_clusters(distributions, big, 2, seed=0)
    first, third = result.assignment[big[0]], result.assignment[big[2]]
    assert first == result.assignment[big[1]] != third
    # Mean reported distribution (0.633, 0.033, 0.333) is nearer the {0, 1} cluster's centre.
    assert result.unreported == [big[3], big[4]] and result.fallback == first
    assert result.assignment[big[3]] == result.assignment[big[4]] == first
    assert set(result.assignment) == set(big) and all(type(node) is int for node in result.assignment)
    everyone = assign_clusters(distributions, big[:3], 2, seed=0)
    assert everyone.unreported == [] and everyone.fallback is None and len(everyone.assignment) == 3
    with pytest.raises(ValueError, match="no node reported a distribution"):
        assign_clusters({}, big, 2)


def test_label_inference_on_flat_inputs_without_normalization():
    """FedConcat-ID for a model on flat features: inputs of the given shape, fed as drawn."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 3))
    got = infer_label_distribution(model, 50, (64,), None, torch.Generator().manual_seed(1))
    inputs = torch.rand((50, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = torch.softmax(model(inputs), dim=1).mean(dim=0).double().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_head_agreement_is_the_cosine_of_the_bias_update_with_the_centred_distribution():
    centred = np.array([0.5, 0.5, 0.0, 0.0]) - 0.25  # a node of classes 0 and 1, federation uniform
    assert head_agreement(centred, np.array([0.2, 0.2, -0.2, -0.2])) == pytest.approx(1.0)
    assert head_agreement(centred, np.array([-0.2, -0.2, 0.2, 0.2])) == pytest.approx(-1.0)  # reversed
    assert head_agreement(centred, np.array([0.2, -0.2, 0.2, -0.2])) == pytest.approx(0.0)
    assert head_agreement(centred, np.zeros(4)) == 0.0 and head_agreement(np.zeros(4), np.ones(4)) == 0.0


def test_a_head_update_is_believed_unless_it_agrees_with_no_witness():
    centred = np.array([0.25, 0.25, -0.25, -0.25])
    honest, reversed_ = np.array([0.2, 0.1, -0.1, -0.2]), np.array([-0.2, -0.1, 0.1, 0.2])
    assert head_update_believed(honest, centred, honest) == (True, {"distribution": pytest.approx(0.9486833), "previous": pytest.approx(1.0)})
    believed, agreements = head_update_believed(reversed_, centred, honest)
    assert not believed and agreements == {"distribution": pytest.approx(-0.9486833), "previous": pytest.approx(-1.0)}
    # One witness that agrees is enough: a misleading distribution, the node's own history.
    assert head_update_believed(honest, -centred, honest)[0] and head_update_believed(honest, centred, reversed_)[0]
    assert not head_update_believed(reversed_, centred, None)[0] and not head_update_believed(reversed_, None, honest)[0]
    assert head_update_believed(reversed_, None, None) == (True, {})  # nothing to measure it against
    assert not head_update_believed(honest * 0.1, centred, None, bound=0.99)[0]  # 0.95 < 0.99
