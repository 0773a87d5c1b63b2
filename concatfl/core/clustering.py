"""FedConcat's stage 1: label distributions, their privacy noise, and the client clustering.

Diao et al. (FedConcat) group clients whose label distributions are alike, train one model per
group, and concatenate the groups' encoders. Everything here is pure numpy/torch/scikit-learn:

* `label_distribution` — P_i(y) = N_{i,y} / N_i from a client's label counts (stage 1-A).
* `laplace_noise` — the ε-differentially-private release of P_i: Laplace(0, 1/ε) added to every
  entry (sensitivity 1, as in the paper's appendix).
* `infer_label_distribution` — FedConcat-ID's P_i^ID (stage 1-B): the mean softmax of a model
  trained by client i on random inputs (each pixel uniform in [0, 1], then normalized like the
  real inputs), so no label information has to leave the client.
* `cluster_distributions` — K-means on the distributions, with K fixed or chosen by the elbow
  rule (`elbow`), optionally balanced (`balance`), empty clusters dropped.
* `nearest_cluster` — the cluster whose centre is nearest to a distribution (used for clients
  that did not report one).
* `agreement`, `head_agreement`, `head_update_believed` — whether a report fits its node's
  model, and whether a head update fits the distribution its node was placed by and its
  previous head update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .witness import believed, cosine

# K-means restarts; the best of them (lowest inertia) is kept.
KMEANS_RESTARTS = 10
# Candidate K for `auto` run from 1 to this (and never beyond the number of distinct points).
DEFAULT_MAX_CLUSTERS = 10
# The balanced variant caps every cluster at this multiple of the average cluster size.
BALANCE_FACTOR = 1.2


@dataclass(frozen=True)
class Clustering:
    """Clients grouped into `k` clusters.

    `labels[i]` is the cluster (0 … k-1) of the i-th distribution given to the clustering and
    `centres[c]` the mean distribution of cluster c's members. `inertias[j]` is the
    within-cluster sum of squared distances of K-means with K = j + 1, filled only when K was
    chosen by the elbow rule; `requested` is the K asked for (or the elbow's choice).
    """

    labels: np.ndarray
    centres: np.ndarray
    requested: int
    inertias: tuple[float, ...] = field(default=())

    @property
    def k(self) -> int:
        """Number of (non-empty) clusters."""
        return len(self.centres)

    def members(self, cluster: int) -> list[int]:
        """Indices of the distributions in `cluster`, ascending."""
        return [int(i) for i in np.flatnonzero(self.labels == cluster)]

    def sizes(self) -> list[int]:
        """Number of members of each cluster."""
        return [int(s) for s in np.bincount(self.labels, minlength=self.k)]


def label_distribution(counts: Sequence[int] | np.ndarray) -> np.ndarray:
    """P(y) = N_y / N from per-class counts (all zeros stay zeros)."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    return counts / total if total > 0 else counts


def laplace_noise(distribution: np.ndarray, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    """`distribution` + Laplace(0, 1/ε) noise on every entry (ε-DP for sensitivity 1).

    The result is released as is (it may leave the simplex): K-means only needs the points.
    """
    if epsilon <= 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    distribution = np.asarray(distribution, dtype=np.float64)
    return distribution + rng.laplace(0.0, 1.0 / epsilon, size=distribution.shape)


@torch.no_grad()
def infer_label_distribution(
    model: nn.Module,
    num_samples: int,
    input_shape: Sequence[int],
    normalization: Callable[[torch.Tensor], torch.Tensor] | None,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
    batch_size: int = 1000,
) -> np.ndarray:
    """FedConcat-ID's P^ID(y): the mean softmax of `model` over `num_samples` random inputs.

    Each input has shape `input_shape` (one sample's: (C, H, W) for images, (F,) for flat
    features, any other for other models). Every entry is drawn uniformly from [0, 1] (with
    `generator`, on the CPU so the draw does not depend on the device) and the batch then goes
    through `normalization` (None: fed as drawn), exactly like real inputs do.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    model.to(device).eval()
    sums = []
    for start in range(0, num_samples, batch_size):
        inputs = torch.rand((min(batch_size, num_samples - start), *input_shape), generator=generator)
        if normalization is not None:
            inputs = normalization(inputs)
        sums.append(torch.softmax(model(inputs.to(device)), dim=1).sum(dim=0).cpu())
    return (torch.stack(sums).sum(dim=0) / num_samples).double().numpy()


def kmeans(points: np.ndarray, k: int, seed: int) -> Clustering:
    """K-means with K = min(k, number of distinct points); empty clusters are dropped.

    Asking for more clusters than there are distinct points would leave clusters empty, so K is
    capped first; `requested` keeps the K that was asked for, `k` says how many remain.
    """
    points = np.asarray(points, dtype=np.float64)
    if points.ndim != 2 or len(points) == 0:
        raise ValueError(f"points must be a non-empty (n, m) array, got shape {points.shape}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    effective = min(k, _distinct_count(points))
    labels = _kmeans(effective, seed).fit_predict(points)
    return _with_mean_centres(points, labels, requested=k)


def _kmeans(k: int, seed: int):
    """scikit-learn's K-means with KMEANS_RESTARTS restarts. Imported here: the clients import
    this module for `label_distribution` and `laplace_noise`, and scikit-learn would add ~0.15 GB
    to every ClientApp process."""
    from sklearn.cluster import KMeans  # pylint: disable=import-outside-toplevel

    return KMeans(n_clusters=k, n_init=KMEANS_RESTARTS, random_state=seed)


def elbow(inertias: Sequence[float]) -> int:
    """The K at the elbow of the curve `inertias[j]` = within-cluster distance for K = j + 1.

    Rule (a discrete "kneedle"): scale K and the inertia to [0, 1] (K from the first to the last
    candidate, inertia by its value at K = 1), draw the chord from the first to the last point
    and take the K whose point lies farthest below the chord, i.e. where adding clusters stops
    paying off. Ties go to the smaller K. A flat curve (all distributions equal) or fewer than
    three candidates has no elbow: K = 1.
    """
    values = np.asarray(inertias, dtype=np.float64)
    if len(values) < 3 or values[0] <= 0:
        return 1
    x = np.linspace(0.0, 1.0, len(values))
    y = values / values[0]
    chord = y[0] + (y[-1] - y[0]) * x
    return int(np.argmax(chord - y)) + 1


def choose_k_by_elbow(
    points: np.ndarray, seed: int, max_clusters: int = DEFAULT_MAX_CLUSTERS
) -> tuple[int, tuple[float, ...]]:
    """(K at the elbow, inertia curve) over K = 1 … min(max_clusters, number of points).

    From K = the number of distinct points on every point is a centre and the inertia is 0: the
    curve keeps that flat tail (without running K-means) so that clients sharing a few exact
    distributions show their elbow at that count instead of at the curve's last point.
    """
    points = np.asarray(points, dtype=np.float64)
    distinct = _distinct_count(points)
    inertias = tuple(
        float(_kmeans(k, seed).fit(points).inertia_)
        if k < distinct
        else 0.0
        for k in range(1, min(max_clusters, len(points)) + 1)
    )
    return elbow(inertias), inertias


def balanced_cap(num_points: int, k: int, factor: float = BALANCE_FACTOR) -> int:
    """Largest cluster size the balanced variant allows: ⌊factor · n/k⌋, at least ⌈n/k⌉.

    When ⌊1.2 · n/k⌋ < ⌈n/k⌉ (e.g. 5 clients, 4 clusters) no assignment meets the 1.2 cap, so
    the smallest feasible cap ⌈n/k⌉ is used instead.
    """
    average = num_points / k
    return max(math.floor(factor * average + 1e-9), math.ceil(average))


def balance(points: np.ndarray, clustering: Clustering, factor: float = BALANCE_FACTOR) -> Clustering:
    """The paper's balanced variant: shrink every cluster to at most `balanced_cap` members.

    While some cluster has more members than the cap, its member farthest from its centre
    moves to the nearest (by centre distance) cluster that still has room. The centres stay
    fixed while members move and are recomputed as member means at the end. Each move lowers
    the total excess by one, so the loop ends; a cluster below the cap always exists because
    k · cap ≥ n.
    """
    points = np.asarray(points, dtype=np.float64)
    labels = clustering.labels.copy()
    centres = clustering.centres
    cap = balanced_cap(len(points), clustering.k, factor)
    while (sizes := np.bincount(labels, minlength=clustering.k)).max() > cap:
        source = int(np.argmax(sizes))
        members = np.flatnonzero(labels == source)
        moving = members[np.argmax(np.linalg.norm(points[members] - centres[source], axis=1))]
        distances = np.linalg.norm(centres - points[moving], axis=1)
        distances[sizes >= cap] = np.inf
        labels[moving] = int(np.argmin(distances))
    return _with_mean_centres(points, labels, clustering.requested, clustering.inertias)


def cluster_distributions(
    points: np.ndarray,
    num_clusters: int | None,
    *,
    balanced: bool = False,
    seed: int = 0,
    max_clusters: int = DEFAULT_MAX_CLUSTERS,
) -> Clustering:
    """Stage 1's clustering: K-means with K = `num_clusters` (None: the elbow rule), then the
    balanced variant when `balanced`."""
    inertias: tuple[float, ...] = ()
    if num_clusters is None:
        num_clusters, inertias = choose_k_by_elbow(points, seed, max_clusters)
    clustering = kmeans(points, num_clusters, seed)
    if inertias:
        clustering = Clustering(clustering.labels, clustering.centres, clustering.requested, inertias)
    return balance(points, clustering) if balanced else clustering


@dataclass(frozen=True)
class NodeClusters:
    """Stage 1's outcome for a set of nodes.

    `assignment` maps every node to its cluster; `clustering` is that of the reported
    distributions (in ascending node order); `unreported` lists the nodes without one, which
    all join cluster `fallback` (None when every node reported).
    """

    assignment: dict[int, int]
    clustering: Clustering
    unreported: list[int]
    fallback: int | None


def assign_clusters(
    distributions: Mapping[int, np.ndarray],
    nodes: Sequence[int],
    num_clusters: int | None,
    *,
    balanced: bool = False,
    seed: int = 0,
) -> NodeClusters:
    """Cluster the nodes' reported distributions (`cluster_distributions`); the nodes in `nodes`
    that reported none join the cluster whose centre is nearest the mean reported distribution,
    so their data still trains an encoder and the head. Node ids stay Python ints (Flower's are
    uint64 and would lose digits in a numpy array)."""
    if not distributions:
        raise ValueError("no node reported a distribution")
    reported = sorted(distributions)
    points = np.stack([distributions[node] for node in reported])
    clustering = cluster_distributions(points, num_clusters, balanced=balanced, seed=seed)
    assignment = {node: int(label) for node, label in zip(reported, clustering.labels, strict=True)}
    unreported = [node for node in nodes if node not in distributions]
    fallback = nearest_cluster(points.mean(axis=0), clustering.centres) if unreported else None
    assignment.update({node: fallback for node in unreported if fallback is not None})
    return NodeClusters(assignment, clustering, unreported, fallback)


def agreement(reported: np.ndarray, inferred: np.ndarray, reported_mean: np.ndarray, inferred_mean: np.ndarray) -> float:
    """How well a node's reported label distribution p matches what its model says, q = P^ID:
    cos(p − p̄, q − q̄), p̄ and q̄ the means over the federation's nodes.

    P^ID of a model trained one round from a random start is a faint, biased copy of the
    client's label distribution (the same bias for every client: centring removes it); the
    cosine of the centred vectors is near 1 for an honest report and near or below 0 for a
    report that names other classes than the client trains on. 0 when either centred vector
    is zero (no signal).
    """
    return cosine(np.asarray(reported, dtype=np.float64) - reported_mean, np.asarray(inferred, dtype=np.float64) - inferred_mean)


def head_agreement(centred_distribution: np.ndarray, bias_update: np.ndarray) -> float:
    """How well a head update fits the label distribution its node was placed by, p − p̄ (p̄ the
    federation's mean): cos(p − p̄, Δb), Δb the update of the head's bias.

    The cross-entropy gradient of a linear head's bias is (predicted − one-hot) averaged over a
    batch, so a few local steps move b_y by about lr·(p_y − q_y), q what the head predicts on the
    node's data; a global head predicts about p̄, so an honest Δb points along p − p̄ (cosine near
    1) and a reversed update against it (near −1). 0 when either vector is zero (no signal).
    """
    return cosine(centred_distribution, bias_update)


def head_update_believed(
    bias_update: np.ndarray,
    centred_distribution: np.ndarray | None,
    previous_bias_update: np.ndarray | None,
    bound: float = 0.0,
) -> tuple[bool, dict[str, float]]:
    """Whether a node's head update is believed, and its agreement with each witness there is:
    the distribution the node was placed by (`head_agreement`) and the node's previous head
    update, cos(Δb, Δb_prev). It is believed unless it agrees with none of them (every
    agreement below `bound`; with no witness at all it is believed).

    Two witnesses, so that one wrong one costs little: a node placed by a distribution that
    misleads (its stage-1 reply was itself reversed) is believed again from its second head
    update on, by its first; a node placed without a distribution is checked by its own history.
    """
    agreements = {}
    if centred_distribution is not None:
        agreements["distribution"] = head_agreement(centred_distribution, bias_update)
    if previous_bias_update is not None:
        agreements["previous"] = cosine(previous_bias_update, bias_update)
    return believed(agreements, bound), agreements


def nearest_profile(inferred: np.ndarray, inferred_mean: np.ndarray, profiles: Mapping[int, np.ndarray]) -> int:
    """The cluster whose profile (the mean centred P^ID of its trusted members) is most like a
    node's centred P^ID, by cosine; ties go to the lower cluster."""
    q = np.asarray(inferred, dtype=np.float64) - inferred_mean
    scores = {cluster: cosine(q, profile) for cluster, profile in sorted(profiles.items())}
    return max(scores, key=lambda cluster: (scores[cluster], -cluster))


def nearest_cluster(point: np.ndarray, centres: np.ndarray) -> int:
    """Index of the centre nearest (Euclidean) to `point`; ties go to the lower index."""
    return int(np.argmin(np.linalg.norm(np.asarray(centres) - np.asarray(point), axis=1)))


def _distinct_count(points: np.ndarray) -> int:
    return len(np.unique(np.round(points, 12), axis=0))


def _with_mean_centres(
    points: np.ndarray, labels: np.ndarray, requested: int, inertias: tuple[float, ...] = ()
) -> Clustering:
    """Relabel the non-empty clusters 0 … k-1 (order kept) and set centres to member means."""
    used, compact = np.unique(labels, return_inverse=True)
    centres = np.stack([points[compact == c].mean(axis=0) for c in range(len(used))])
    return Clustering(compact.astype(np.int64), centres, requested, inertias)
