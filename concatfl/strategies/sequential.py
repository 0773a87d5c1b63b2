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

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.supercore import log

from ..core.bounds import bound_share, flatten, move
from ..core.sequential import (
    ADAPT_WINDOW,
    LOSSES_TO_WARN,
    SMALL_HOP,
    STEP_START,
    WITNESS_FIRST,
    adapt_step,
    chain_step,
    chance_level,
    check_affordable,
    diverged,
    divergence,
    fedavg_as_low,
    parts_due,
    scored_parts,
    relative_hop,
    running_mean_share,
    sized_step,
    stalled,
    even_share,
    witness_due,
    witness_lost,
    witness_warns,
)
from .common import Reply, to_numpy, to_record, weighted_average
from .guard import ReplyGuard

Evaluate = Callable[[ArrayRecord], MetricRecord | None]
# The steps and bound FedCat and FedSeq use unless told otherwise (docs/results.md, the
# sequential-stability map over 18 settings of step size, epochs and optimizer, gives the
# evidence; docs/strategies.md the reasoning). No fixed step met every target there. FedSeq's
# damped step is 0.25, a hop never below its share of its chain's data (`chain_step`; the swap
# map's short chains): within 2 points of FedAvg with every node in 14 of 18 cells and never at
# chance (0.5 collapsed to chance in two cells with large steps; "even" fell 16 points short where
# steps are small). Its default rule, "sized", keeps 0.25 where the first round's hops are long
# and takes them whole where they are short (`core.sequential.sized_step`). FedCat keeps the
# fixed 0.5: its gap to FedAvg at equal participation is structural (one average per K rounds),
# and 0.5 is its best rule in most cells. "even", "mean" and "auto" are options.
AUTO = "auto"
MEAN = "mean"
EVEN = "even"
SIZED = "sized"
FEDCAT_HOP_STEP = 0.5
FEDSEQ_HOP_STEP = 0.25  # FedSeq's damped step: the "sized" rule's until it has measured the hops
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
        travelling model moves by s·(returned − sent), s ≤ η. "even": each hop's share is its
        examples over the chain's (`core.sequential.even_share`). "mean": the running mean of
        the chain's models (`core.sequential.running_mean_share`). "sized": FedSeq's default,
        `damped_step` until the first aggregation, then 1 if the hops before it were short against
        the model (`core.sequential.sized_step`; recorded as ``hop_rule``). "auto": η starts at 0.5 and is
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
        Evaluate the average of the averaged models at every aggregation, the models themselves
        at the first, every `core.sequential.PART_CHECK_EVERY`-th and the last, and (once) the
        model the run started from, with the run's `evaluate_fn`: the warning's signs need these
        accuracies (the average's is the global model's, which the run evaluates anyway). The
        models one by one are skipped when the guard's `budget` (a `CheckBudget`) cannot afford them.
    share_floor : bool
        A hop counts at least its client's share of its chain's data and a chain of one hop is
        taken whole (`core.sequential.chain_step`; FedSeq's superclient chains): `fold` is then
        given each reply's `planned` examples and `chain_hops`.
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
        share_floor: bool = False,
        damped_step: float = FEDSEQ_HOP_STEP,
    ) -> None:
        named = {SIZED: damped_step, AUTO: STEP_START, MEAN: STEP_START, EVEN: STEP_START}  # η each rule starts at
        if hop_step not in named and not 0.0 < float(hop_step) <= 1.0:
            raise ValueError(
                f"hop_step must be in (0, 1] (1 = take each reply as it is), 'sized', 'even', 'mean' or 'auto', "
                f"got {hop_step}"
            )
        if hop_clip < 0:
            raise ValueError(f"hop_clip must be >= 0 (0 = no bound), got {hop_clip}")
        self.strategy = strategy
        self.replies = replies
        self.hop_step = hop_step
        self.step = named[hop_step] if hop_step in named else float(hop_step)  # η of the hops to come
        self._sizing: list[float] | None = [] if hop_step == SIZED else None  # hop lengths until the step is sized
        self.hop_clip = hop_clip
        self.keys = keys
        self.check_parts = check_parts
        self.budget = CheckBudget()  # shared with the strategy's FirstHopWitness
        self._later_ratios: list[float] = []  # since the last check: later hop length / reference
        self._own_first: dict[int, float] = {}  # each node's latest first-hop length
        # The recent later hops' lengths over their node's first hop: the adaptive step's measure
        # (a window, not just the hops since the last check: FedSeq checks after every round).
        self._own_ratios: deque[float] = deque(maxlen=ADAPT_WINDOW)
        self._steps: list[float] = []  # since the last check: the step size each hop was given
        self._aggregations = 0
        self._chance: float | None = None  # the level of the model the first chains started from
        self._start_checked = False
        self._warned = False
        self.share_floor = share_floor

    # pylint: disable=too-many-arguments
    def fold(
        self,
        replies: Sequence[Reply],
        first_hop: bool,
        held: Sequence[float] = (),
        planned: Sequence[float] = (),
        chain_hops: Sequence[int] = (),
    ) -> list[Reply]:
        """The replies, each now holding the travelling model it makes: what was sent moved by
        s·(returned − sent) (a reply within every bound at η = 1 is returned as it is).
        `first_hop`: the replies answer the averaged model a chain started from (their lengths
        join the reference instead of being bounded by `hop_clip`). For the rules that weigh a
        hop by its examples: `held[i]`, the examples reply i's travelling model holds already
        (`hop_step='mean'`; 0 for a first hop), and `planned[i]`, the examples its chain folds in
        all (`hop_step='even'`, and the share floor). `chain_hops[i]`: the hops of reply i's chain
        (the share floor)."""
        self.budget.begin()
        step: float | Callable[[int, int], float] = self.step
        if self.hop_step == MEAN:
            before = list(held) or [0.0] * len(replies)
            step = lambda index, examples: running_mean_share(examples, before[index])  # noqa: E731
        elif self.hop_step == EVEN:
            chain = list(planned)
            step = lambda index, examples: even_share(examples, chain[index])  # noqa: E731
        if self.share_floor:
            rule, lengths, totals = step, list(chain_hops), list(planned)
            step = lambda index, examples: chain_step(  # noqa: E731
                rule(index, examples) if callable(rule) else rule, lengths[index], examples, totals[index]
            )
        folded = self.replies.bound(
            replies, step=step, hop_clip=0.0 if first_hop else self.hop_clip, joins=first_hop
        )
        for reply in folded:
            if reply.length is None:
                continue
            if self._sizing is not None:
                self._sizing.append(reply.length)
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
        models: Sequence[Mapping[str, np.ndarray]],
        weights: Sequence[float],
        average: ArrayRecord,
        evaluate: Evaluate | None,
        last: bool = False,
        chained: bool = True,
        first_hops_accuracy: float | None = None,
    ) -> dict[str, Any]:
        """The divergence record of `models` (numpy arrays by key, trained from `start`, averaged into `average`)
        and of the hops since the last check; logs the run's one warning the first time the
        chains look broken (`last`: this is the run's last aggregation, so a run that never
        left chance is warned about before it ends, however few aggregations it had). `chained`
        False: the models are no chains' (FedSeq's superclients of one client are FedAvg's
        clients): none is scored one by one, and nothing warns (a FedAvg round near chance is not
        sequential training's doing). `first_hops_accuracy`: the `FirstHopWitness`'s last score of
        the FedAvg round the first hops form; as low as a stall (`core.sequential.fedavg_as_low`),
        the warning asks for a FedAvg run before blaming the chains."""
        record: dict[str, Any] = divergence(to_numpy(start), models, weights).as_record()
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
            timed = self.budget.timed(evaluate)
            self._measure_start(start, timed)
            average_accuracy = _accuracy(evaluate(average))  # the global model: evaluated by the run anyway
            if average_accuracy is not None:
                record["average_accuracy"] = round(average_accuracy, 4)
            parts = scored_parts(weights)
            due = chained and parts_due(self._aggregations, last)
            if due and self.budget.affords(len(parts), early=self._aggregations == 1):
                scores = [_accuracy(timed(to_record(models[i]))) for i in parts]
                if average_accuracy is not None and None not in scores:
                    part_accuracies = [float(a) for a in scores if a is not None]
                    record["part_accuracy"] = [round(a, 4) for a in part_accuracies]
            record["checks"] = self.budget.as_record()
        if self.hop_step == AUTO:
            used = self.step
            # A client's own first hop is the fairer yardstick (clients differ in data and so in
            # hop length); the reference of all first hops stands in until a client has one.
            ratio = own_ratio if own_ratio is not None else hop_ratio
            if ratio is not None:
                self.step = adapt_step(self.step, ratio)
            record["hop_rule"] = {"step": round(used, 4), "next_step": round(self.step, 4)}
        if self._sizing is not None:
            record["hop_rule"] = self._size_step(start)
        reason = diverged(self._aggregations, self._chance, average_accuracy, part_accuracies, last) if chained else None
        record["diverged"] = reason is not None
        stall = average_accuracy is not None and stalled(self._aggregations, self._chance, average_accuracy, last)
        self._warn(reason, bool(stall) and fedavg_as_low(self._chance, first_hops_accuracy))
        return record

    def _size_step(self, start: ArrayRecord) -> dict[str, Any]:
        """The sized step, once, from the hops before the first aggregation; said in the log."""
        assert self._sizing is not None
        norm = float(np.linalg.norm(flatten(to_numpy(start))))  # the unit of the hops' lengths (`update_vector`)
        relative = relative_hop(self._sizing, norm)
        used, self.step = self.step, sized_step(relative, self.step)
        self._sizing = None
        log(
            INFO,
            "%s: the hops before the first aggregation moved the model by %s of its norm (median; %s or less: "
            "small local steps); hops are taken %s from now on (%s=sized)",
            self.strategy,
            "nothing" if relative is None else f"{relative:.3f}",
            SMALL_HOP,
            "whole (the papers' step)" if self.step == 1.0 else f"at the damped step {self.step:g}",
            self.keys[0],
        )
        return {"step": round(used, 4), "next_step": round(self.step, 4),
                "relative_hop": None if relative is None else round(relative, 4)}

    def check_last(self, start: ArrayRecord, average: ArrayRecord, evaluate: Evaluate | None) -> None:
        """The run ends on an average no aggregation checked (FedCat's last round inside a cycle):
        warn if it never left the level of the model the run started from. Changes nothing else
        (a resumed run continues the cycle as if the run had not ended)."""
        if not self.check_parts or evaluate is None:
            return
        timed = self.budget.timed(evaluate)
        self._measure_start(start, timed)
        average_accuracy = _accuracy(timed(average))
        self._warn(diverged(max(1, self._aggregations), self._chance, average_accuracy, [], last=True))

    def _measure_start(self, start: ArrayRecord, evaluate: Evaluate) -> None:
        """Once per run: the chance level, from the model the first chains started from."""
        if self._start_checked:
            return
        self._start_checked = True
        metrics = evaluate(start)
        accuracy = _accuracy(metrics)
        if accuracy is not None:
            loss = metrics.get("loss") if metrics is not None else None
            self._chance = chance_level(accuracy, None if loss is None else float(loss))  # type: ignore[arg-type]

    def _warn(self, reason: str | None, fedavg_low: bool = False) -> None:
        """Log the run's one divergence warning, the first time there is a reason (`fedavg_low`: the
        reason is a stall, and the FedAvg round of the chains' first hops scored as low, so the chains
        may not be its cause)."""
        if reason is None or self._warned:
            return
        self._warned = True
        if fedavg_low:
            verdict = (
                "the run is not leaving chance: %s, and one FedAvg round from the same model (the chains' first "
                "hops, recorded as 'witness') scored as low. Run FedAvg with the same settings to tell why: if it "
                "also stays near chance, this federation learns slowly at these local steps whatever the "
                "strategy (more rounds, or another lr / local-epochs); if it does not, the chains are the cause. "
                "Then lower the local steps"
            )
        else:
            verdict = (
                "the sequentially trained models diverge: %s. The clients' local steps (lr, momentum, local-epochs, "
                "the optimizer) are too large for chains of label-skewed clients. Lower them"
            )
        log(
            WARNING,
            "%s: " + verdict + ", or let the server damp each hop more: %s=even (each hop counts as much as its "
            "client's share of the chain: near FedAvg at every step size in the sequential-stability map) or a "
            "smaller number (now %s%s), and %s (now %s), the constructor's hop_step and hop_clip. Recorded per "
            "aggregation as 'divergence' in metrics.json; this warning is logged once per run.",
            self.strategy,
            reason,
            self.keys[0],
            f"{SIZED}: {self.step:g}" if self.hop_step == SIZED else self.hop_step,
            "; a hop still counts at least its client's share of its chain" if self.share_floor else "",
            self.keys[1],
            self.hop_clip,
        )

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to bound its hops exactly as this one would."""
        return {
            "step": self.step,
            "sizing": self._sizing,
            "later_ratios": list(self._later_ratios),
            "own_first": {str(node): length for node, length in self._own_first.items()},
            "own_ratios": list(self._own_ratios),
            "steps": list(self._steps),
            "aggregations": self._aggregations,
            "chance": self._chance,
            "start_checked": self._start_checked,
            "warned": self._warned,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output."""
        self.step = float(state["step"])
        sizing = state.get("sizing")
        self._sizing = None if sizing is None else [float(x) for x in sizing]
        self._later_ratios = [float(x) for x in state["later_ratios"]]
        self._own_first = {int(node): float(length) for node, length in state["own_first"].items()}
        self._own_ratios = deque((float(x) for x in state["own_ratios"]), maxlen=ADAPT_WINDOW)
        self._steps = [float(x) for x in state["steps"]]
        self._aggregations = int(state["aggregations"])
        self._chance = None if state["chance"] is None else float(state["chance"])
        self._start_checked = bool(state["start_checked"])
        self._warned = bool(state["warned"])


