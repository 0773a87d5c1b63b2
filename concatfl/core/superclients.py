"""FedSeq's superclients (Zaccone et al. 2022), as pure functions: approximate, compare, group.

Stage 1 of FedSeq turns every client's pre-trained model into a vector ψ_k that stands for its
label distribution, then groups clients into *superclients* whose merged data is as diverse as
possible. This module holds every step of that, with no Flower import:

* exemplars and the **confidence** approximator (`exemplar_indices`, `class_confidences`,
  `confidence_vector`): p_{k,c} is the mean probability client k's model gives class c on the
  server's class-c exemplars, normalized into a distribution;
* the **classifier-weights** approximator (`select_fc_layers`, `classifier_vector`,
  `reduce_pca`): the flattened fully-connected weights, reduced by PCA to 90 % of the variance;
* the **metrics** τ (`METRICS`, `dissimilarity`), all "larger = more different";
* the **groupings** φ (`greedy_grouping` with `merge_distribution`, `kmeans_grouping`,
  `random_grouping`, dispatched by `group_clients`) with the min-samples / max-clients
  stopping rule and the leftover rule (`absorb_leftovers`);
* the grouping-quality report (`balance_ratio`, `covered_classes`, `describe_superclients`,
  `single_client_relay`).

Clients are identified by their row index in the arrays passed in; a grouping is a list of
superclients, each a list of client indices.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from scipy.spatial import distance
from scipy.stats import wasserstein_distance
from sklearn.cluster import KMeans
from sklearn.decomposition import PCA
from sklearn.exceptions import ConvergenceWarning
from torch import nn

from .sequential import averaged_too_rarely

Grouping = list[list[int]]
Metric = Callable[[np.ndarray, np.ndarray], float]

GROUPINGS = ("greedy", "kmeans", "random")
GREEDY_MERGES = ("half", "weighted")
CLF_LAYERS = ("all", "last2", "last")
CONF_NORMALIZATIONS = ("sum", "softmax")
DISTRIBUTION_METRICS = ("kl", "wasserstein", "gini")  # the metrics τ that compare distributions
PCA_VARIANCE = 0.9
# Added to every probability before a KL divergence so that zeros (a class a model never
# predicts) give a large but finite divergence.
KL_SMOOTHING = 1e-6


# ---------------------------------------------------------------------- confidence approximator
def exemplar_indices(labels: np.ndarray, per_class: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of `per_class` random samples of every class (all of a smaller class)."""
    labels = np.asarray(labels)
    chosen = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        chosen.append(rng.choice(members, size=min(per_class, len(members)), replace=False))
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)


@torch.no_grad()
def class_confidences(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    normalization: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device | str = "cpu",
    batch_size: int = 512,
) -> np.ndarray:
    """p_c = mean probability `model` gives class c on the exemplars of class c (0 if none)."""
    model.to(device).eval()
    probs = []
    for start in range(0, len(x), batch_size):
        logits = model(normalization(x[start : start + batch_size]).to(device))
        probs.append(torch.softmax(logits.float(), dim=1).cpu())
    if not probs:
        return np.zeros(num_classes)
    own = torch.cat(probs).gather(1, y.long().view(-1, 1)).squeeze(1).double().numpy()
    labels = y.numpy()
    sums = np.bincount(labels, weights=own, minlength=num_classes)
    counts = np.bincount(labels, minlength=num_classes)
    return np.divide(sums, counts, out=np.zeros(num_classes), where=counts > 0)


def confidence_vector(confidences: np.ndarray, normalize: str = "sum") -> np.ndarray:
    """The confidence vector D̃_k: p_k scaled to sum to 1 (`sum`) or softmax(p_k) (paper's Eq. 3)."""
    p = np.asarray(confidences, dtype=np.float64)
    if normalize == "sum":
        total = p.sum()
        return p / total if total > 0 else np.full_like(p, 1.0 / len(p))
    if normalize == "softmax":
        shifted = np.exp(p - p.max())
        return shifted / shifted.sum()
    raise ValueError(f"normalize must be one of {CONF_NORMALIZATIONS}, got {normalize!r}")


