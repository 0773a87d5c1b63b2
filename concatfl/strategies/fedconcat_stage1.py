"""FedConcat's stage 1 beside the strategy: the label-distribution query, the check of what comes
back, and the record of the clusters it made (metrics.json's `setup`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, RecordDict

from ..core.clustering import Clustering
from ..protocol import DP_EPSILON, LABELS_MESSAGE_TYPE
from .common import CONFIG_KEY, HopResult, Request

# A reported distribution's entries must sum to 1 within this (clients send float64 values).
DISTRIBUTION_TOLERANCE = 1e-6
# With ε-DP, an entry may stray this many noise scales (1/ε) from [0, 1]: P = e^-40 ≈ 4e-18 each.
DP_NOISE_BOUND = 40.0


def label_requests(nodes: list[int], dp_epsilon: float) -> list[Request]:
    """Stage 1-A's query to every node: its label distribution, with Laplace(1/ε) noise when ε > 0."""
    return [
        Request(
            node,
            RecordDict({CONFIG_KEY: ConfigRecord({DP_EPSILON: dp_epsilon})}),
            LABELS_MESSAGE_TYPE,
            tag="labels",
            require_num_examples=False,
        )
        for node in nodes
    ]


def distribution_problem(values: Any, num_classes: int, dp_epsilon: float) -> str | None:
    """Why a reported label distribution is unusable, or None.

    It must be `num_classes` finite numbers. Without noise (ε = 0) they are probabilities:
    each ≥ 0 and their sum 1 (within DISTRIBUTION_TOLERANCE). With Laplace(1/ε) noise on each
    entry an honest report can be negative and sum to anything, but no entry strays more than
    DP_NOISE_BOUND/ε from [0, 1] (a probability of e^-DP_NOISE_BOUND per entry).
    """
    if not isinstance(values, list) or len(values) != num_classes:
        return f"must be a list of {num_classes} numbers, got {values!r}"
    distribution = np.asarray(values, dtype=np.float64)
    if not np.isfinite(distribution).all():
        return f"must be finite, got {values!r}"
    if dp_epsilon > 0:
        slack = DP_NOISE_BOUND / dp_epsilon
        if distribution.min() < -slack or distribution.max() > 1 + slack:
            return f"strays beyond [-{slack:g}, {1 + slack:g}] (more than Laplace noise at epsilon {dp_epsilon:g} does)"
        return None
    if distribution.min() < -DISTRIBUTION_TOLERANCE:
        return f"has a negative entry ({distribution.min():g})"
    if abs(distribution.sum() - 1.0) > DISTRIBUTION_TOLERANCE:
        return f"sums to {distribution.sum():g}, not 1"
    return None


def stage1_record(
    hops: Sequence[HopResult], clustering: Clustering, assignment: Mapping[int, int], distributions: Mapping[int, np.ndarray]
) -> dict[str, Any]:
    """What stage 1 did, JSON-ready: its hops, the clusters (members, centres), the distributions
    clustered on."""
    clusters = []
    for cluster in range(clustering.k):
        members = sorted(node for node, assigned in assignment.items() if assigned == cluster)
        centre = [round(float(p), 6) for p in clustering.centres[cluster]]
        clusters.append({"cluster": cluster, "members": members, "size": len(members), "centre": centre})
    return {
        "stage1": [hop.as_record() for hop in hops],
        "bytes_sent": sum(hop.bytes_sent for hop in hops),
        "bytes_received": sum(hop.bytes_received for hop in hops),
        "k_requested": clustering.requested,
        "k": clustering.k,
        "elbow_inertias": list(clustering.inertias),
        "clusters": clusters,
        "distributions": {str(node): [round(float(p), 6) for p in distributions[node]] for node in sorted(distributions)},
    }