class CheckBudget:
    """What the checks' extra server evaluations cost against the run's time
    (`core.sequential.check_affordable`). The run's clock starts at the first hop folded. Early
    checks always run: the first aggregation's, which measure what an evaluation costs, and the
    witness's first `core.sequential.WITNESS_FIRST` comparisons, which let a run warn within its
    first aggregations. Later ones run when affordable at that cost (the mean over the evaluations
    timed so far). `clock` is injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.started: float | None = None
        self.spent = 0.0  # seconds in the timed evaluations
        self.evaluations = 0
        self.skipped = 0  # checks due by their schedule that the budget skipped

    def begin(self) -> None:
        """Start the run's clock (once)."""
        if self.started is None:
            self.started = self.clock()

    def affords(self, evaluations: int, early: bool = False) -> bool:
        """Whether a check of `evaluations` evaluations may run now (`early`: one that always runs)."""
        if early or self.evaluations == 0 or self.started is None:
            return True
        cost = evaluations * self.spent / self.evaluations
        if check_affordable(self.spent, cost, self.clock() - self.started):
            return True
        self.skipped += 1
        return False

    def timed(self, evaluate: Evaluate) -> Evaluate:
        """`evaluate`, its calls' seconds counted as the checks'."""

        def timed_evaluate(arrays: ArrayRecord) -> MetricRecord | None:
            began = self.clock()
            try:
                return evaluate(arrays)
            finally:
                self.spent += self.clock() - began
                self.evaluations += 1

        return timed_evaluate

    def as_record(self) -> dict[str, float | int]:
        """JSON-ready: the checks' seconds and evaluations so far, and how many were skipped."""
        return {"seconds": round(self.spent, 3), "evaluations": self.evaluations, "skipped": self.skipped}