# ---------------------------------------------------------------------- classifier approximator
def select_fc_layers(layer_names: Sequence[str], which: str) -> list[str]:
    """The fully-connected layers ψ = clf reads: `all`, the last two (`last2`) or the `last`."""
    if which not in CLF_LAYERS:
        raise ValueError(f"clf layers must be one of {CLF_LAYERS}, got {which!r}")
    names = list(layer_names)
    return names if which == "all" else names[-(2 if which == "last2" else 1) :]


def classifier_vector(state: Mapping[str, np.ndarray], layers: Sequence[str]) -> np.ndarray:
    """All parameters (weights and biases) of `layers`, flattened in state-dict order."""
    prefixes = tuple(f"{layer}." for layer in layers)
    parts = [np.asarray(value, dtype=np.float64).ravel() for key, value in state.items() if key.startswith(prefixes)]
    if not parts:
        raise ValueError(f"no parameters of layers {list(layers)} in the state dict")
    return np.concatenate(parts)


def reduce_pca(vectors: np.ndarray, variance: float = PCA_VARIANCE, seed: int = 0) -> tuple[np.ndarray, float]:
    """PCA projection keeping at least `variance` of the explained variance, and that fraction.

    With fewer than two clients there is nothing to reduce: the vectors come back unchanged.
    """
    vectors = np.asarray(vectors, dtype=np.float64)
    if len(vectors) < 2 or np.allclose(vectors, vectors[0]):
        return vectors, 1.0
    pca = PCA(n_components=variance, svd_solver="full", random_state=seed)
    reduced = pca.fit_transform(vectors)
    return reduced, float(pca.explained_variance_ratio_.sum())


# ---------------------------------------------------------------------- metrics τ
def kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p ‖ q) of two distributions, both smoothed by `KL_SMOOTHING` and renormalized."""
    p = np.asarray(p, dtype=np.float64) + KL_SMOOTHING
    q = np.asarray(q, dtype=np.float64) + KL_SMOOTHING
    p, q = p / p.sum(), q / q.sum()
    return float(np.sum(p * np.log(p / q)))


def cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    """1 − cos(a, b)."""
    return float(distance.cosine(a, b))


def euclidean_distance(a: np.ndarray, b: np.ndarray) -> float:
    """‖a − b‖₂."""
    return float(distance.euclidean(a, b))


def class_wasserstein(p: np.ndarray, q: np.ndarray) -> float:
    """Earth mover's distance between two distributions over the class index 0, 1, …, C−1."""
    classes = np.arange(len(p))
    return float(wasserstein_distance(classes, classes, u_weights=p, v_weights=q))


def gini_index(p: np.ndarray) -> float:
    """Gini coefficient of a distribution: 0 when uniform, (C−1)/C when one-hot."""
    p = np.asarray(p, dtype=np.float64)
    total = p.sum()
    if total <= 0:
        return 0.0
    return float(np.abs(p[:, None] - p[None, :]).sum() / (2 * len(p) * total))


def gini_merge_score(a: np.ndarray, b: np.ndarray) -> float:
    """1 − Gini(½a + ½b): larger when merging b into a gives a more uniform distribution.

    Greedy merges as D_S ← ½·D_S + ½·D̃_j, so this ranks candidates by the Gini index of the
    very distribution the merge would produce.
    """
    return 1.0 - gini_index(0.5 * np.asarray(a) + 0.5 * np.asarray(b))


METRICS: dict[str, Metric] = {
    "kl": kl_divergence,
    "cosine": cosine_distance,
    "euclidean": euclidean_distance,
    "wasserstein": class_wasserstein,
    "gini": gini_merge_score,
}


