"""FedConcat and FedConcat-ID (Diao et al.): cluster, FedAvg inside clusters, concatenate, post-train.

Three stages, all driven by one `FedConcat` strategy:

1. **Clustering** (in `setup`, before round 1). FedConcat asks every node for its label
   distribution (a ``"query.fedconcat_labels"`` message, optionally ε-DP); FedConcat-ID
   (`label_inference=True`) runs one round of ordinary training from the initial model instead
   and infers P^ID from each returned model on random inputs. K-means groups the distributions
   (`core.clustering`). With `label_check` (the default) FedConcat also runs FedConcat-ID's
   training round and checks every report against its node's P^ID (`core.clustering.agreement`):
   a report that disagrees is not clustered on, and its node joins the cluster its P^ID fits.
2. **Encoder rounds** (rounds 1 … T_e). K copies of the initial model, one per cluster, each
   trained by FedAvg over its own members; all clusters advance in the same round (one hop in
   which each node receives its cluster's model). Aggregation is weighted by num-examples.
3. **Classifier rounds** (rounds T_e+1 … T_e+T_c). The K encoders are concatenated and frozen
   (`core.concat.ConcatModel`); a node receives them once (``"train.fedconcat_features"``),
   caches its features, and from then on only the linear classifier goes down and comes back
   (``"train.fedconcat_head"``). The messages are specified in `concatfl.protocol`; the client
   side is `concatfl.fedconcat_client`.

Communication, for model size w, N nodes, classifier fraction c (classifier size / model
size) and full participation, is the paper's 2wN(T_e + K/2 + cKT_c): 2wN per encoder round,
K·w·N once for the encoder broadcast and 2·cKw·N per classifier round. Every round's record
says its stage and bytes per stage (`stage_bytes`); `bytes_by_stage` holds the running totals.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore import log
from torch import nn

from ..config import DEFAULT_ROUND_TIMEOUT
from ..core.clustering import (
    agreement,
    assign_clusters,
    head_update_believed,
    infer_label_distribution,
    nearest_cluster,
    nearest_profile,
)
from ..core.concat import (
    CLASSIFIER_BIAS,
    CLASSIFIER_WEIGHT,
    DEFAULT_HEAD,
    ConcatModel,
    check_head,
    classifier_from_heads,
    concat_state_dict,
    concatenate,
    is_concat_state,
    num_encoders,
    save_concat_model,
    split_model,
)
from ..core.memory import UpdateMemory
from ..models import resolve_model_name
from ..protocol import (
    CACHE_MISS,
    CLASSIFIER_STEPS,
    ENCODERS_ID,
    ENCODERS_KEY,
    FEATURES_MESSAGE_TYPE,
    HEAD_MESSAGE_TYPE,
    HEAD_NAME,
    LABEL_DISTRIBUTION,
    MODEL_NAME,
    NUM_ENCODERS,
)
from ..training import Normalization
from .base import EvaluateFn, RelayStrategy
from .common import (
    CONFIG_KEY,
    fingerprint,
    NUM_EXAMPLES_KEY,
    HopResult,
    Reply,
    Request,
    live_node_ids,
    sample_nodes,
    to_numpy,
    to_record,
    train_content,
)
from .aggregation import Aggregation, as_aggregation, from_config as aggregation_from_config
from .fedavg import sample_count
from .feddyn import FedDynServer, from_config as feddyn_from_config
from .fedconcat_stage1 import distribution_problem, label_requests, stage1_record
from .guard import DEFAULT_UPDATE_CLIP, DEFAULT_WEIGHT_CLIP
from .membership import RETURNED, START

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..runtime import ServerEnv

MODEL_FILE = "fedconcat_model.pt"

# Hop kinds, which are also the keys of the per-stage byte counts.
ENCODER_TRAINING = "encoder-training"
ENCODER_BROADCAST = "encoder-broadcast"
CLASSIFIER = "classifier"
STAGES = (ENCODER_TRAINING, ENCODER_BROADCAST, CLASSIFIER)

# What a run needs beyond the strategy, told with every model error.
REQUIREMENTS = (
    "FedConcat needs a model whose forward ends with a linear head, `return self.<head>(features)`, "
    "named by FedConcat(head=...) (default 'classifier', concatfl's own models), and a ClientApp that "
    "answers FedConcat's messages with the handlers of concatfl.fedconcat_client (label query, "
    "features, head training) besides its ordinary train handler; see docs/strategies.md, "
    "'FedConcat with your own model'"
)
# Random inputs on which the server checks the split of `make_model()` at the head.
SPLIT_CHECK_SIZE = 2
# A reported label distribution whose agreement with its node's P^ID is below this is not
# believed. Measured on digits (10 clients, one local epoch, lr 0.01 and 0.05; #C=2, #C=3,
# Dir(0.1), Dir(0.5), Dir(1)): honest reports scored 0.88–0.99, one-hot lies on a class the
# client holds less than 20 % of at most 0.44 (docs/strategies.md).
AGREEMENT_BOUND = 0.5
# A head update whose bias moves against both the distribution its node was placed by and the
# node's previous head update is rejected (`core.clustering.head_update_believed`). Measured on
# digits (10 clients of two classes, 30 % of replies fuzzed, ten seeds each of FedConcat and
# FedConcat-ID, before the check): against the distribution, 961 honest head updates scored
# −0.04 (one) and 0.30–1.00 (median 0.89), 50 sign-flipped ones −0.99 to −0.48; against the
# previous update, 1,127 honest ones after an honest one −0.61 to 1.00 (6 below 0, median 0.88),
# 57 sign-flipped ones after an honest one −0.99 to −0.28.
HEAD_AGREEMENT_BOUND = 0.0
HEAD_ONLY = "head"  # where a node that joins during the classifier rounds goes
LABELS_DISAGREE = "its reported label distribution disagrees with its model"


@dataclass
class _ClassifierRound:
    """What one classifier round has done so far (it may take several hops on cache misses)."""

    chosen: list[int]
    start: ArrayRecord
    broadcast: set[int] = field(default_factory=set)
    trained: set[int] = field(default_factory=set)
    replies: list[Reply] = field(default_factory=list)
    cache_misses: list[int] = field(default_factory=list)
    head_agreements: dict[int, dict[str, float]] = field(default_factory=dict)
    head_rejected: list[int] = field(default_factory=list)


class FedConcat(RelayStrategy):
    """FedConcat / FedConcat-ID: clustered FedAvg of encoders, then a global head on their concatenation.

    The run's model is any whose forward ends with a linear layer, the head (`head`); the rest is
    the encoder (docs/strategies.md, "FedConcat with your own model", says what a user's model
    and ClientApp need). `start()` checks the model before anything is sent, then runs
    `encoder_rounds` + `classifier_rounds` rounds whatever `num_rounds` says (logged). During
    the encoder rounds the returned global model is the ensemble of the cluster models (a
    ConcatModel whose head sums their logits), so the per-round accuracy is that ensemble's;
    during the classifier rounds it is the ConcatModel being trained. `global_module` rebuilds
    it.

    Parameters
    ----------
    label_inference : bool (default: False)
        False: FedConcat, clients report label distributions. True: FedConcat-ID, the server
        infers them from one round of ordinary local training (needs `make_model` and
        `input_shape`).
    num_clusters : int | None (default: 5)
        K for K-means; None chooses K by the elbow rule (`core.clustering.elbow`). K never
        exceeds the number of distinct distributions; clusters left empty are dropped (logged).
    balanced : bool (default: False)
        The paper's balanced variant: no cluster above 1.2 × the average size.
    dp_epsilon : float (default: 0.0)
        > 0: clients add Laplace(0, 1/ε) noise to their label distributions (FedConcat only).
    label_check : bool | None (default: None)
        None: True when `make_model` and `input_shape` are given (as concatfl's ServerApp gives
        them), else False (logged). FedConcat only: check every reported distribution p against
        P^ID q of a model the node
        trained one round from the initial model (stage 1 sends that round as FedConcat-ID
        does: 2wN more bytes), by the agreement cos(p − p̄, q − q̄). Only reports with an
        agreement of at least AGREEMENT_BOUND are clustered; a node whose report disagrees, or
        who sent none, joins the cluster whose trusted members' P^ID its own is most like
        (`core.clustering.nearest_profile`); recorded under ``label_check``. False is the
        paper's algorithm (and cost) exactly.
    id_samples : int (default: 10000)
        Random inputs per model for FedConcat-ID's label inference.
    encoder_rounds : int (default: 10)
        T_e, FedAvg rounds inside the clusters.
    classifier_rounds : int (default: 20)
        T_c, rounds of classifier post-training.
    classifier_steps : int (default: 3)
        Mini-batch SGD steps per client per classifier round.
    init_classifier : bool (default: False)
        True: start the classifier from the cluster heads (weights concatenated, biases
        summed); False: nn.Linear's default random init drawn from the strategy's generator.
    head_memory : bool (default: True)
        True: the classifier rounds aggregate the latest head update of every node heard from
        so far (`core.memory`): a node whose reply is lost, or that was not sampled, counts
        with its last update instead of not at all, so the head does not turn away from the
        classes of whichever nodes the round missed. With every reply arriving and full
        participation it is the plain average. False: the paper's average of the round's
        replies only.
    head_check : bool (default: True)
        True: a head update whose bias moves against both the label distribution its node was
        placed by (the believed report, else its P^ID; FedConcat-ID: its P^ID) and the node's
        previous head update (`core.clustering.head_update_believed`, agreements below
        HEAD_AGREEMENT_BOUND) is rejected like a lost reply (recorded per round under
        ``head_check``): under label skew a reversed update of a node's classes undoes their
        training by the others in that round. A node placed without a distribution (none
        given, or joined during the classifier rounds) is checked by its previous update only;
        a node's first head update without a distribution is taken. False: every bounded head
        reply is averaged, as in the paper.
    fraction_train : float (default: 1.0)
        Fraction of nodes sampled per round: inside each cluster in the encoder rounds, among
        all clustered nodes in the classifier rounds (at least one node either way).
    aggregation : str | Aggregation (default: "mean")
        How a cluster's encoder-round models, and the classifier rounds' heads, are combined
        (see `FedAvg`; FedDyn's cluster step uses it in place of the mean).
    feddyn : FedDynServer | None (default: None)
        With ``local-objective='feddyn'``: FedDyn inside each cluster's FedAvg. Every cluster
        keeps its own h (a copy of this one's settings; m = the cluster's size) and its encoder
        rounds ask the members for FedDyn's objective. FedConcat-ID's label-inference round
        trains with plain SGD: its models only serve to infer distributions, and a g_k moved
        there would have no server step to match. The head trains on cached features as always.
    head : str (default: "classifier")
        Name of the model's head, the nn.Linear its forward ends with: state keys
        ``<head>.weight`` (num_classes × feature_dim) and ``<head>.bias``, e.g. ``"fc3"`` for
        Flower's quickstart CNN; its input is the encoder's output, the features.
        `concatfl.models`' architectures need no argument. Sent to the clients with the
        encoders.
    model_name : str (default: "")
        `concatfl.models` name of the run's architecture; sent to clients so they can rebuild
        the encoders, and written into the saved model file. "" for a user's own model (the
        ClientApp then passes its `make_model` to `concatfl.fedconcat_client.handle_features`).
    input_shape : Sequence[int] | None (default: None)
        Shape of one input as the model takes it before `normalization`: (C, H, W) for images,
        (F,) for flat features, any other for other models; needed for label inference and for
        saving the model. With `make_model`, `start()` also checks the head on random inputs of
        this shape.
    normalization : Callable[[torch.Tensor], torch.Tensor] | None (default: None)
        Maps a batch of inputs drawn uniformly from [0, 1] to the model's inputs for label
        inference (None: fed as drawn); a `Normalization` is also saved with the model.
    make_model : Callable[[], nn.Module] | None (default: None)
        A fresh model of the run's architecture; needed for label inference, `evaluate_model`
        and `global_module`.
    evaluate_model : Callable[[nn.Module], tuple[float, float]] | None (default: None)
        (loss, accuracy) of a module on the global test set; when given, every cluster model is
        evaluated at the end of the encoder stage (recorded as ``cluster_evaluation``).
    device : torch.device | str (default: "cpu")
        Where label inference runs.
    output_path : str | Path | None (default: None)
        Where the final ConcatModel is saved when the run ends (`core.concat.save_concat_model`).
    round_timeout, seed, update_clip, weight_clip
        See `RelayStrategy`. Federated evaluation is not offered: a client's evaluate handler
        knows the run's model, not the concatenated one; the server evaluates it instead. The
        bounds apply to FedConcat-ID's label-inference models (before inference), the encoder
        rounds (a reference per cluster) and the head rounds (a reference of their own).

    Raises ValueError at construction for invalid settings, and in `start()`, before any
    message, when `initial_arrays` has no linear head `head` (the message lists the model's
    keys, the layer that looks like its head, and what FedConcat needs from the model and the
    ClientApp) or when `make_model()`'s output is not its head applied to the head's input.

    Faults: a missing, failed or rejected reply is left out of its aggregation in every stage;
    in the classifier rounds, with `head_memory`, its node's last accepted head update counts in
    its place (recorded per round under ``head_memory``: fresh updates, nodes replayed, oldest
    round replayed), and with `head_check` a head update that moves the bias against both its
    node's distribution and its previous head update is rejected. A round without any accepted
    head reply keeps the classifier.
    A reported label distribution must be `num_classes` finite numbers, non-negative and summing
    to 1 (with ε-DP noise: finite and within the noise's range, `distribution_problem`); any
    other is rejected, and a well-formed one that its node's own model contradicts is not
    believed (`label_check`): it joins the cluster its P^ID fits. A node that gives no usable
    distribution in stage 1 goes through stage 1 once more right after it, as a node that
    joins; failing again, it joins the cluster its P^ID fits when it has one, else the cluster
    whose centre is nearest to the average clustered distribution, so its data still trains an
    encoder and the head.

    Nodes without a place (`RelayStrategy.place`, recorded under ``placements``): a node that
    connects during the encoder rounds goes through stage 1 alone (its query and, with
    `label_check` or FedConcat-ID, its training round from the initial model) at the start of
    the round in which it is first seen and joins the cluster nearest to its distribution (by
    the same rules, without re-clustering the others); one that connects during the classifier
    rounds trains the head on its features like every node (``{"head": true}``). A returning
    node keeps its cluster. A node whose feature cache is gone
    answers a classifier message with a cache miss; the server re-sends the encoders to it and
    then the classifier, within the same round (once per round).
    Classifier aggregation is the num-examples-weighted average of the returned heads (the
    FedAvg weighting the paper uses for every averaging step).
    """

    # pylint: disable=too-many-arguments, too-many-locals, too-many-instance-attributes
    def __init__(
        self,
        *,
        label_inference: bool = False,
        num_clusters: int | None = 5,
        balanced: bool = False,
        dp_epsilon: float = 0.0,
        label_check: bool | None = None,
        id_samples: int = 10_000,
        encoder_rounds: int = 10,
        classifier_rounds: int = 20,
        classifier_steps: int = 3,
        init_classifier: bool = False,
        head_memory: bool = True,
        head_check: bool = True,
        fraction_train: float = 1.0,
        aggregation: str | Aggregation = "mean",
        feddyn: FedDynServer | None = None,
        head: str = DEFAULT_HEAD,
        model_name: str = "",
        input_shape: Sequence[int] | None = None,
        normalization: Callable[[torch.Tensor], torch.Tensor] | None = None,
        make_model: Callable[[], nn.Module] | None = None,
        evaluate_model: Callable[[nn.Module], tuple[float, float]] | None = None,
        device: torch.device | str = "cpu",
        output_path: str | Path | None = None,
        round_timeout: float | None = None,
        seed: int = 0,
        update_clip: float = DEFAULT_UPDATE_CLIP,
        weight_clip: float = DEFAULT_WEIGHT_CLIP,
    ) -> None:
        # No history check (`core.witness`): a cluster's model fits its few members' classes within
        # a few rounds, and their updates then swing about it (ten clean runs of the robustness
        # bench: 80 of 1,000 honest encoder updates would have been rejected, cosines to −0.74);
        # the head's updates have a check of their own (`head_check`).
        super().__init__(0.0, round_timeout, seed, update_clip, weight_clip, history_check=False)
        if num_clusters is not None and num_clusters < 1:
            raise ValueError(f"num_clusters must be >= 1 or None (elbow), got {num_clusters}")
        if min(encoder_rounds, classifier_rounds, classifier_steps, id_samples) < 1:
            raise ValueError(
                "encoder_rounds, classifier_rounds, classifier_steps and id_samples must be >= 1"
            )
        if dp_epsilon < 0:
            raise ValueError(f"dp_epsilon must be >= 0, got {dp_epsilon}")
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        if not head or head.startswith(".") or head.endswith("."):
            raise ValueError(f"head must name the model's last linear layer, e.g. 'fc3', got {head!r}")
        if label_inference and (make_model is None or input_shape is None):
            raise ValueError("label_inference needs make_model and input_shape (one input's shape, e.g. (64,))")
        can_infer = make_model is not None and input_shape is not None
        if label_check is None:
            label_check = can_infer
            if not can_infer and not label_inference:
                log(INFO, "FedConcat: reported label distributions are not checked (label_check needs make_model and "
                    "input_shape)")
        if label_check and not label_inference and not can_infer:
            raise ValueError(
                "label_check needs make_model and input_shape (one input's shape, e.g. (64,)) to infer each "
                "node's label distribution from its model; pass them, or label_check=False"
            )
        if evaluate_model is not None and make_model is None:
            raise ValueError("evaluate_model needs make_model")
        if output_path is not None and (not model_name or input_shape is None):
            raise ValueError("saving the model (output_path) needs model_name and input_shape")
        self.label_inference = label_inference
        self.num_clusters = num_clusters
        self.balanced = balanced
        self.dp_epsilon = dp_epsilon
        self.label_check = label_check
        self.id_samples = id_samples
        self.encoder_rounds = encoder_rounds
        self.classifier_rounds = classifier_rounds
        self.classifier_steps = classifier_steps
        self.init_classifier = init_classifier
        self.head_memory = head_memory
        self.head_check = head_check
        self.fraction_train = fraction_train
        self.aggregation = as_aggregation(aggregation)
        self.feddyn = feddyn
        self.head = head
        self.model_name = model_name
        self.input_shape = None if input_shape is None else tuple(int(d) for d in input_shape)
        self.normalization = normalization
        self.make_model = make_model
        self.evaluate_model = evaluate_model
        self.device = torch.device(device)
        self.output_path = None if output_path is None else Path(output_path)
        # Stage state (all of it in state_dict()).
        self.assignment: dict[int, int] = {}
        self.head_nodes: set[int] = set()  # joined during the classifier rounds: they train the head only
        self.cluster_models: list[ArrayRecord] = []
        self.cluster_updates: list[int] = []  # stage-2 aggregations per cluster
        self.cluster_feddyn: list[FedDynServer] = []  # FedDyn's h of each cluster
        self.encoders: ArrayRecord | None = None
        self.encoders_id = ""
        self.classifier: ArrayRecord | None = None
        self.cached: set[int] = set()
        self.head_updates = UpdateMemory()  # every node's latest head update, with `head_memory`
        self.bytes_by_stage: dict[str, dict[str, int]] = {s: {"sent": 0, "received": 0} for s in STAGES}
        # Within-round bookkeeping (rounds are never checkpointed half-way).
        self._hop_kind = ""
        self._round_bytes: dict[str, dict[str, int]] = {}
        self._classifier_round: _ClassifierRound | None = None
        # What placing a node after stage 1 needs (in state_dict()): the initial model, the
        # clusters' centres (in the clustered space), their trusted members' P^ID profiles, the
        # means the agreement is measured around, and the cluster nearest to the average.
        self._initial: ArrayRecord | None = None
        self._centres = np.zeros((0, 0))
        self._profiles: dict[int, np.ndarray] = {}
        self._label_means: dict[str, np.ndarray] = {}  # "reported", "inferred": stage 1's means
        self._fallback = 0
        # The head check's evidence (in state_dict()): each node's centred distribution, the one
        # it was placed by.
        self._class_profiles: dict[int, np.ndarray] = {}
        self._last_head_bias: dict[int, np.ndarray] = {}  # each node's latest head reply's bias update, taken or not

    @property
    def _means(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(p̄, q̄), the means the label check's agreement is measured around: stage 1 had both
        reports and P^ID (FedConcat with the label check), else None."""
        if "reported" in self._label_means and "inferred" in self._label_means:
            return self._label_means["reported"], self._label_means["inferred"]
        return None

    @property
    def num_rounds(self) -> int:
        """T_e + T_c: the rounds FedConcat runs."""
        return self.encoder_rounds + self.classifier_rounds

    def stage(self, server_round: int) -> str:
        """``"encoders"`` for rounds 1 … T_e, ``"classifier"`` after."""
        return "encoders" if server_round <= self.encoder_rounds else "classifier"

    # ------------------------------------------------------------------ stage 1
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
        self.cluster_models = [initial_arrays] * clustering.k
        self.cluster_updates = [0] * clustering.k
        if self.feddyn is not None:
            self.cluster_feddyn = self._fresh_cluster_feddyn(clustering.k)
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
        num_classes, _ = check_head(_shapes(self._initial), self.head)
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
                model.load_state_dict(reply.arrays.to_torch_state_dict())
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

    # ------------------------------------------------------------------ membership
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

    # ------------------------------------------------------------------ rounds
    def train_requests(
        self, server_round: int, hop: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Request]:
        """Encoder rounds: one hop, each sampled node gets its cluster's model. Classifier rounds:
        the encoders to sampled nodes without features, then the classifier to those with."""
        if hop == 0:
            self._round_bytes = {}
            self.record("stage", self.stage(server_round))
        if server_round <= self.encoder_rounds:
            return self._encoder_requests(server_round, config, grid) if hop == 0 else []
        if hop == 0:
            self._begin_classifier_round(server_round, grid)
        return self._classifier_requests(server_round, config)

    def _encoder_requests(self, server_round: int, config: ConfigRecord, grid: Grid) -> list[Request]:
        live = set(live_node_ids(grid))
        settings = {**dict(config), "server-round": server_round}
        if self.feddyn is not None:
            settings.update(self.feddyn.settings())
        requests, selected = [], {}
        for cluster, model in enumerate(self.cluster_models):
            members = self.awake(node for node in self.members(cluster) if node in live)
            if not members:
                continue
            chosen = self._sample(members)
            selected[str(cluster)] = chosen
            requests += [Request(node, train_content(model, settings), tag=cluster) for node in chosen]
        self._hop_kind = ENCODER_TRAINING
        self.record("stage_round", server_round)
        self.record("selected", selected)
        return requests

    def _sample(self, nodes: list[int]) -> list[int]:
        """A sorted random `fraction_train` sample of `nodes` (at least one; none of none)."""
        return (
            sorted(sample_nodes(self.rng, nodes, sample_count(self.fraction_train, len(nodes))))
            if nodes
            else []
        )

    def _begin_classifier_round(self, server_round: int, grid: Grid) -> None:
        if self.classifier is None:
            self._concatenate()
        assert self.classifier is not None
        live = set(live_node_ids(grid))
        chosen = self._sample(self.awake(node for node in sorted(self.assignment.keys() | self.head_nodes) if node in live))
        self._classifier_round = _ClassifierRound(chosen, self.classifier)
        self.record("stage_round", server_round - self.encoder_rounds)
        self.record("selected", chosen)

    def _classifier_requests(self, server_round: int, config: ConfigRecord) -> list[Request]:
        plan = self._classifier_round
        assert plan is not None and self.encoders is not None
        need_features = [
            node for node in plan.chosen if node not in self.cached and node not in plan.broadcast
        ]
        if need_features:
            plan.broadcast.update(need_features)
            self._hop_kind = ENCODER_BROADCAST
            settings: dict[str, Any] = {
                MODEL_NAME: self.model_name,
                NUM_ENCODERS: len(self.cluster_models),
                ENCODERS_ID: self.encoders_id,
                HEAD_NAME: self.head,
                "server-round": server_round,
            }
            return [
                Request(
                    node,
                    RecordDict({ENCODERS_KEY: self.encoders, CONFIG_KEY: ConfigRecord(settings)}),
                    FEATURES_MESSAGE_TYPE,
                    tag=ENCODER_BROADCAST,
                )
                for node in need_features
            ]
        ready = [node for node in plan.chosen if node in self.cached and node not in plan.trained]
        if ready:
            plan.trained.update(ready)
            self._hop_kind = CLASSIFIER
            settings = {
                **dict(config),
                "server-round": server_round,
                CLASSIFIER_STEPS: self.classifier_steps,
                ENCODERS_ID: self.encoders_id,
            }
            return [
                Request(node, train_content(plan.start, settings), HEAD_MESSAGE_TYPE, tag=CLASSIFIER)
                for node in ready
            ]
        return []

    def aggregate_hop(
        self, server_round: int, hop: HopResult
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Cluster FedAvg, feature-cache bookkeeping or classifier averaging, by hop kind."""
        self._count_bytes(hop)
        if self._hop_kind == ENCODER_TRAINING:
            return self._aggregate_encoders(server_round, hop)
        if self._hop_kind == ENCODER_BROADCAST:
            self.cached.update(reply.node_id for reply in hop.replies)
            return None, None
        return self._aggregate_classifier(server_round, hop)

    def _aggregate_encoders(
        self, server_round: int, hop: HopResult
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        bounded = []
        streams = [f"cluster-{cluster}" for cluster in range(len(self.cluster_models))]
        for cluster, stream in enumerate(streams):
            # Each cluster's members are measured against each other: clusters differ in data,
            # and so in how far an ordinary round moves their model. A cluster with fewer than two
            # lengths so far (one member, its earlier replies lost) is measured with the others.
            replies = self.guard.bound(
                [reply for reply in hop.replies if reply.request.tag == cluster], stream=stream, peers=streams
            )
            bounded += replies
            if replies:
                models = [r.numpy() for r in replies]
                average = self.aggregation.combine(models, [r.num_examples for r in replies])
                if self.cluster_feddyn:
                    members = len(self.members(cluster))
                    average = self.cluster_feddyn[cluster].step(self.cluster_models[cluster], models, average, members)
                self.cluster_models[cluster] = average
                self.cluster_updates[cluster] += 1
        if self.cluster_feddyn:
            self.record("feddyn_h_norm", [server.h_norm for server in self.cluster_feddyn])
        if server_round == self.encoder_rounds and self.evaluate_model is not None:
            self.record("cluster_evaluation", self._evaluate_clusters())
        if not bounded:
            return None, None
        metrics = aggregate_metricrecords([reply.content for reply in bounded], NUM_EXAMPLES_KEY)
        return self._ensemble(), metrics

    def _aggregate_classifier(self, server_round: int, hop: HopResult) -> tuple[ArrayRecord | None, MetricRecord | None]:
        plan = self._classifier_round
        assert plan is not None
        missed = [reply.node_id for reply in hop.replies if reply.metrics.get(CACHE_MISS)]
        for node in missed:
            self.cached.discard(node)
            plan.trained.discard(node)
        trained = self.guard.bound([reply for reply in hop.replies if not reply.metrics.get(CACHE_MISS)], stream="head")
        if self.head_check:
            trained = self._check_heads(hop, plan, trained)
        plan.replies += trained
        if missed:
            log(WARNING, "Nodes %s have no feature cache; the encoders are sent to them again", missed)
            plan.cache_misses += missed
            self.record("cache_misses", sorted(plan.cache_misses))
        if not plan.replies:
            return None, None
        self.classifier = self._combine_heads(server_round, plan, trained)
        metrics = aggregate_metricrecords([reply.content for reply in plan.replies], NUM_EXAMPLES_KEY)
        return self._concat_arrays(), metrics

    def _check_heads(self, hop: HopResult, plan: _ClassifierRound, replies: list[Reply]) -> list[Reply]:
        """`replies` without the head updates that are not believed (rejected); every
        agreement is recorded under ``head_check``."""
        before = plan.start[CLASSIFIER_BIAS].numpy()
        kept = []
        for reply in replies:
            node, update = reply.node_id, reply.arrays[CLASSIFIER_BIAS].numpy() - before
            believed, agreements = head_update_believed(
                update, self._class_profiles.get(node), self._last_head_bias.get(node), HEAD_AGREEMENT_BOUND
            )
            self._last_head_bias[node] = update
            plan.head_agreements[node] = {witness: round(value, 4) for witness, value in agreements.items()}
            if believed:
                kept.append(reply)
                continue
            plan.head_rejected.append(node)
            self.reject(hop, reply, f"its head update moves the bias against the label distribution it was placed by "
                        f"and its previous head update (agreements {plan.head_agreements[node]}, bound {HEAD_AGREEMENT_BOUND})")
        self.record("head_check", {
            "bound": HEAD_AGREEMENT_BOUND,
            "agreement": {str(node): value for node, value in sorted(plan.head_agreements.items())},
            "rejected": sorted(plan.head_rejected),
        })
        return kept

    def _combine_heads(self, server_round: int, plan: _ClassifierRound, fresh: list[Reply]) -> ArrayRecord:
        """The round's classifier: its replies aggregated, or with the head memory every
        remembered node's latest update applied to the round's start and aggregated."""
        if not self.head_memory:
            return self.aggregation.combine([r.numpy() for r in plan.replies], [r.num_examples for r in plan.replies])
        start = to_numpy(plan.start)
        for reply in fresh:
            self.head_updates.remember(reply.node_id, start, reply.numpy(), reply.num_examples, server_round)
        self.record("head_memory", self.head_updates.summary(server_round))
        return self.aggregation.combine(*self.head_updates.models(start))

    def _count_bytes(self, hop: HopResult) -> None:
        totals = self.bytes_by_stage[self._hop_kind]
        totals["sent"] += hop.bytes_sent
        totals["received"] += hop.bytes_received
        this_round = self._round_bytes.setdefault(self._hop_kind, {"sent": 0, "received": 0})
        this_round["sent"] += hop.bytes_sent
        this_round["received"] += hop.bytes_received
        self.record("stage_bytes", copy.deepcopy(self._round_bytes))
        self.record("bytes_by_stage", copy.deepcopy(self.bytes_by_stage))

    # ------------------------------------------------------------------ models
    def _cluster_states(self) -> list[dict[str, torch.Tensor]]:
        return [model.to_torch_state_dict() for model in self.cluster_models]

    def _ensemble(self) -> ArrayRecord:
        """The cluster models as one ConcatModel whose head sums their logits."""
        states = self._cluster_states()
        return ArrayRecord(concat_state_dict(states, classifier_from_heads(states, self.head), self.head))

    def _fresh_cluster_feddyn(self, count: int) -> list[FedDynServer]:
        """One FedDyn server state (h = 0) per cluster, with the run's α and keys."""
        assert self.feddyn is not None
        return [FedDynServer(self.feddyn.alpha, self.feddyn.keys) for _ in range(count)]

    def _concatenate(self) -> None:
        """Start of stage 3: freeze the encoders, initialize the classifier, fingerprint the encoders.

        A cluster none of whose members ever replied in stage 2 still holds the initial weights:
        its encoder is left out (K shrinks, logged), unless no cluster trained at all.
        """
        untrained = [cluster for cluster, count in enumerate(self.cluster_updates) if count == 0]
        if untrained and len(untrained) < len(self.cluster_models):
            log(WARNING, "Stage 3: clusters %s never trained in stage 2; their encoders are left out", untrained)
            self.record("untrained_clusters", untrained)
            trained = [cluster for cluster, count in enumerate(self.cluster_updates) if count > 0]
            self.cluster_models = [self.cluster_models[cluster] for cluster in trained]
            self.cluster_updates = [self.cluster_updates[cluster] for cluster in trained]
            self.cluster_feddyn = [self.cluster_feddyn[cluster] for cluster in trained] if self.cluster_feddyn else []
        random_head = None
        if not self.init_classifier:
            random_head = torch.Generator().manual_seed(int(self.rng.integers(2**63)))
        encoders, classifier = concatenate(self._cluster_states(), self.head, random_head)
        self.encoders, self.classifier = ArrayRecord(encoders), ArrayRecord(classifier)
        self.encoders_id = fingerprint(self.encoders)
        log(
            INFO,
            "Stage 3: %d encoders concatenated (classifier %s, init %s)",
            len(self.cluster_models),
            tuple(self.classifier[CLASSIFIER_WEIGHT].shape),
            "from cluster heads" if self.init_classifier else "random",
        )

    def _concat_arrays(self) -> ArrayRecord:
        assert self.encoders is not None and self.classifier is not None
        return ArrayRecord({**dict(self.encoders.items()), **dict(self.classifier.items())})

    def _evaluate_clusters(self) -> list[dict[str, Any]]:
        assert self.make_model is not None and self.evaluate_model is not None
        results = []
        for cluster, arrays in enumerate(self.cluster_models):
            model = self.make_model()
            model.load_state_dict(arrays.to_torch_state_dict())
            loss, accuracy = self.evaluate_model(model)
            results.append({"cluster": cluster, "accuracy": accuracy, "loss": loss})
            log(INFO, "Stage 2: cluster %d model accuracy %.4f", cluster, accuracy)
        return results

    def global_module(self, arrays: ArrayRecord, make_model: Callable[[], nn.Module]) -> nn.Module:
        """A ConcatModel for FedConcat's global arrays (the plain model for the initial ones)."""
        if not is_concat_state(arrays.keys()):
            return super().global_module(arrays, make_model)
        count = num_encoders(list(arrays.keys()))
        model = self.reusable_module(
            f"concat-{count}", make_model, lambda: ConcatModel.from_factory(make_model, count, self.head)
        )
        model.load_state_dict(arrays.to_torch_state_dict())
        return model

    def save_model(self, path: str | Path) -> Path:
        """Write the current ConcatModel to `path` (loadable with `core.concat.load_concat_model`)."""
        assert self.input_shape is not None
        mean = std = None
        if isinstance(self.normalization, Normalization):
            mean, std = self.normalization.mean, self.normalization.std
        return save_concat_model(
            path,
            self._concat_arrays().to_torch_state_dict(),
            model_name=self.model_name,
            input_shape=self.input_shape,
            mean=mean,
            std=std,
        )

    # ------------------------------------------------------------------ Flower entry point and state
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = DEFAULT_ROUND_TIMEOUT,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> Result:
        """Check the model, run T_e + T_c rounds (`num_rounds` is not used), then save the model
        to `output_path`."""
        self.check_model(initial_arrays)
        if num_rounds != self.num_rounds:
            log(
                INFO,
                "FedConcat runs its own %d rounds (%d encoder + %d classifier); num_rounds=%d is not used",
                self.num_rounds,
                self.encoder_rounds,
                self.classifier_rounds,
                num_rounds,
            )
        result = super().start(
            grid, initial_arrays, self.num_rounds, timeout, train_config, evaluate_config, evaluate_fn
        )
        if self.output_path is not None and self.classifier is not None:
            log(INFO, "FedConcat model saved to %s", self.save_model(self.output_path))
        return result

    def check_model(self, initial_arrays: ArrayRecord) -> None:
        """Raise ValueError, saying what FedConcat needs, unless the model splits at `head`.

        Checks the shapes of `initial_arrays` (unless they are a ConcatModel's, as a resumed run
        passes) and, with `make_model` and `input_shape`, that ``head(encoder(x)) == model(x)``
        on random inputs (the global torch RNG is left as it was).
        """
        try:
            if not is_concat_state(initial_arrays.keys()):
                check_head(_shapes(initial_arrays), self.head)
            if self.make_model is not None and self.input_shape is not None:
                generator = torch.Generator().manual_seed(0)
                sample = torch.rand((SPLIT_CHECK_SIZE, *self.input_shape), generator=generator)
                if self.normalization is not None:
                    sample = self.normalization(sample)
                with torch.random.fork_rng(devices=[]):  # building a model must not move the run's RNG
                    split_model(self.make_model(), self.head, sample)
        except ValueError as error:
            raise ValueError(
                f"FedConcat cannot split the model into encoder and head: {error}. {REQUIREMENTS}"
            ) from None

    def state_dict(self) -> dict[str, Any]:
        """Base state plus clusters, cluster models, encoders, classifier, caches, byte counts."""
        state = super().state_dict()
        state["fedconcat"] = {
            "assignment": dict(self.assignment),
            "head_nodes": sorted(self.head_nodes),
            "initial": None if self._initial is None else to_numpy(self._initial),
            "centres": self._centres.copy(),
            "profiles": {cluster: profile.copy() for cluster, profile in self._profiles.items()},
            "fallback": self._fallback,
            "label_means": {source: mean.copy() for source, mean in self._label_means.items()},
            "class_profiles": {node: profile.copy() for node, profile in self._class_profiles.items()},
            "last_head_bias": {node: update.copy() for node, update in self._last_head_bias.items()},
            "cluster_models": [to_numpy(model) for model in self.cluster_models],
            "cluster_updates": list(self.cluster_updates),
            "cluster_feddyn": [server.state_dict() for server in self.cluster_feddyn],
            "encoders": None if self.encoders is None else to_numpy(self.encoders),
            "encoders_id": self.encoders_id,
            "classifier": None if self.classifier is None else to_numpy(self.classifier),
            "cached": sorted(self.cached),
            "head_updates": self.head_updates.state_dict(),
            "bytes_by_stage": copy.deepcopy(self.bytes_by_stage),
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        super().load_state_dict(state)
        saved = state["fedconcat"]
        self.assignment = {int(node): int(cluster) for node, cluster in saved["assignment"].items()}
        self.head_nodes = {int(node) for node in saved["head_nodes"]}
        self._initial = None if saved["initial"] is None else to_record(saved["initial"])
        self._centres = np.asarray(saved["centres"], dtype=np.float64)
        self._profiles = {int(cluster): np.asarray(profile, dtype=np.float64) for cluster, profile in saved["profiles"].items()}
        self._fallback = int(saved["fallback"])
        self._label_means = {source: np.asarray(mean, dtype=np.float64) for source, mean in saved["label_means"].items()}
        self._class_profiles = {int(node): np.asarray(profile, dtype=np.float64) for node, profile in saved["class_profiles"].items()}
        self._last_head_bias = {int(node): np.asarray(update) for node, update in saved["last_head_bias"].items()}
        self.cluster_models = [to_record(arrays) for arrays in saved["cluster_models"]]
        self.cluster_updates = list(saved["cluster_updates"])
        if self.feddyn is not None:
            self.cluster_feddyn = self._fresh_cluster_feddyn(len(saved["cluster_feddyn"]))
            for server, server_state in zip(self.cluster_feddyn, saved["cluster_feddyn"]):
                server.load_state_dict(server_state)
        self.encoders = None if saved["encoders"] is None else to_record(saved["encoders"])
        self.encoders_id = saved["encoders_id"]
        self.classifier = None if saved["classifier"] is None else to_record(saved["classifier"])
        self.cached = set(saved["cached"])
        self.head_updates.load_state_dict(saved["head_updates"])
        self.bytes_by_stage = copy.deepcopy(saved["bytes_by_stage"])


def _shapes(arrays: ArrayRecord) -> dict[str, tuple[int, ...]]:
    return {key: tuple(int(d) for d in array.shape) for key, array in arrays.items()}


def build(config: RunConfig, env: ServerEnv) -> FedConcat:
    """FedConcat (`strategy='fedconcat'`) or FedConcat-ID (`'fedconcat-id'`) from the run config."""
    if config.fraction_evaluate > 0:
        log(WARNING, "FedConcat ignores fraction-evaluate: the concatenated model is evaluated on the server")
    return FedConcat(
        label_inference=config.strategy == "fedconcat-id",
        num_clusters=config.fedconcat_num_clusters,
        balanced=config.fedconcat_balanced,
        dp_epsilon=config.fedconcat_dp_epsilon,
        label_check=config.fedconcat_label_check,
        id_samples=config.fedconcat_id_samples,
        encoder_rounds=config.fedconcat_encoder_rounds,
        classifier_rounds=config.fedconcat_classifier_rounds,
        classifier_steps=config.fedconcat_classifier_steps,
        init_classifier=config.fedconcat_init_classifier,
        head_memory=config.fedconcat_head_memory,
        head_check=config.fedconcat_head_check,
        fraction_train=config.fraction_train,
        aggregation=aggregation_from_config(config),
        feddyn=feddyn_from_config(config, env),
        model_name=resolve_model_name(config.model, config.dataset),
        input_shape=env.data.input_shape,
        normalization=env.normalization,
        make_model=env.make_model,
        evaluate_model=env.evaluate,
        device=env.device,
        output_path=Path(config.output_dir) / MODEL_FILE,
        round_timeout=config.timeout,
        seed=config.seed,
        update_clip=config.update_clip,
        weight_clip=config.weight_clip,
    )