class FirstHopWitness:
    """What a sequential strategy's chains gain over the FedAvg round their first hops form.

    Every chain's first hop starts from the model the chains started from, as a FedAvg client
    does: the examples-weighted average of the first hops, each bounded as every reply is but taken
    whole, is a FedAvg round of those clients, which the server gets at no cost in training or
    traffic. With the run's `evaluate_fn` the server scores it beside the chains' average at the
    aggregations `core.sequential.witness_due` names that `budget` affords (one evaluation more
    each; the chains' average is the global model, evaluated by the run anyway; the first
    `WITNESS_FIRST` and the run's last always run) and records both (``witness``); when the
    chains lose by more than `core.sequential.WITNESS_MARGIN` as often as
    `core.sequential.witness_warns` says (twice in a row, or at the run's last aggregation) it
    warns, once: the federation is not the method's regime. The global model is never replaced:
    the first hops are only as many clients as there are chains, a sample too small to stand for
    FedAvg's round. Without an `evaluate_fn` nothing is compared, which the run says once.
    """

    def __init__(self, strategy: str, update_clip: float, advice: str, budget: CheckBudget) -> None:
        self.strategy = strategy
        self.update_clip = update_clip
        self.advice = advice
        self.budget = budget
        self._aggregations = 0
        self._streak = 0  # comparisons in a row the chains lost
        self.first_hops_accuracy: float | None = None  # at the last comparison
        self._warned = False
        self._told = False
        self._start: dict[str, np.ndarray] = {}
        self._models: list[dict[str, np.ndarray]] = []
        self._weights: list[float] = []

    def begin(self, start: dict[str, np.ndarray]) -> None:
        """The chains start from `start`: forget the last first hops."""
        self._start, self._models, self._weights = start, [], []

    def note(self, sent: Sequence[Reply], folded: Sequence[Reply]) -> None:
        """Keep the first hops `folded` (the guard's bounded copies of the replies `sent`) whole:
        the start moved by the share of each update the reply bounds leave at step 1."""
        received = {id(reply.request): reply for reply in sent}
        for reply in folded:
            whole = bound_share(reply.length or 0.0, reply.reference, self.update_clip, 1.0)
            self._models.append(move(self._start, received[id(reply.request)].numpy(), whole))
            self._weights.append(float(reply.num_examples))

    def compare(
        self, server_round: int, chains: ArrayRecord, evaluate: Evaluate | None, last: bool = False
    ) -> dict[str, Any]:
        """The record of this aggregation's comparison ({} when none is due or possible; `last`:
        the run's last aggregation, always compared)."""
        if not self._models:
            return {}
        if evaluate is None:
            if not self._told:
                self._told = True
                log(INFO, "%s: without an evaluate_fn the chains are not compared with the FedAvg round their first "
                    "hops form; a federation where they do worse than FedAvg goes unnoticed", self.strategy)
            return {}
        self._aggregations += 1
        early = last or self._aggregations <= WITNESS_FIRST
        if not witness_due(self._aggregations, last) or not self.budget.affords(1, early=early):
            return {}
        first_hops = weighted_average(self._models, self._weights)
        chains_accuracy, first_accuracy = _accuracy(evaluate(chains)), _accuracy(self.budget.timed(evaluate)(first_hops))
        if chains_accuracy is None or first_accuracy is None:
            return {}
        self.first_hops_accuracy = first_accuracy
        self._streak = self._streak + 1 if witness_lost(chains_accuracy, first_accuracy) else 0
        if witness_warns(self._streak, last) and not self._warned:
            self._warned = True
            in_a_row = self._streak >= LOSSES_TO_WARN
            when = f"at {self._streak} comparisons in a row" if in_a_row else "at the run's last aggregation"
            log(WARNING, "%s: in round %s the chains' average scores %.4f, one FedAvg round of the chains' first clients "
                "from the same model %.4f (their first hops), behind it %s: here %s does worse than FedAvg. %s "
                "Each comparison is recorded as 'witness'; this warning is logged once per run.",
                self.strategy, server_round, chains_accuracy, first_accuracy, when, self.strategy, self.advice)
        return {"chains_accuracy": round(chains_accuracy, 4), "first_hops_accuracy": round(first_accuracy, 4)}

    def state_dict(self) -> dict[str, Any]:
        """The counts: a resumed run compares and warns as this one would."""
        return {
            "aggregations": self._aggregations, "streak": self._streak, "warned": self._warned, "told": self._told,
            "first_hops_accuracy": self.first_hops_accuracy,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output."""
        self._aggregations, self._streak = int(state["aggregations"]), int(state["streak"])
        self._warned, self._told = bool(state["warned"]), bool(state["told"])
        self.first_hops_accuracy = state.get("first_hops_accuracy")  # absent from older checkpoints


def _accuracy(metrics: MetricRecord | None) -> float | None:
    if metrics is None or "accuracy" not in metrics:
        return None
    return float(metrics["accuracy"])  # type: ignore[arg-type]
