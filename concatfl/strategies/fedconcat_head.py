"""FedConcat's concatenation and classifier rounds (`ClassifierRounds`, a part of `FedConcat`).

At the first classifier round the K cluster encoders are concatenated and frozen
(`core.concat.ConcatModel`); a node receives them once (``"train.fedconcat_features"``), caches
its features, and from then on only the linear classifier goes down and comes back
(``"train.fedconcat_head"``). A node whose feature cache is gone answers with a cache miss and
gets the encoders again within the round. With `head_memory` every node's latest head update
counts; with `head_check` a head update that moves the bias against both its node's
distribution and its previous head update is rejected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore import log
from torch import nn

from ..core.clustering import head_update_believed
from ..core.concat import (
    CLASSIFIER_BIAS,
    CLASSIFIER_WEIGHT,
    ConcatModel,
    check_head,
    concatenate,
    is_concat_state,
    num_encoders,
    save_concat_model,
    split_model,
)
from ..core.memory import UpdateMemory
from ..protocol import (
    CACHE_MISS,
    CLASSIFIER_STEPS,
    ENCODERS_ID,
    ENCODERS_KEY,
    FEATURES_MESSAGE_TYPE,
    HEAD_MESSAGE_TYPE,
    HEAD_NAME,
    MODEL_NAME,
    NUM_ENCODERS,
)
from ..training import Normalization
from .aggregation import Aggregation
from .common import (
    CONFIG_KEY,
    NUM_EXAMPLES_KEY,
    HopResult,
    Reply,
    Request,
    fingerprint,
    live_node_ids,
    sample_nodes,
    to_numpy,
    to_record,
    train_content,
)
from .fedavg import sample_count
from .fedconcat_stage1 import LabelClustering, shapes
from .feddyn import FedDynServer

# Hop kinds of the classifier stage (with the encoder rounds' one, the keys of the per-stage byte counts).
ENCODER_BROADCAST = "encoder-broadcast"
CLASSIFIER = "classifier"

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
# A head update whose bias moves against both the distribution its node was placed by and the
# node's previous head update is rejected (`core.clustering.head_update_believed`). Measured on
# digits (10 clients of two classes, 30 % of replies fuzzed, ten seeds each of FedConcat and
# FedConcat-ID, before the check): against the distribution, 961 honest head updates scored
# −0.04 (one) and 0.30–1.00 (median 0.89), 50 sign-flipped ones −0.99 to −0.48; against the
# previous update, 1,127 honest ones after an honest one −0.61 to 1.00 (6 below 0, median 0.88),
# 57 sign-flipped ones after an honest one −0.99 to −0.28.
HEAD_AGREEMENT_BOUND = 0.0


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


class ClassifierRounds(LabelClustering):
    """The concatenation and the classifier rounds; the settings it reads (`classifier_steps`,
    `init_classifier`, `head_memory`, `head_check`, …) are `FedConcat`'s parameters."""

    # pylint: disable=too-many-instance-attributes
    classifier_steps: int
    init_classifier: bool
    head_memory: bool
    head_check: bool
    fraction_train: float
    aggregation: Aggregation
    model_name: str
    cluster_models: list[ArrayRecord]
    cluster_updates: list[int]
    cluster_feddyn: list[FedDynServer]
    _hop_kind: str

    def init_classifier_rounds(self) -> None:
        """The stage's state, all of it but the round in progress in the strategy's `state_dict()`."""
        self.encoders: ArrayRecord | None = None
        self.encoders_id = ""
        self.classifier: ArrayRecord | None = None
        self.cached: set[int] = set()
        self.head_updates = UpdateMemory()  # every node's latest head update, with `head_memory`
        self._last_head_bias: dict[int, np.ndarray] = {}  # each node's latest head reply's bias update, taken or not
        self._classifier_round: _ClassifierRound | None = None  # rounds are never checkpointed half-way

    def _sample(self, nodes: list[int]) -> list[int]:
        """A sorted random `fraction_train` sample of `nodes` (at least one; none of none)."""
        return (
            sorted(sample_nodes(self.rng, nodes, sample_count(self.fraction_train, len(nodes))))
            if nodes
            else []
        )


    def _cluster_states(self) -> list[dict[str, torch.Tensor]]:
        return [model.to_torch_state_dict() for model in self.cluster_models]


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
            node, update = reply.node_id, reply.numpy()[CLASSIFIER_BIAS] - before
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


    def check_model(self, initial_arrays: ArrayRecord) -> None:
        """Raise ValueError, saying what FedConcat needs, unless the model splits at `head`.

        Checks the shapes of `initial_arrays` (unless they are a ConcatModel's, as a resumed run
        passes) and, with `make_model` and `input_shape`, that ``head(encoder(x)) == model(x)``
        on random inputs (the global torch RNG is left as it was).
        """
        try:
            if not is_concat_state(initial_arrays.keys()):
                check_head(shapes(initial_arrays), self.head)
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


    def classifier_rounds_state(self) -> dict[str, Any]:
        """The stage's part of `state_dict()`."""
        return {
            "last_head_bias": {node: update.copy() for node, update in self._last_head_bias.items()},
            "encoders": None if self.encoders is None else to_numpy(self.encoders),
            "encoders_id": self.encoders_id,
            "classifier": None if self.classifier is None else to_numpy(self.classifier),
            "cached": sorted(self.cached),
            "head_updates": self.head_updates.state_dict(),
        }

    def load_classifier_rounds_state(self, saved: dict[str, Any]) -> None:
        """Restore `classifier_rounds_state()`'s part."""
        self._last_head_bias = {int(node): np.asarray(update) for node, update in saved["last_head_bias"].items()}
        self.encoders = None if saved["encoders"] is None else to_record(saved["encoders"])
        self.encoders_id = saved["encoders_id"]
        self.classifier = None if saved["classifier"] is None else to_record(saved["classifier"])
        self.cached = set(saved["cached"])
        self.head_updates.load_state_dict(saved["head_updates"])
