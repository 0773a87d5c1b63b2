"""FedConcat and FedConcat-ID (Diao et al.): cluster, FedAvg inside clusters, concatenate, post-train.

Three stages, all driven by one `FedConcat` strategy:

1. **Clustering** (`setup`, before round 1; `fedconcat_stage1.LabelClustering`). FedConcat asks every node for its label
   distribution (a ``"query.fedconcat_labels"`` message, optionally ε-DP); FedConcat-ID
   (`label_inference=True`) runs one round of ordinary training from the initial model instead
   and infers P^ID from each returned model on random inputs. K-means groups the distributions
   (`core.clustering`). With `label_check` (the default) FedConcat also runs FedConcat-ID's
   training round and checks every report against its node's P^ID (`core.clustering.agreement`):
   a report that disagrees is not clustered on, and its node joins the cluster its P^ID fits.
2. **Encoder rounds** (rounds 1 … T_e). K copies of the initial model, one per cluster, each
   trained by FedAvg over its own members; all clusters advance in the same round (one hop in
   which each node receives its cluster's model). Aggregation is weighted by num-examples.
3. **Classifier rounds** (rounds T_e+1 … T_e+T_c; `fedconcat_head.ClassifierRounds`). The K encoders are concatenated and frozen
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
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore import log
from torch import nn

from ..config import DEFAULT_ROUND_TIMEOUT
from ..core.concat import DEFAULT_HEAD, classifier_from_heads, concat_state_dict
from ..models import resolve_model_name
from .aggregation import Aggregation, as_aggregation, from_config as aggregation_from_config
from .base import EvaluateFn
from .common import NUM_EXAMPLES_KEY, HopResult, Request, live_node_ids, to_numpy, to_record, train_content
from .fedconcat_head import CLASSIFIER, ENCODER_BROADCAST, ClassifierRounds
from .feddyn import FedDynServer, from_config as feddyn_from_config
from .guard import DEFAULT_UPDATE_CLIP, DEFAULT_WEIGHT_CLIP

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..runtime import ServerEnv

MODEL_FILE = "fedconcat_model.pt"

# The encoder rounds' hop kind; with the classifier stage's, the keys of the per-stage byte counts.
ENCODER_TRAINING = "encoder-training"
STAGES = (ENCODER_TRAINING, ENCODER_BROADCAST, CLASSIFIER)


class FedConcat(ClassifierRounds):
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
        # Each stage's state (all of it in state_dict()).
        self.init_label_clustering()
        self.cluster_models: list[ArrayRecord] = []
        self.cluster_updates: list[int] = []  # stage-2 aggregations per cluster
        self.cluster_feddyn: list[FedDynServer] = []  # FedDyn's h of each cluster
        self.init_classifier_rounds()
        self.bytes_by_stage: dict[str, dict[str, int]] = {s: {"sent": 0, "received": 0} for s in STAGES}
        # Within-round bookkeeping (rounds are never checkpointed half-way).
        self._hop_kind = ""
        self._round_bytes: dict[str, dict[str, int]] = {}

    @property
    def num_rounds(self) -> int:
        """T_e + T_c: the rounds FedConcat runs."""
        return self.encoder_rounds + self.classifier_rounds

    def stage(self, server_round: int) -> str:
        """``"encoders"`` for rounds 1 … T_e, ``"classifier"`` after."""
        return "encoders" if server_round <= self.encoder_rounds else "classifier"

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
    def _ensemble(self) -> ArrayRecord:
        """The cluster models as one ConcatModel whose head sums their logits."""
        states = self._cluster_states()
        return ArrayRecord(concat_state_dict(states, classifier_from_heads(states, self.head), self.head))

    def begin_encoder_stage(self, initial_arrays: ArrayRecord, num_clusters: int) -> None:
        """Every cluster starts from `initial_arrays` (shared, never mutated: aggregation replaces a
        cluster's record with a new one)."""
        self.cluster_models = [initial_arrays] * num_clusters
        self.cluster_updates = [0] * num_clusters
        if self.feddyn is not None:
            self.cluster_feddyn = self._fresh_cluster_feddyn(num_clusters)

    def _fresh_cluster_feddyn(self, count: int) -> list[FedDynServer]:
        """One FedDyn server state (h = 0) per cluster, with the run's α and keys."""
        assert self.feddyn is not None
        return [FedDynServer(self.feddyn.alpha, self.feddyn.keys) for _ in range(count)]

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

    def state_dict(self) -> dict[str, Any]:
        """Base state plus each stage's: clusters, cluster models, encoders, classifier, caches, byte counts."""
        state = super().state_dict()
        state["fedconcat"] = {
            **self.label_clustering_state(),
            "cluster_models": [to_numpy(model) for model in self.cluster_models],
            "cluster_updates": list(self.cluster_updates),
            "cluster_feddyn": [server.state_dict() for server in self.cluster_feddyn],
            **self.classifier_rounds_state(),
            "bytes_by_stage": copy.deepcopy(self.bytes_by_stage),
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        super().load_state_dict(state)
        saved = state["fedconcat"]
        self.load_label_clustering_state(saved)
        self.cluster_models = [to_record(arrays) for arrays in saved["cluster_models"]]
        self.cluster_updates = list(saved["cluster_updates"])
        if self.feddyn is not None:
            self.cluster_feddyn = self._fresh_cluster_feddyn(len(saved["cluster_feddyn"]))
            for server, server_state in zip(self.cluster_feddyn, saved["cluster_feddyn"]):
                server.load_state_dict(server_state)
        self.load_classifier_rounds_state(saved)
        self.bytes_by_stage = copy.deepcopy(saved["bytes_by_stage"])


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
        head_check=config.fedconcat_head_check and config.local_dp_epsilon == 0,  # noised heads: docs/privacy.md
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
