"""FedConcat's stage 1 and the placement of nodes: the label-distribution query (or FedConcat-ID's
inference of P^ID from one round of training), the check of what comes back, the clustering, and
where a node that joins later goes (`LabelClustering`, a part of `FedConcat`)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log
from torch import nn

from ..core.clustering import (
    Clustering,
    agreement,
    assign_clusters,
    infer_label_distribution,
    nearest_cluster,
    nearest_profile,
)
from ..core.concat import check_head
from ..protocol import DP_EPSILON, LABEL_DISTRIBUTION, LABELS_MESSAGE_TYPE
from .base import RelayStrategy
from .common import CONFIG_KEY, HopResult, Reply, Request, live_node_ids, to_numpy, to_record, torch_state, train_content
from .membership import RETURNED, START

if TYPE_CHECKING:
    from .feddyn import FedDynServer

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


# A reported label distribution whose agreement with its node's P^ID is below this is not
# believed. Measured on digits (10 clients, one local epoch, lr 0.01 and 0.05; #C=2, #C=3,
# Dir(0.1), Dir(0.5), Dir(1)): honest reports scored 0.88–0.99, one-hot lies on a class the
# client holds less than 20 % of at most 0.44 (docs/strategies.md).
AGREEMENT_BOUND = 0.5
HEAD_ONLY = "head"  # where a node that joins during the classifier rounds goes
LABELS_DISAGREE = "its reported label distribution disagrees with its model"


class LabelClustering(RelayStrategy):
    """FedConcat's stage 1 (`setup`) and its placement of nodes (`place`); the settings it reads
    (`label_inference`, `label_check`, `num_clusters`, …) are `FedConcat`'s parameters."""

    # pylint: disable=too-many-instance-attributes
    label_inference: bool
    label_check: bool
    num_clusters: int | None
    balanced: bool
    dp_epsilon: float
    id_samples: int
    encoder_rounds: int
    head: str
    input_shape: tuple[int, ...] | None
    normalization: Callable[[torch.Tensor], torch.Tensor] | None
    make_model: Callable[[], nn.Module] | None
    device: torch.device
    encoders: ArrayRecord | None
    feddyn: FedDynServer | None

    @abstractmethod
    def begin_encoder_stage(self, initial_arrays: ArrayRecord, num_clusters: int) -> None:
        """Give each of the `num_clusters` clusters stage 1 made its model, `initial_arrays`."""

    def init_label_clustering(self) -> None:
        """The stage's state, all of it in the strategy's `state_dict()`."""
        self.assignment: dict[int, int] = {}
        self.head_nodes: set[int] = set()  # joined during the classifier rounds: they train the head only
        # What placing a node after stage 1 needs: the initial model, the clusters' centres (in the
        # clustered space), their trusted members' P^ID profiles, the means the agreement is
        # measured around, and the cluster nearest to the average.
        self._initial: ArrayRecord | None = None
        self._centres = np.zeros((0, 0))
        self._profiles: dict[int, np.ndarray] = {}
        self._label_means: dict[str, np.ndarray] = {}  # "reported", "inferred": stage 1's means
        self._fallback = 0
        # The head check's evidence: each node's centred distribution, the one it was placed by.
        self._class_profiles: dict[int, np.ndarray] = {}

    @property
    def _means(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(p̄, q̄), the means the label check's agreement is measured around: stage 1 had both
        reports and P^ID (FedConcat with the label check), else None."""
        if "reported" in self._label_means and "inferred" in self._label_means:
            return self._label_means["reported"], self._label_means["inferred"]
        return None

    def setup(self, grid: Grid, initial_arrays: ArrayRecord, train_config: ConfigRecord) -> None:
        """Stage 1: collect (or infer) label distributions, check the reports, cluster the nodes."""
        nodes = live_node_ids(grid)
        self._initial, self._train_config = initial_arrays, train_config
        reported, inferred, hops = self._stage1(grid, nodes, placing=False)
        self._label_means = {
            source: np.mean(list(found.values()), axis=0)
            for source, found in (("reported", reported), ("inferred", inferred))
            if found
        }
        agreements: dict[int, float] = {}
        if self.label_inference:
            clustered = inferred
        elif self._means is not None:
            agreements = {node: agreement(reported[node], inferred[node], *self._means) for node in reported if node in inferred}
            clustered = {node: p for node, p in reported.items() if agreements.get(node, 1.0) >= AGREEMENT_BOUND}
        else:
            clustered = reported
        if not clustered:
            raise RuntimeError(f"stage 1: none of the {len(nodes)} nodes gave a label distribution to cluster on")
        stage1 = assign_clusters(
            clustered, sorted(clustered), self.num_clusters, balanced=self.balanced, seed=int(self.rng.integers(2**31))
        )
        self.assignment, clustering = dict(stage1.assignment), stage1.clustering
        self._centres = clustering.centres
        self._fallback = nearest_cluster(np.mean(list(clustered.values()), axis=0), clustering.centres)
        if self._means is not None:
            self._profiles = self._inferred_profiles(inferred)
        placements: list[dict[str, Any]] = []
        for node, cluster in self.assignment.items():
            self.settle(node, {"cluster": cluster}, START)
            self._keep_profile(node, "inferred" if self.label_inference else "reported", reported, inferred)
        for node in (node for node in agreements if node not in clustered):
            cluster, how = self._assign(node, reported, inferred)
            self.settle(node, {"cluster": cluster, "by": how}, LABELS_DISAGREE, placements)
        self.defer(node for node in nodes if node not in clustered and node not in agreements)
        if placements:
            log(WARNING, "Stage 1: nodes placed without a trusted distribution (node: cluster, by) %s",
                {entry["node"]: (entry["where"]["cluster"], entry["where"]["by"]) for entry in placements})
        if clustering.k < clustering.requested:
            log(
                WARNING,
                "Stage 1: %d of %d clusters were empty and are dropped; K = %d",
                clustering.requested - clustering.k,
                clustering.requested,
                clustering.k,
            )
        # Shared, never mutated: aggregation replaces a cluster's record with a new one.
        self.begin_encoder_stage(initial_arrays, clustering.k)
        for cluster in range(clustering.k):
            log(INFO, "Stage 1: cluster %d has %d nodes %s", cluster, len(self.members(cluster)), self.members(cluster))
        self.setup_record = {
            "variant": "fedconcat-id" if self.label_inference else "fedconcat",
            **stage1_record(hops, clustering, self.assignment, reported if not self.label_inference else inferred),
            "unreported_nodes": [node for node in nodes if node not in (inferred if self.label_inference else reported)],
            "balanced": self.balanced,
            "placements": placements,
        }
        if self._means is not None:
            self.setup_record["label_check"] = {
                "bound": AGREEMENT_BOUND,
                "agreement": {str(node): round(value, 4) for node, value in sorted(agreements.items())},
                "disagreeing": sorted(node for node, value in agreements.items() if value < AGREEMENT_BOUND),
                "unchecked": sorted(node for node in reported if node not in inferred),
                "inferred": {str(node): [round(float(q), 6) for q in inferred[node]] for node in sorted(inferred)},
            }

    def _stage1(
        self, grid: Grid, nodes: list[int], placing: bool
    ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray], list[HopResult]]:
        """Stage 1 for `nodes`: their reported distributions (FedConcat), their P^ID (FedConcat-ID,
        or FedConcat with the label check), and the hops that got them."""
        reported: dict[int, np.ndarray] = {}
        hops = []
        if not self.label_inference:
            query = self.hop(grid, label_requests(nodes, self.dp_epsilon), placing=placing)
            reported = self._read_distributions(query)
            hops.append(query)
        inferred: dict[int, np.ndarray] = {}
        if self.label_inference or self.label_check:
            training, inferred = self._infer_distributions(grid, nodes, placing)
            hops.append(training)
        return reported, inferred, hops

    def _read_distributions(self, hop: HopResult) -> dict[int, np.ndarray]:
        """The usable distributions of a label query's replies (the others are rejected)."""
        num_classes, _ = check_head(shapes(self._initial), self.head)
        distributions = {}
        for reply in list(hop.replies):
            values = reply.metrics.get(LABEL_DISTRIBUTION)
            problem = distribution_problem(values, num_classes, self.dp_epsilon)
            if problem is not None:
                self.reject(hop, reply, f"stage 1 '{LABEL_DISTRIBUTION}' {problem}")
                continue
            distributions[reply.node_id] = np.asarray(values, dtype=np.float64)
        return distributions

    def _infer_distributions(self, grid: Grid, nodes: list[int], placing: bool) -> tuple[HopResult, dict[int, np.ndarray]]:
        """Stage 1-B: one round of ordinary training from the initial model, then P^ID of every
        returned model (bounded first, as every reply is).

        Every model sees the same random inputs (one seed for the run), so differences in
        P^ID come from the models alone, also between stage 1 and nodes placed later. Each model
        is read as it arrives and let go (`RelayStrategy.hop`'s `digest`): 10,000 clients'
        models at once would not fit in memory.
        """
        assert self.make_model is not None and self.input_shape is not None and self._initial is not None
        settings = {**dict(self._train_config), "server-round": 0}
        if self.feddyn is not None:
            settings["local-objective"] = "sgd"
        distributions = {}

        def digest(replies: list[Reply]) -> None:
            for reply in self.guard.bound(replies, stream="label-inference"):
                model = self.make_model()
                model.load_state_dict(torch_state(reply.numpy()))
                distributions[reply.node_id] = infer_label_distribution(
                    model,
                    self.id_samples,
                    self.input_shape,
                    self.normalization,
                    torch.Generator().manual_seed(self.seed),
                    self.device,
                )

        hop = self.hop(
            grid,
            [Request(node, train_content(self._initial, settings), tag="label-inference") for node in nodes],
            placing=placing,
            digest=digest,
        )
        return hop, dict(sorted(distributions.items()))

    def _inferred_profiles(self, inferred: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Per cluster, the mean centred P^ID of its (trusted) members that have one."""
        assert self._means is not None
        profiles = {}
        for cluster in sorted(set(self.assignment.values())):
            rows = [inferred[node] - self._means[1] for node in self.members(cluster) if node in inferred]
            if rows:
                profiles[cluster] = np.mean(rows, axis=0)
        return profiles

    def _cluster_of(self, reported: np.ndarray | None, inferred: np.ndarray | None) -> tuple[int, str]:
        """(cluster, how it was chosen) for a node clustered after the others: by its report when
        it is believed, else by its P^ID, else the cluster nearest to the average."""
        if self.label_inference:
            if inferred is not None:
                return nearest_cluster(inferred, self._centres), "inferred"
            return self._fallback, "nearest to the mean"
        believed = reported is not None and (
            inferred is None or self._means is None or agreement(reported, inferred, *self._means) >= AGREEMENT_BOUND
        )
        if believed:
            assert reported is not None
            checked = inferred is not None and self._means is not None
            return nearest_cluster(reported, self._centres), "reported" if checked else "reported, unchecked"
        if inferred is not None and self._profiles:
            assert self._means is not None
            return nearest_profile(inferred, self._means[1], self._profiles), "inferred"
        return self._fallback, "nearest to the mean"

    def place(self, grid: Grid, nodes: list[int], why: str, server_round: int) -> dict[int, Any]:
        """A returning node keeps its place; a node that joins during the encoder rounds goes
        through stage 1 alone and joins the cluster its distribution fits (`_cluster_of`); one
        that joins during the classifier rounds trains the head."""
        if why == RETURNED:
            return {node: self.membership.places[node] for node in nodes}
        if self.encoders is not None or server_round > self.encoder_rounds:
            self.head_nodes.update(nodes)
            return {node: {HEAD_ONLY: True} for node in nodes}
        reported, inferred, _ = self._stage1(grid, nodes, placing=True)
        placed: dict[int, Any] = {}
        for node in nodes:
            cluster, how = self._assign(node, reported, inferred)
            placed[node] = {"cluster": cluster, "by": how}
        return placed

    def _assign(self, node: int, reported: dict[int, np.ndarray], inferred: dict[int, np.ndarray]) -> tuple[int, str]:
        """Put a node clustered after the others into the cluster its distribution fits
        (`_cluster_of`), keeping that distribution for the head check; (cluster, how)."""
        cluster, how = self._cluster_of(reported.get(node), inferred.get(node))
        self.assignment[node] = cluster
        self._keep_profile(node, how, reported, inferred)
        return cluster, how

    def _keep_profile(
        self, node: int, how: str, reported: dict[int, np.ndarray], inferred: dict[int, np.ndarray]
    ) -> None:
        """Keep the centred distribution `node` was placed by (`how`: "reported…" or
        "inferred"), which the head check measures its head updates against; none for a node
        placed without one."""
        source = "reported" if how.startswith("reported") else how
        found = {"reported": reported, "inferred": inferred}.get(source, {})
        if node in found:
            self._class_profiles[node] = found[node] - self._label_means[source]

    def members(self, cluster: int) -> list[int]:
        """Nodes of `cluster`, ascending."""
        return sorted(node for node, assigned in self.assignment.items() if assigned == cluster)


    def label_clustering_state(self) -> dict[str, Any]:
        """The stage's part of `state_dict()`."""
        return {
            "assignment": dict(self.assignment),
            "head_nodes": sorted(self.head_nodes),
            "initial": None if self._initial is None else to_numpy(self._initial),
            "centres": self._centres.copy(),
            "profiles": {cluster: profile.copy() for cluster, profile in self._profiles.items()},
            "fallback": self._fallback,
            "label_means": {source: mean.copy() for source, mean in self._label_means.items()},
            "class_profiles": {node: profile.copy() for node, profile in self._class_profiles.items()},
        }

    def load_label_clustering_state(self, saved: dict[str, Any]) -> None:
        """Restore `label_clustering_state()`'s part."""
        self.assignment = {int(node): int(cluster) for node, cluster in saved["assignment"].items()}
        self.head_nodes = {int(node) for node in saved["head_nodes"]}
        self._initial = None if saved["initial"] is None else to_record(saved["initial"])
        self._centres = np.asarray(saved["centres"], dtype=np.float64)
        self._profiles = {int(cluster): np.asarray(profile, dtype=np.float64) for cluster, profile in saved["profiles"].items()}
        self._fallback = int(saved["fallback"])
        self._label_means = {source: np.asarray(mean, dtype=np.float64) for source, mean in saved["label_means"].items()}
        self._class_profiles = {int(node): np.asarray(profile, dtype=np.float64) for node, profile in saved["class_profiles"].items()}


def shapes(arrays: ArrayRecord) -> dict[str, tuple[int, ...]]:
    """Each array's shape, by key."""
    return {key: tuple(int(d) for d in array.shape) for key, array in arrays.items()}
