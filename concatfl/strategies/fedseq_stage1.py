"""FedSeq's stage 1: pre-training, approximation, grouping, and the placement of nodes.

`setup` (once, before round 1) has every connected client pre-train the initial model, turns
each returned model into an approximation ψ of the client's label distribution (`conf`:
confidence vectors on public exemplars; `clf`: classifier weights reduced by PCA) and groups
the clients into superclients of diverse data (`concatfl.core.superclients`), reported in the
setup record. `place` puts a node that joins later (or is asked again after stage 1) into the
superclient its approximation fits. `SuperclientStage` is FedSeq's base class: FedSeq's
constructor sets the options and state it reads, and FedSeq's `state_dict` keeps that state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log
from torch import nn

from ..core import superclients as sc
from ..models import fc_layer_names
from .base import RelayStrategy
from .common import CONFIG_KEY, METRICS_KEY, HopResult, Reply, Request, live_node_ids, torch_state, train_content
from .membership import RETURNED, START

LABEL_COUNTS_KEY = "label-counts"
LOCAL_EPOCHS_KEY = "local-epochs"


@dataclass(frozen=True)
class _Pretrained:
    """What stage 1 keeps of a node's pre-trained model (the model itself is let go): its
    bounded sample count, its description (`FedSeq._describe`) and the epochs it says it
    trained (None: not said)."""

    node: int
    samples: int
    row: np.ndarray
    epochs: float | None


class SuperclientStage(RelayStrategy):
    """FedSeq's stage 1 (see the module docstring and `FedSeq`). It sets no attributes of its
    own: FedSeq's constructor sets those annotated here."""

    # Options: FedSeq's constructor parameters of the same names.
    num_classes: int
    approximator: str
    conf_normalize: str
    clf_layers: str
    metric: str
    grouping: str
    greedy_merge: str
    min_samples: int
    max_clients: int
    pretrain_epochs: int
    report_label_counts: bool
    # State, kept by FedSeq's `state_dict`: the superclients and what stage 1 learned of the nodes.
    plan: dict[int, list[int]]
    superclients: dict[int, list[int]]
    client_samples: dict[int, int]
    estimates: dict[int, np.ndarray]
    _initial: ArrayRecord | None
    _exemplars: np.ndarray
    # What the approximation runs on: the model factory, the exemplars' pool, normalization and device.
    _make_model: Callable[[], nn.Module]
    _pool: tuple[torch.Tensor, torch.Tensor] | None
    _normalization: Callable[[torch.Tensor], torch.Tensor]
    _device: torch.device

    def setup(self, grid: Grid, initial_arrays: ArrayRecord, train_config: ConfigRecord) -> None:
        """Pre-train on every connected client, approximate ψ, group, and report."""
        nodes = live_node_ids(grid)
        self._initial, self._train_config = initial_arrays, train_config
        pretraining, pretrained = self._pretrain(grid, nodes, placing=False)
        if not pretrained:
            raise RuntimeError(f"FedSeq pre-training: none of the {len(nodes)} nodes returned a usable model")
        node_ids = [entry.node for entry in pretrained]
        sizes = [entry.samples for entry in pretrained]
        vectors, approximation = self._approximate([entry.row for entry in pretrained])
        groups = sc.group_clients(
            self.grouping,
            vectors,
            sizes,
            metric=self.metric,
            num_clusters=self.num_classes,
            min_samples=self.min_samples,
            max_clients=self.max_clients,
            rng=self.rng,
            merge=self.greedy_merge,
        )
        reported_epochs, differing_epochs = self._reported_pretrain_epochs(pretrained)
        self.client_samples = dict(zip(node_ids, sizes))
        self.plan = {sid: [node_ids[c] for c in group] for sid, group in enumerate(groups)}
        placements: list[dict[str, Any]] = []
        for sid, group in enumerate(groups):
            if self.approximator == "conf":
                self.estimates[sid] = sum(sizes[c] * vectors[c] for c in group)
            for c in group:
                self.settle(node_ids[c], {"superclient": sid}, START)
        left_out = sorted(miss.request.node_id for miss in pretraining.misses)
        self.defer(left_out)
        self.superclients = {sid: list(members) for sid, members in self.plan.items()}
        hops = [pretraining]
        report = self._grouping_report(groups, node_ids, sizes, vectors)
        if self.report_label_counts:
            query = self._label_count_hop(grid, node_ids)
            hops.append(query)
            self._attach_true_labels(report, groups, node_ids, sizes, query)
        self.setup_record = {
            "pretraining": pretraining.as_record(),
            "bytes_sent": sum(hop.bytes_sent for hop in hops),
            "bytes_received": sum(hop.bytes_received for hop in hops),
            "seconds": round(sum(hop.seconds for hop in hops), 4),
            "clients": len(node_ids),
            "left_out": left_out,
            "placements": placements,
            "pretrain_epochs": self.pretrain_epochs,
            "pretrain_epochs_reported": reported_epochs,
            "pretrain_epochs_differ": differing_epochs,
            "approximator": self.approximator,
            "metric": self.metric if self.grouping == "greedy" else None,
            "greedy_merge": self.greedy_merge if self.grouping == "greedy" else None,
            "grouping": self.grouping,
            "min_samples": self.min_samples,
            "max_clients": self.max_clients,
            **approximation,
            **report,
        }
        _log_report(self.setup_record)

    # ------------------------------------------------------------------ membership
    def place(self, grid: Grid, nodes: list[int], why: str, server_round: int) -> dict[int, Any]:
        """A returning node keeps its superclient; a newcomer (or a node asked again after stage
        1) pre-trains the initial model and joins the superclient its approximation fits; one
        without a usable pre-training reply joins the superclient with the fewest samples (see
        the class docstring)."""
        if why == RETURNED:
            return {node: self.membership.places[node] for node in nodes}
        hop, pretrained = self._pretrain(grid, nodes, placing=True)
        placed: dict[int, Any] = {}
        if pretrained:
            vectors = self._approximate([entry.row for entry in pretrained])[0] if self.approximator == "conf" else None
            for index, entry in enumerate(pretrained):
                vector = None if vectors is None else vectors[index]
                placed[entry.node] = self._join(entry.node, entry.samples, vector)
        placed.update(self._place_unapproximated(sorted(miss.request.node_id for miss in hop.misses)))
        return placed

    def _pretrain(self, grid: Grid, nodes: list[int], placing: bool) -> tuple[HopResult, list[_Pretrained]]:
        """Stage 1's pre-training of `nodes` from the initial model: the hop, and what is kept
        of each bounded reply in node order (the sample counts are bounded too: they weigh the
        superclients). Each model is described as it arrives and let go (`RelayStrategy.hop`'s
        `digest`): 10,000 clients' models at once would not fit in memory."""
        assert self._initial is not None
        settings = {
            **dict(self._train_config),
            "server-round": 0,
            "local-epochs": self.pretrain_epochs,
            "proximal-mu": 0.0,
            "local-objective": "sgd",
        }
        requests = [Request(node, train_content(self._initial, settings), tag="pretrain") for node in nodes]
        kept: list[_Pretrained] = []

        def digest(replies: list[Reply]) -> None:
            for reply in self.guard.bound(replies, stream="pretrain"):
                epochs = reply.metrics.get(LOCAL_EPOCHS_KEY)
                said = isinstance(epochs, (int, float)) and not isinstance(epochs, bool)
                row = self._describe(reply.numpy())
                kept.append(_Pretrained(reply.node_id, reply.num_examples, row, epochs if said else None))

        hop = self.hop(grid, requests, placing=placing, digest=digest)
        return hop, sorted(kept, key=lambda entry: entry.node)

    def _join(self, node: int, samples: int, vector: np.ndarray | None) -> dict[str, int]:
        """Add `node` (with `samples` samples and approximation `vector`, or None) to the
        superclient it fits, or to a new one when all are full; returns its place."""
        sid = sc.fitting_superclient(
            vector,
            {sid: self.estimates.get(sid) for sid in self.plan},
            {sid: sum(self.client_samples[n] for n in members) for sid, members in self.plan.items()},
            {sid: len(members) for sid, members in self.plan.items()},
            self.metric,
            self.max_clients,
        )
        if sid is None:
            sid = max(self.plan, default=-1) + 1
            self.plan[sid] = []
        self.plan[sid].append(node)
        self.client_samples[node] = samples
        if vector is not None:
            self.estimates[sid] = self.estimates.get(sid, 0.0) + samples * vector
        return {"superclient": sid}

    def _place_unapproximated(self, nodes: list[int]) -> dict[int, Any]:
        """Each node without a pre-trained model joins the superclient with the fewest samples
        among those with room (its own count taken as the median client's)."""
        typical = int(np.median(list(self.client_samples.values())))
        placed = {node: self._join(node, typical, None) for node in nodes}
        if placed:
            log(WARNING, "FedSeq: nodes %s gave no usable pre-trained model; they join superclients "
                "(node: superclient) %s without an approximation", nodes,
                {node: where["superclient"] for node, where in placed.items()})
        return placed

    def _reported_pretrain_epochs(self, pretrained: list[_Pretrained]) -> tuple[dict[int, float], list[int]]:
        """Node -> the epochs it says it pre-trained (``metrics["local-epochs"]``, optional), and
        the nodes whose count differs from `pretrain_epochs` (warned about: their ClientApp reads
        its epoch count from somewhere other than ``config["local-epochs"]``)."""
        reported = {entry.node: entry.epochs for entry in pretrained if entry.epochs is not None}
        if differing := sorted(node for node, epochs in reported.items() if epochs != self.pretrain_epochs):
            log(
                WARNING,
                "FedSeq pre-training asked for %s local epochs; nodes %s report %s (their ClientApp "
                "does not read config['local-epochs']): the approximations come from differently trained models",
                self.pretrain_epochs, differing, [reported[node] for node in differing],
            )
        return reported, differing

    def _describe(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """What ψ needs of one pre-trained model: its confidence vector (`conf`), or its
        classifier layers' weights (`clf`, reduced with the others' by `_approximate`)."""
        if self.approximator == "conf":
            assert self._pool is not None
            x, y = self._pool[0][self._exemplars], self._pool[1][self._exemplars]
            module = self._scratch_module()
            module.load_state_dict(torch_state(arrays))
            confidences = sc.class_confidences(module, x, y, self.num_classes, self._normalization, self._device)
            return sc.confidence_vector(confidences, self.conf_normalize)
        return sc.classifier_vector(arrays, self._classifier_layers())

    def _scratch_module(self) -> nn.Module:
        """A module to load clients' weights into (built once; `reusable_module` leaves the
        server's torch random state as it was)."""
        return self.reusable_module("pretrained", self._make_model, self._make_model)

    def _classifier_layers(self) -> list[str]:
        """The fully connected layers the `clf` approximator reads (`clf_layers` of the model's)."""
        return sc.select_fc_layers(fc_layer_names(self._scratch_module()), self.clf_layers)

    def _approximate(self, rows: list[np.ndarray]) -> tuple[np.ndarray, dict[str, Any]]:
        """ψ of every pre-trained model from its description (`_describe`; rows in the order
        given) and what to report about it."""
        if self.approximator == "conf":
            return np.stack(rows), {"exemplars": len(self._exemplars)}
        layers = self._classifier_layers()
        reduced, explained = sc.reduce_pca(np.stack(rows), seed=int(self.rng.integers(2**31)))
        return reduced, {
            "clf_layers": layers,
            "pca_components": int(reduced.shape[1]),
            "pca_explained_variance": round(explained, 4),
        }

    def _grouping_report(
        self, groups: sc.Grouping, node_ids: list[int], sizes: list[int], vectors: np.ndarray
    ) -> dict[str, Any]:
        """Sizes of the superclients and, with ψ = conf, their balance estimated from D̃."""
        entries: list[dict[str, Any]] = [
            {
                "id": sid,
                "nodes": [node_ids[c] for c in group],
                "clients": len(group),
                "samples": sum(sizes[c] for c in group),
            }
            for sid, group in enumerate(groups)
        ]
        report: dict[str, Any] = {"num_superclients": len(groups), "superclients": entries}
        if self.approximator == "conf":
            # An estimate is never exactly zero: a class counts as covered above half the uniform share.
            estimated_counts = np.asarray(sizes, dtype=np.float64)[:, None] * vectors
            described = sc.describe_superclients(groups, sizes, estimated_counts, 0.5 / self.num_classes)
            _attach(report, "estimated", described)
        return report

    def _label_count_hop(self, grid: Grid, nodes: list[int]) -> HopResult:
        """Ask `nodes` for their true label counts (a "query" message; simulation diagnostic)."""
        requests = [
            Request(
                node,
                RecordDict({CONFIG_KEY: ConfigRecord({"query": LABEL_COUNTS_KEY})}),
                MessageType.QUERY,
                tag=LABEL_COUNTS_KEY,
                require_num_examples=False,
            )
            for node in nodes
        ]
        return self.hop(grid, requests)

    def _attach_true_labels(
        self, report: dict[str, Any], groups: sc.Grouping, node_ids: list[int], sizes: list[int], query: HopResult
    ) -> None:
        """Add to `report` the superclients' balance from the label counts the clients sent."""
        counts = np.zeros((len(node_ids), self.num_classes))
        missing = set(node_ids)
        for reply in query.replies:
            metrics = reply.content.metric_records.get(METRICS_KEY)
            values = metrics.get(LABEL_COUNTS_KEY) if metrics is not None else None
            if not isinstance(values, list) or len(values) != self.num_classes:
                log(WARNING, "Node %s sent no usable '%s' (%r)", reply.node_id, LABEL_COUNTS_KEY, values)
                continue
            counts[node_ids.index(reply.node_id)] = values
            missing.discard(reply.node_id)
        report["label_counts_missing"] = sorted(missing)
        if len(missing) == len(node_ids):
            log(WARNING, "FedSeq: no client reported its label counts; no true-label report")
            return
        _attach(report, "true", sc.describe_superclients(groups, sizes, counts))


def _attach(report: dict[str, Any], kind: str, described: list[dict[str, Any]]) -> None:
    """Put per-superclient quality under `kind` in each entry, and its mean balance ratio on top."""
    for entry, quality in zip(report["superclients"], described):
        entry[kind] = {key: quality[key] for key in ("balance_ratio", "covered_classes", "classes")}
    ratios = [quality["balance_ratio"] for quality in described]
    report[f"mean_balance_ratio_{kind}"] = round(float(np.mean(ratios)), 4) if ratios else None


def _log_report(record: dict[str, Any]) -> None:
    sizes = Counter(entry["clients"] for entry in record["superclients"])
    shape = ", ".join(f"{count} of {clients} client{'s' * (clients > 1)}" for clients, count in sorted(sizes.items()))
    log(INFO, "FedSeq: %s superclients from %s clients (%s; %s, %s): each gathers min-samples=%s samples or more from "
        "at most max-clients=%s clients; a client that holds min-samples alone is a superclient of one, a FedAvg "
        "client", record["num_superclients"], record["clients"], shape, record["approximator"], record["grouping"],
        record["min_samples"], record["max_clients"])
    for entry in record["superclients"]:
        quality = ", ".join(
            f"{kind}: balance {entry[kind]['balance_ratio']} covering {entry[kind]['covered_classes']} classes"
            for kind in ("estimated", "true")
            if kind in entry
        )
        log(INFO, "\tsuperclient %s: %s clients, %s samples; %s",
            entry["id"], entry["clients"], entry["samples"], quality)