def dissimilarity(metric: str, candidate: np.ndarray, superclient: np.ndarray) -> float:
    """τ(D̃_j, D_S) for the metric named `metric` (larger = a better addition)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {tuple(METRICS)}, got {metric!r}")
    return METRICS[metric](candidate, superclient)


# ---------------------------------------------------------------------- groupings φ
def _open(samples: float, members: int, min_samples: int, max_clients: int) -> bool:
    """The shared stopping rule: a superclient keeps growing while both limits allow it."""
    return samples < min_samples and members < max_clients


def merge_distribution(
    merged: np.ndarray, samples: float, added: np.ndarray, added_samples: float, how: str
) -> np.ndarray:
    """D_S after adding a client: `half` = ½·D_S + ½·D̃_j (paper's Alg. 3), `weighted` =
    (N_S·D_S + n_j·D̃_j) / (N_S + n_j), the estimated distribution of the merged data."""
    if how == "half":
        return 0.5 * merged + 0.5 * added
    if how == "weighted":
        return (samples * merged + added_samples * added) / (samples + added_samples)
    raise ValueError(f"merge must be one of {GREEDY_MERGES}, got {how!r}")


def greedy_grouping(
    vectors: np.ndarray,
    sizes: Sequence[int],
    metric: str,
    min_samples: int,
    max_clients: int,
    rng: np.random.Generator,
    merge: str = "half",
) -> Grouping:
    """Paper's Alg. 3: seed with a random client, then add the most different one, repeatedly.

    D_S starts as the seed's vector; each added client j is argmax_j τ(D̃_j, D_S) over the
    remaining clients (ties: the lowest index), then D_S is updated by `merge_distribution`.
    With `half` the weight of the first members halves at every addition, so after ~7 clients
    a class covered early can look as absent as an uncovered one; `weighted` does not forget.

    Each addition ranks every remaining client at once (`CandidateScores`: a few numpy
    operations over all of them) and evaluates τ by its scalar definition only for the
    clients that rounding could still make the best: the choices, ties included, are those of
    evaluating τ for every client, at O(n) numpy work per addition instead of O(n) Python calls
    (10,000 clients group in seconds, not minutes).
    """
    vectors = np.asarray(vectors, dtype=np.float64)
    candidates = CandidateScores(metric, vectors, sizes, merge)
    remaining = list(range(len(vectors)))  # ascending, as the estimates' clients
    groups: Grouping = []
    while remaining:
        seed = remaining.pop(int(rng.integers(len(remaining))))
        candidates.remove(seed)
        group, merged, samples = [seed], vectors[seed].copy(), sizes[seed]
        while remaining and _open(samples, len(group), min_samples, max_clients):
            chosen = candidates.most_different(merged, samples)
            remaining.pop(bisect.bisect_left(remaining, chosen))
            candidates.remove(chosen)
            group.append(chosen)
            merged = merge_distribution(merged, samples, vectors[chosen], sizes[chosen], merge)
            samples += sizes[chosen]
        groups.append(group)
    return absorb_leftovers(groups, sizes, min_samples, max_clients)


# Rounding slack of the estimates, per unit of a score's scale and per term summed (16 units in the
# last place: several times the worst case of the sums and products involved).
ROUNDING = 8 * np.finfo(np.float64).eps
# Added to every bound, so that scores near zero (underflowing terms) never escape it.
ROUNDING_FLOOR = 1e-150


class CandidateScores:
    """The greedy grouping's choice among the remaining clients: argmax_j τ(D̃_j, D_S).

    `most_different` estimates τ for every remaining client with a few numpy operations, each
    estimate with a bound on how far rounding can put it from the scalar metric's value
    (`METRICS`, or the Gini score of the merge): KL as Σp·log p − p·log q with the first sum
    computed once per client, cosine and Euclidean from row-wise products, Wasserstein from
    the cumulative distributions, Gini from the sorted candidate merges. A client whose
    estimate plus its bound falls below the largest estimate minus its bound cannot be the
    best; the few that can (usually one) are scored by the scalar definition, and the best of
    them (ties: the lowest index) is chosen, exactly as scoring every client would choose.

    Clients with identical inputs get identical scalar scores, so each distinct input is
    scored once (one-class clients tie by the hundreds). Vectors outside what the estimates
    cover (non-finite values; negative entries or a zero sum for the distribution metrics
    `kl`, `wasserstein` and `gini`) are scored by the scalar definition for every client, which
    also raises the scalar metric's own errors.

    Raises ValueError for an unknown `metric` or `merge`.
    """

    def __init__(self, metric: str, vectors: np.ndarray, sizes: Sequence[int], merge: str) -> None:
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {tuple(METRICS)}, got {metric!r}")
        if merge not in GREEDY_MERGES:
            raise ValueError(f"merge must be one of {GREEDY_MERGES}, got {merge!r}")
        self.metric, self.merge = metric, merge
        self.vectors = np.asarray(vectors, dtype=np.float64)
        self.sizes = sizes
        n = len(self.vectors)
        self.clients = np.arange(n)
        self._alive = np.ones(n, dtype=bool)
        self._rows: dict[str, np.ndarray] = self._prepare() if self._estimable() else {}

    # ------------------------------------------------------------------ bookkeeping
    def remove(self, client: int) -> None:
        """`client` joined a superclient: it is no candidate any more."""
        self._alive[np.searchsorted(self.clients, client)] = False
        if 2 * np.count_nonzero(self._alive) < len(self._alive):  # keep the arrays about as long as the candidates
            keep = self._alive
            self.clients = self.clients[keep]
            self._rows = {name: rows[keep] for name, rows in self._rows.items()}
            self._alive = np.ones(len(self.clients), dtype=bool)

    def most_different(self, merged: np.ndarray, samples: float) -> int:
        """The remaining client the scalar τ(D̃_j, D_S) ranks first (ties: the lowest index)."""
        clients = self.clients[self._alive]
        finalists = clients
        if self._rows:
            values, errors = self._estimate(merged, samples)
            values, errors = values[self._alive], errors[self._alive]
            if np.isfinite(values).all() and np.isfinite(errors).all():
                finalists = clients[values + errors >= np.max(values - errors)]
        if len(finalists) == 1:
            return int(finalists[0])
        # Identical inputs score identically: one scalar evaluation per distinct input.
        inputs = self.vectors[finalists]
        if self.metric == "gini" and self.merge == "weighted":
            inputs = np.column_stack([inputs, np.asarray(self.sizes, dtype=np.float64)[finalists]])
        distinct, first, inverse = np.unique(
            np.ascontiguousarray(inputs).view(f"V{inputs.shape[1] * 8}").ravel(), return_index=True, return_inverse=True
        )
        scores = np.array([self._scalar(int(finalists[i]), merged, samples) for i in first])[inverse.ravel()]
        assert len(distinct) == len(first)
        return int(finalists[int(np.argmax(scores))])

    def _scalar(self, client: int, merged: np.ndarray, samples: float) -> float:
        """τ of one client by the definition (what every estimate is checked against)."""
        if self.metric == "gini":  # the Gini index of the merge this grouping would really make
            return 1.0 - gini_index(merge_distribution(merged, samples, self.vectors[client], self.sizes[client], self.merge))
        return dissimilarity(self.metric, self.vectors[client], merged)

    # ------------------------------------------------------------------ estimates
    def _estimable(self) -> bool:
        if not np.isfinite(self.vectors).all():
            return False
        if self.metric in DISTRIBUTION_METRICS:
            return bool((self.vectors >= 0).all() and (self.vectors.sum(axis=1) > 0).all())
        return True

    def _prepare(self) -> dict[str, np.ndarray]:
        """Per-client arrays the estimates reuse at every addition."""
        v = self.vectors
        if self.metric == "kl":
            p = v + KL_SMOOTHING
            p = p / p.sum(axis=1, keepdims=True)
            log_p = np.log(p)
            return {"p": p, "entropy": np.sum(p * log_p, axis=1), "scale": np.sum(p * np.abs(log_p), axis=1)}
        if self.metric == "cosine":
            return {"v": v, "abs": np.abs(v), "squares": np.einsum("ij,ij->i", v, v)}
        if self.metric == "wasserstein":
            cumulative = np.cumsum(v, axis=1)
            return {"cdf": cumulative[:, :-1] / cumulative[:, -1:]}
        if self.metric == "gini":
            return {"v": v, "sizes": np.asarray(self.sizes, dtype=np.float64)}
        return {"v": v}  # euclidean

    def _estimate(self, merged: np.ndarray, samples: float) -> tuple[np.ndarray, np.ndarray]:
        """(estimate of τ, bound on |estimate − scalar τ|) for every row."""
        rows, classes = self._rows, len(merged)
        if self.metric == "kl":
            q = np.asarray(merged, dtype=np.float64) + KL_SMOOTHING
            log_q = np.log(q / q.sum())
            values = rows["entropy"] - rows["p"] @ log_q
            errors = ROUNDING * (classes + 4) * (rows["scale"] + rows["p"] @ np.abs(log_q) + 1.0)
        elif self.metric == "cosine":
            m = np.asarray(merged, dtype=np.float64)
            norms = np.sqrt(rows["squares"] * float(m @ m))
            with np.errstate(divide="ignore", invalid="ignore"):  # a zero vector: not finite, scored exactly
                values = np.clip(1.0 - (rows["v"] @ m) / norms, 0.0, 2.0)
                errors = ROUNDING * (classes + 4) * ((rows["abs"] @ np.abs(m)) / norms + 1.0)
        elif self.metric == "euclidean":
            difference = rows["v"] - merged
            values = np.sqrt(np.einsum("ij,ij->i", difference, difference))
            errors = ROUNDING * (classes + 4) * values
        elif self.metric == "wasserstein":
            cumulative = np.cumsum(merged)
            gaps = np.abs(rows["cdf"] - cumulative[:-1] / cumulative[-1])
            values = gaps.sum(axis=1)
            errors = ROUNDING * (2 * classes + 4) * (values + 2.0 * classes)
        else:  # gini of each candidate merge, from its sorted values: Σ_a,b |x_a − x_b| = 2·Σ_i (2i − C + 1)·x_(i)
            if self.merge == "half":
                merges = 0.5 * merged + 0.5 * rows["v"]
            else:
                weights = rows["sizes"][:, None]
                merges = (samples * merged + weights * rows["v"]) / (samples + weights)
            ranks = 2.0 * np.arange(classes) - classes + 1
            merges.sort(axis=1)
            # Non-negative merges (`_estimable`): Σ|x| is the total, so the bound is relative to 1.
            gini = (merges @ ranks) / (classes * merges.sum(axis=1))
            values = 1.0 - gini
            errors = ROUNDING * (classes * classes + classes + 4) * (1.0 + np.abs(gini))
        return values, errors + ROUNDING_FLOOR


def kmeans_grouping(
    vectors: np.ndarray,
    sizes: Sequence[int],
    num_clusters: int,
    min_samples: int,
    max_clients: int,
    rng: np.random.Generator,
) -> Grouping:
    """Paper's Alg. 2: K-means on the vectors, then superclients drawn across the clusters.

    K-means uses k = min(num_clusters, clients) (FedSeq takes the number of classes). Each
    superclient is filled with one random client of cluster j at a time, j ← (j+1) mod k,
    skipping emptied clusters; j carries on from one superclient to the next.
    """
    vectors = np.asarray(vectors, dtype=np.float64)
    k = min(num_clusters, len(vectors))
    if k == 0:
        return []
    with warnings.catch_warnings():
        # Fewer distinct vectors than k (e.g. identical clients) only leaves clusters empty.
        warnings.simplefilter("ignore", ConvergenceWarning)
        labels = KMeans(n_clusters=k, n_init=10, random_state=int(rng.integers(2**31))).fit_predict(vectors)
    clusters = [list(np.flatnonzero(labels == j)) for j in range(k)]
    groups: Grouping = []
    j = 0
    while any(clusters):
        group: list[int] = []
        samples = 0
        while any(clusters) and _open(samples, len(group), min_samples, max_clients):
            while not clusters[j]:
                j = (j + 1) % k
            chosen = int(clusters[j].pop(int(rng.integers(len(clusters[j])))))
            group.append(chosen)
            samples += sizes[chosen]
            j = (j + 1) % k
        groups.append(group)
    return absorb_leftovers(groups, sizes, min_samples, max_clients)


def random_grouping(
    sizes: Sequence[int], min_samples: int, max_clients: int, rng: np.random.Generator
) -> Grouping:
    """Clients in random order, cut into superclients by the same stopping rule."""
    groups: Grouping = []
    group: list[int] = []
    samples = 0
    for client in rng.permutation(len(sizes)):
        group.append(int(client))
        samples += sizes[client]
        if not _open(samples, len(group), min_samples, max_clients):
            groups.append(group)
            group, samples = [], 0
    if group:
        groups.append(group)
    return absorb_leftovers(groups, sizes, min_samples, max_clients)


def absorb_leftovers(groups: Grouping, sizes: Sequence[int], min_samples: int, max_clients: int) -> Grouping:
    """The leftover rule: a last superclient below `min_samples` is dissolved.

    Its clients go, one by one, to the superclient that has the fewest samples at that moment
    among those with fewer than `max_clients` clients (ties: the earliest). Clients for which
    no superclient has room stay together as the last superclient: max-clients bounds the
    length of a chain, so it wins over min-samples. A single superclient is never dissolved.
    """
    if len(groups) < 2 or sum(sizes[c] for c in groups[-1]) >= min_samples:
        return [list(group) for group in groups]
    kept = [list(group) for group in groups[:-1]]
    stranded: list[int] = []
    for client in groups[-1]:
        room = [i for i, group in enumerate(kept) if len(group) < max_clients]
        if not room:
            stranded.append(client)
            continue
        target = min(room, key=lambda i: (sum(sizes[c] for c in kept[i]), i))
        kept[target].append(client)
    return kept + [stranded] if stranded else kept


def fitting_superclient(
    vector: np.ndarray | None,
    estimates: Mapping[int, np.ndarray | None],
    samples: Mapping[int, int],
    members: Mapping[int, int],
    metric: str,
    max_clients: int,
) -> int | None:
    """The superclient a client that arrives after the grouping joins, or None when all are full.

    Candidates are the superclients with fewer than `max_clients` members (a chain's length
    stays bounded). With an approximation D̃_j (`vector`) the client joins the candidate whose
    estimated distribution D_S (`estimates[s]`, None when no member had one) it differs from
    most by the greedy grouping's τ (`metric`): the superclient that lacks its classes most.
    Without one, or when no candidate has an estimate, it joins the candidate with the fewest
    `samples`. Ties go to the lowest id.
    """
    candidates = sorted(sid for sid in members if members[sid] < max_clients)
    if not candidates:
        return None
    scored = [sid for sid in candidates if estimates.get(sid) is not None]
    if vector is not None and scored:
        scores = [dissimilarity(metric, vector, estimates[sid]) for sid in scored]  # type: ignore[arg-type]
        return scored[int(np.argmax(scores))]
    return min(candidates, key=lambda sid: (samples[sid], sid))


def group_clients(
    method: str,
    vectors: np.ndarray,
    sizes: Sequence[int],
    *,
    metric: str,
    num_clusters: int,
    min_samples: int,
    max_clients: int,
    rng: np.random.Generator,
    merge: str = "half",
) -> Grouping:
    """Dispatch to the grouping named `method` (`greedy`, `kmeans` or `random`)."""
    if method == "greedy":
        return greedy_grouping(vectors, sizes, metric, min_samples, max_clients, rng, merge)
    if method == "kmeans":
        return kmeans_grouping(vectors, sizes, num_clusters, min_samples, max_clients, rng)
    if method == "random":
        return random_grouping(sizes, min_samples, max_clients, rng)
    raise ValueError(f"grouping must be one of {GROUPINGS}, got {method!r}")


# ---------------------------------------------------------------------- grouping quality
def single_client_relay(groups: Grouping, min_samples: int) -> str | None:
    """Why FedSeqInter does not fit `groups`, or None: at least half the superclients are one
    client each (clients that hold `min_samples` alone). FedSeq trains such a superclient as a
    FedAvg client; FedSeqInter carries each of its models from one client to the next for N_S
    rounds, every hop taken whole, before averaging them: FedCat with K = N and no damping."""
    singles = sum(len(group) == 1 for group in groups)
    if not groups or 2 * singles < len(groups):
        return None
    return (
        f"{singles} of {len(groups)} superclients are single clients (they hold min-samples={min_samples} samples "
        f"alone): each model travels from client to client for {len(groups)} rounds, every hop taken whole, before "
        "the models are averaged; on CIFAR-10 with 10 clients of 4,000 images this ended at chance where FedAvg "
        "reached 0.35-0.43 (docs/results.md). Use FedSeq (a single-client superclient trains as a FedAvg client) "
        "or a larger min_samples"
    )


def slots_judged_late(num_superclients: int, num_rounds: int) -> str | None:
    """Why no check can judge a FedSeqInter run early, or None: its slots are averaged every N_S
    rounds, N_S = `num_superclients` (`core.sequential.averaged_too_rarely`)."""
    if (reason := averaged_too_rarely("the slots (one per superclient)", num_superclients, num_rounds)) is None:
        return None
    return (
        f"{reason}; with 39 superclients of 100 clients of 400 images, 20 rounds ended at 0.127 on CIFAR-10 and "
        "0.530 on Fashion-MNIST (#C=2, seed 0), where FedAvg with every node reached 0.169 and 0.607 "
        "(docs/results.md). Use FedSeq, more rounds, or a larger min_samples (fewer superclients)"
    )


def balance_ratio(class_counts: np.ndarray) -> float:
    """min_c N_c / max_c N_c: 1 for perfectly balanced data, 0 when a class is missing."""
    counts = np.asarray(class_counts, dtype=np.float64)
    top = counts.max() if counts.size else 0.0
    return float(counts.min() / top) if top > 0 else 0.0


def covered_classes(class_counts: np.ndarray, min_share: float = 0.0) -> list[int]:
    """Classes whose share of the samples is above `min_share` (0: any sample at all)."""
    counts = np.asarray(class_counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return []
    return [int(c) for c in np.flatnonzero(counts / total > min_share)]


def describe_superclients(
    groups: Grouping, sizes: Sequence[int], class_counts: np.ndarray, min_share: float = 0.0
) -> list[dict[str, Any]]:
    """Per superclient: clients, samples, balance ratio and covered classes (JSON-ready).

    `class_counts[k]` is client k's per-class sample count: the true label counts, or the
    estimate n_k·D̃_k from the confidence vectors (then pass a `min_share` such as half the
    uniform share, because an estimate is never exactly zero).
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    described = []
    for group in groups:
        merged = counts[group].sum(axis=0)
        classes = covered_classes(merged, min_share)
        described.append(
            {
                "clients": len(group),
                "samples": int(sum(sizes[c] for c in group)),
                "balance_ratio": round(balance_ratio(merged), 4),
                "covered_classes": len(classes),
                "classes": classes,
            }
        )
    return described
