"""The server's guard over sequentially trained models, shared by FedCat and FedSeq/FedSeqInter.

`ChainGuard.fold` turns a hop's replies into the models that travel on: each hop's update is
taken with the share s = min(η, c·r/‖update‖) of `concatfl.core.bounds`, through the strategy's
`ReplyGuard` (so the bound every strategy puts on every reply applies too): a fixed server step
η and, for later hops, a bound c·r relative to the first hops (those that start from the
averaged model, which are the reference). `ChainGuard.check` runs whenever the travelling
models are averaged: it measures how far they ended apart, how long the later hops were against
first hops, and (with the run's central evaluation) the accuracy of the models, of their average
and of the model the run started from; it returns that as a JSON-ready record for metrics.json
and logs one WARNING per run the first time the chains look broken
(`concatfl.core.sequential.diverged`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.supercore import log

from ..core.sequential import ADAPT_WINDOW, STEP_START, adapt_step, diverged, divergence
from .common import Reply, to_numpy
from .guard import ReplyGuard

Evaluate = Callable[[ArrayRecord], MetricRecord | None]
# The steps and bound FedCat and FedSeq use unless told otherwise (docs/results.md, the
# sequential-stability map and the fedcat suite, gives the evidence; docs/strategies.md the
# reasoning): FedCat and FedSeq take the fixed 0.5. The adaptive step ("auto") is an option: 2.3 points above
# 0.5 on average over the map's 12 cells, but FedCat's with 5 local epochs on MNIST lost 10.7
# points and one seed of three fell to 44 %, and FedSeq's collapsed where clients take large steps.
AUTO = "auto"
DEFAULT_HOP_STEP = 0.5
DEFAULT_HOP_CLIP = 1.5


class ChainGuard:
    """Bounded hops and the divergence check of one strategy.

    Parameters
    ----------
    strategy : str
        Name used in log messages ("FedCat", "FedSeq", …).
    replies : ReplyGuard
        The strategy's guard: it bounds every hop (its update clip applies to all of them) and
        keeps the first hops' lengths as the reference (stream "model").
    hop_step : float | str
        η in (0, 1]: the share of each hop's update the server takes (1: all of it); the
        travelling model moves by s·(returned − sent), s ≤ η. "auto": η starts at 0.5 and is
        adapted after every aggregation by `concatfl.core.sequential.adapt_step` from the
        later hops' length relative to first hops (recorded as ``hop_rule`` in the divergence
        record); it needs no server data and nothing from the client.
    hop_clip : float
        c ≥ 0: a later hop may move the model at most c times the reference, the lower median
        length of the recent first hops (those that start from the averaged model); longer hops
        are scaled down to that length. 0 turns this bound off; with `hop_step` = 1 (and
        `update_clip` = 0) that is the paper's algorithm.
    keys : tuple[str, str]
        The run-config keys of `hop_step` and `hop_clip`, named in the warning.
    check_parts : bool
        Evaluate the averaged models, their average and (once) the model the run started from
        with the run's `evaluate_fn`: the warning's signs need these accuracies. Costs one server
        evaluation per averaged model.
    """

    # pylint: disable=too-many-arguments
    def __init__(
        self,
        strategy: str,
        replies: ReplyGuard,
        hop_step: float,
        hop_clip: float,
        keys: tuple[str, str],
        check_parts: bool = True,
    ) -> None:
        if hop_step != AUTO and not 0.0 < float(hop_step) <= 1.0:
            raise ValueError(f"hop_step must be in (0, 1] (1 = take each reply as it is) or 'auto', got {hop_step}")
        if hop_clip < 0:
            raise ValueError(f"hop_clip must be >= 0 (0 = no bound), got {hop_clip}")
        self.strategy = strategy
        self.replies = replies
        self.hop_step = hop_step
        self.step = STEP_START if hop_step == AUTO else float(hop_step)  # η of the hops to come
        self.hop_clip = hop_clip
        self.keys = keys
        self.check_parts = check_parts
        self._later_ratios: list[float] = []  # since the last check: later hop length / reference
        self._own_first: dict[int, float] = {}  # each node's latest first-hop length
        # The recent later hops' lengths over their node's first hop: the adaptive step's measure
        # (a window, not just the hops since the last check: FedSeq checks after every round).
        self._own_ratios: deque[float] = deque(maxlen=ADAPT_WINDOW)
        self._steps: list[float] = []  # since the last check: the step size each hop was given
        self._aggregations = 0
        self._start_accuracy: float | None = None  # of the model the first chains started from
        self._warned = False

    def fold(self, replies: Sequence[Reply], first_hop: bool) -> list[Reply]:
        """The replies, each now holding the travelling model it makes: what was sent moved by
        s·(returned − sent) (a reply within every bound at η = 1 is returned as it is).
        `first_hop`: the replies answer the averaged model a chain started from (their lengths
        join the reference instead of being bounded by `hop_clip`)."""
        folded = self.replies.bound(
            replies, step=self.step, hop_clip=0.0 if first_hop else self.hop_clip, joins=first_hop
        )
        for reply in folded:
            if reply.length is None:
                continue
            if first_hop:
                self._own_first[reply.node_id] = reply.length
                continue
            if reply.reference:
                self._later_ratios.append(reply.length / reply.reference)
            if self._own_first.get(reply.node_id):
                self._own_ratios.append(reply.length / self._own_first[reply.node_id])
            self._steps.append(reply.share)
        return folded

    def check(
        self,
        start: ArrayRecord,
        models: Sequence[ArrayRecord],
        weights: Sequence[float],
        average: ArrayRecord,
        evaluate: Evaluate | None,
    ) -> dict[str, Any]:
        """The divergence record of `models` (trained from `start`, averaged into `average`)
        and of the hops since the last check; logs the run's one warning the first time the
        chains look broken."""
        record: dict[str, Any] = divergence(to_numpy(start), [to_numpy(m) for m in models], weights).as_record()
        hop_ratio = float(np.median(self._later_ratios)) if self._later_ratios else None
        if hop_ratio is not None:
            record["hop_length_ratio"] = round(hop_ratio, 4)
        own_ratio = float(np.median(self._own_ratios)) if self._own_ratios else None  # over the window
        if own_ratio is not None:
            record["own_hop_ratio"] = round(own_ratio, 4)
        if self._steps:
            record["hop_steps"] = {"min": round(min(self._steps), 4), "mean": round(float(np.mean(self._steps)), 4)}
        self._later_ratios, self._steps = [], []
        self._aggregations += 1
        average_accuracy, part_accuracies = None, []
        if self.check_parts and evaluate is not None:
            if self._start_accuracy is None:
                self._start_accuracy = _accuracy(evaluate(start))
            scores = [_accuracy(evaluate(model)) for model in models]
            average_score = _accuracy(evaluate(average))
            if average_score is not None and None not in scores:
                average_accuracy, part_accuracies = average_score, [float(a) for a in scores if a is not None]
                record["part_accuracy"] = [round(a, 4) for a in part_accuracies]
                record["average_accuracy"] = round(average_accuracy, 4)
        if self.hop_step == AUTO:
            used = self.step
            # A client's own first hop is the fairer yardstick (clients differ in data and so in
            # hop length); the reference of all first hops stands in until a client has one.
            ratio = own_ratio if own_ratio is not None else hop_ratio
            if ratio is not None:
                self.step = adapt_step(self.step, ratio)
            record["hop_rule"] = {"step": round(used, 4), "next_step": round(self.step, 4)}
        reason = diverged(self._aggregations, self._start_accuracy, average_accuracy, part_accuracies)
        record["diverged"] = reason is not None
        if reason is not None and not self._warned:
            self._warned = True
            log(
                WARNING,
                "%s: the sequentially trained models diverge: %s. The clients' local steps (lr, momentum, "
                "local-epochs) are too large for chains of label-skewed clients. Lower them, or let the server "
                "damp and bound each hop: %s (now %s; default %s) and %s (now %s; default %s), the constructor's "
                "hop_step and hop_clip. Recorded per aggregation as 'divergence' in metrics.json; this warning "
                "is logged once per run.",
                self.strategy,
                reason,
                self.keys[0],
                self.hop_step,
                DEFAULT_HOP_STEP,
                self.keys[1],
                self.hop_clip,
                DEFAULT_HOP_CLIP,
            )
        return record

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to bound its hops exactly as this one would."""
        return {
            "step": self.step,
            "later_ratios": list(self._later_ratios),
            "own_first": {str(node): length for node, length in self._own_first.items()},
            "own_ratios": list(self._own_ratios),
            "steps": list(self._steps),
            "aggregations": self._aggregations,
            "start_accuracy": self._start_accuracy,
            "warned": self._warned,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output."""
        self.step = float(state["step"])
        self._later_ratios = [float(x) for x in state["later_ratios"]]
        self._own_first = {int(node): float(length) for node, length in state["own_first"].items()}
        self._own_ratios = deque((float(x) for x in state["own_ratios"]), maxlen=ADAPT_WINDOW)
        self._steps = [float(x) for x in state["steps"]]
        self._aggregations = int(state["aggregations"])
        self._start_accuracy = None if state["start_accuracy"] is None else float(state["start_accuracy"])
        self._warned = bool(state["warned"])


def _accuracy(metrics: MetricRecord | None) -> float | None:
    if metrics is None or "accuracy" not in metrics:
        return None
    return float(metrics["accuracy"])  # type: ignore[arg-type]
