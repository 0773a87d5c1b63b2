"""Rules of the sequential strategies (FedCat's copies, FedSeq's superclient chains).

A model that travels a chain of clients is trained by each of them in turn. With large local
steps (a high learning rate, momentum, many epochs) on label-skewed clients, a hop that starts
from a model fitted to the previous client's classes meets a large loss and takes a much larger
step than a hop from the averaged model: it overwrites what the chain learned (on a CNN it can
kill most ReLU channels), the chains end far apart, and their average can sit at chance. The
server bounds that without asking anything of the client, with the bound every strategy applies
to every reply (`concatfl.core.bounds`): the travelling model moves by s·(returned − sent) with
s = min(η, c·r/‖returned − sent‖), η a damped server step (1 = take the reply as is) and c·r a
bound on *later* hops, c times r, the lower median of the recent *first* hops (hops that start
from the averaged model, like FedAvg's client updates). c = 0 with η = 1 is the papers'
algorithm exactly. What is here:

* `adapt_step`: the adaptive η (`hop_step='auto'`): shrunk while later hops are much longer
  than first hops (the chain is being overwritten), grown while they are not. It reads only the
  hop lengths the server measures anyway: no server data, nothing from the client.
* `divergence`: how far the chains' models ended from each other, relative to how far they
  moved, measured when they are averaged (recorded in metrics.json with the hop-length ratio).
* `diverged`: the accuracy-based signs that the chains have broken the model (the warning;
  `stalled` its first sign alone);
  `fedavg_as_low`: whether the FedAvg round their first hops form is no better off.
* `chain_step`: a hop counts at least its client's share of the chain's data; a chain of one
  hop is a FedAvg client, taken whole.
* `relative_hop`, `sized_step`: FedSeq's default η (`hop_step='sized'`): the papers' 1 where the first round's
  hops are short against the model (small local steps), the damped step where they are not.
* `witness_due`, `witness_lost`, `witness_warns`, `parts_due`: what the server learns at little
  cost: the first hops of the chains start from the model the chains started from, as FedAvg's
  clients do, so their average is a FedAvg round; with the run's evaluation the server compares
  it with the chains' average (`witness_due` says when, `witness_lost` who lost, `witness_warns`
  when the losses are said), and scores the averaged models one by one only every few
  aggregations (`parts_due`).
* `check_affordable`: whether a check due by that schedule may run, from what the checks'
  evaluations have cost so far against the run's time.

Models are `{name: numpy array}` mappings; everything here is pure numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .bounds import Weights, flatten

# A run whose averaged model scores below EARLY_STALL_FACTOR times chance from its
# STALL_AGGREGATIONS-th aggregation on, or below FINAL_STALL_FACTOR times chance at its last
# aggregation however early that comes (FedCat with K = N over 2K rounds aggregates twice), has
# stopped learning through its chains. Chance is the level of the model the run started from
# (`chance_level`). In the sequential-stability map (18 settings, 3 seeds, 702 FedCat, FedSeq and
# FedSeqInter runs) this warned in all 79 runs that ended below twice chance and in 10 of the 525
# that ended at 0.5 or more (docs/results.md).
STALL_AGGREGATIONS = 5
EARLY_STALL_FACTOR = 1.5
FINAL_STALL_FACTOR = 2.0
# A start model this good is trained already: "stalled at chance" does not apply to it.
TRAINED_START = 0.5
# Averaging the models of healthy chains does not lose accuracy against the models themselves.
AVERAGE_ACCURACY_DROP_LIMIT = 0.15
# The adaptive step (`hop_step='auto'`) starts at the fixed default's 0.5 and steers a client's
# later hops towards TARGET_HOP_RATIO times its own first hops. Measured in the sequential-stability
# map's FedCat cells (seed 0, η = 1 / 0.5 / 0.25): the step that did best ran at a ratio of 1.1–1.4
# in every cell where the choice mattered (1.11 and 1.37 where η = 1 is best, 1.23 and 1.04 where
# 0.25 is), and η = 1 collapses where it reaches 1.9–2.2 (docs/strategies.md).
STEP_START = 0.5
STEP_LOW = 0.125
TARGET_HOP_RATIO = 1.3
STEP_GAIN = 1.0
# How many recent later hops the ratio is the median of.
ADAPT_WINDOW = 20
# The sized step (`sized_step`) takes hops whole from the second aggregation on when the median hop
# before the first moved its model by at most SMALL_HOP of the norm of the model the chains started
# from (docs/results.md): on the sequential-stability map the cells where undamped hops lead the
# damped 0.25 (SGD steps 0.05-0.1 at one epoch, Adam 1e-3, 20 and 30 clients, the quickstart
# client at lr 0.01 and Adam 1e-3) measure 0.05-0.14; those where they collapse or lose (step 0.5
# and more, Adam 1e-2, the quickstart client at lr >= 0.05) 0.18-1.56. The quickstart client on
# 400 real images at lr 0.01: 0.04-0.09.
SMALL_HOP = 0.15
# The server compares the chains' average with their first hops' (a FedAvg round) at each of the
# first WITNESS_FIRST aggregations, then every WITNESS_EVERY, and at the run's last: one server
# evaluation more each. The chains lose a comparison when the first hops score more than
# WITNESS_MARGIN above them (early rounds near chance differ by noise), and the run warns after
# LOSSES_TO_WARN in a row, or when it ends on a lost one (no later comparison can confirm it).
# The averaged models are scored one by one (the divergence check's second sign) at the first
# aggregation, every PART_CHECK_EVERY and the last, at most MAX_PARTS_SCORED of them (the
# heaviest): FedSeq with many small clients averages dozens of superclient models.
WITNESS_FIRST = 3
WITNESS_EVERY = 5
WITNESS_MARGIN = 0.02
LOSSES_TO_WARN = 2
PART_CHECK_EVERY = 5
MAX_PARTS_SCORED = 3
# The evaluations the checks add (the first hops' average, the models one by one, the start model)
# take at most CHECK_SHARE of the run's seconds so far: FedSeq's round is to cost at most 1.1x
# FedAvg's, and the other half of that tenth is the relay's own cost. On CIFAR-10's 10,000 test
# images one evaluation takes about 1.4 s against a 12 s round of 100 clients: the schedule alone
# asks 22 evaluations in 20 rounds (rounds 1.09-1.14x FedAvg's), the budget lets 8 run (1.06-1.08x;
# docs/results.md, the swap map). A check that costs under CHECK_FREE_SECONDS always runs: no
# user waits on it.
CHECK_SHARE = 0.05
CHECK_FREE_SECONDS = 0.1


def running_mean_share(examples: float, held: float) -> float:
    """The share of a hop's update that keeps a travelling model the running mean of the models
    its clients returned: n_j / (held + n_j), with n_j the hop's examples and `held` the examples
    already folded into the model (0 for a chain's first hop, whose share is 1).

    Hop j then gives m_j = m_{j−1} + n_j/(N_{j−1} + n_j)·(w_j − m_{j−1}), so the chain ends at the
    example-weighted mean of the w_j: no client's hop can erase the ones before it, however far
    its local steps take it, while each still starts from the chain's model. With equal
    clients the hops' shares are 1, 1/2, 1/3, …: at small steps the chain moves about as far as
    with the fixed η = 0.5 (the mean share over five hops is 0.46).
    """
    return float(examples) / (float(held) + float(examples))


def even_share(examples: float, planned: float) -> float:
    """The share of a hop's update when every hop counts as much as its client's data counts in
    the chain: n_j / N, N the examples the chain folds in all (at most 1).

    The chain then ends at m_0 + Σ_j (n_j/N)·(w_j − m_{j−1}): its clients' updates weighted as
    FedAvg weighs them, each computed where the chain has got to. Every hop starts near the
    chain's start (after j hops the model has moved by about j/N of an update), so the models
    averaged at the end started from nearby points, which is what lets FedAvg average models
    trained far apart. Measured: safe at every step size of the sequential-stability map, but
    at small steps the chain moves no further than FedAvg and FedSeq's lead there is gone.
    """
    return min(1.0, float(examples) / float(planned))


def adapt_step(step: float, hop_ratio: float) -> float:
    """The next η: `step` × (TARGET_HOP_RATIO / hop_ratio)^STEP_GAIN, within [STEP_LOW, 1].

    `hop_ratio` is the median, over the later hops since the last aggregation, of a hop's length
    over its client's latest first hop (a hop that started from the averaged model). A chain
    whose later hops are much longer than the same clients' first hops is being
    overwritten at every hop: each client starts from a model fitted to other classes. A smaller
    step keeps the travelling model nearer the average, and the next hop shorter; hops no longer
    than first hops let η grow back to 1 (the papers' algorithm).
    """
    return min(1.0, max(STEP_LOW, step * (TARGET_HOP_RATIO / hop_ratio) ** STEP_GAIN))


def chain_step(step: float, chain_hops: int, examples: float, planned: float) -> float:
    """The share of a hop of a chain of `chain_hops` hops that folds `planned` examples in all:
    `step`, but never less than the hop's share of the chain's data (`even_share`), and 1 for a
    chain of one hop.

    A chain of one hop starts from the global model and ends there: it is a FedAvg client, and a
    damped step would only make it FedAvg with a smaller server step (FedSeq with clients larger
    than its superclient size is such a federation). The floor carries that to short chains: a
    chain of two moves at least as far as its clients' FedAvg update, not a quarter of the way,
    beside chains of one taken whole (Dir(0.1) forms both: docs/results.md, the swap map). Chains
    of more than 1/`step` equal clients keep `step`."""
    if chain_hops == 1:
        return 1.0
    return max(step, even_share(examples, planned))


def relative_hop(hop_lengths: Sequence[float], start_norm: float) -> float | None:
    """The median of `hop_lengths` (each the norm of the update its client returned) over
    `start_norm` (the norm of the model the chains started from); None where there is nothing
    to measure."""
    if not hop_lengths or not start_norm > 0:
        return None
    return float(np.median(hop_lengths)) / start_norm


def sized_step(relative: float | None, damped: float) -> float:
    """η from the run's first aggregation on: 1 when the hops before it moved the model by at most
    SMALL_HOP of its norm (`relative`, from `relative_hop`), else `damped`; `damped` where there
    was nothing to measure.

    A hop's length against the model it trains is the clients' local work (learning rate ×
    steps × gradient) in the one unit every federation shares. Short hops leave a chain's
    model near what the clients before fitted, so taking them whole keeps what the chain
    learned and moves it as far as the papers' algorithm does; long hops overwrite it, and only
    a damped step keeps the chains' models near enough to average."""
    return 1.0 if relative is not None and relative <= SMALL_HOP else damped


def averaged_too_rarely(models: str, period: int, num_rounds: int) -> str | None:
    """Why no check can judge early a run that averages its `models` every `period` rounds
    (FedCat's copies, FedSeqInter's slots), or None. The checks judge averaged models, two of them
    before they warn, so where the second average (round 2·period) comes after half of
    `num_rounds` a run that trails FedAvg is told only near its end. A run that averages every
    round is judged every round, as FedSeq's is."""
    if period <= 1 or 4 * period <= num_rounds:
        return None
    averages = num_rounds // period
    return (
        f"{models} are averaged every {period} rounds: {num_rounds} rounds give {averages} "
        f"average{'s' * (averages != 1)}, so no check can compare this run with FedAvg before round "
        f"{min(2 * period, num_rounds)}"
    )


def witness_due(aggregation: int, last: bool = False) -> bool:
    """Whether the `aggregation`-th aggregation (from 1; `last`: the run's last) compares the
    chains with their first hops."""
    return last or aggregation <= WITNESS_FIRST or aggregation % WITNESS_EVERY == 0


def witness_warns(losses_in_a_row: int, last: bool) -> bool:
    """Whether the chains' losses to their first hops (the comparisons lost in a row, this one
    included) are to be warned about: LOSSES_TO_WARN of them, or one at the run's `last`
    aggregation, where the run ends behind the FedAvg round it could have had."""
    return losses_in_a_row >= LOSSES_TO_WARN or (last and losses_in_a_row >= 1)


def witness_lost(chains_accuracy: float, first_hops_accuracy: float) -> bool:
    """Whether the chains lost the comparison: the first hops score more than WITNESS_MARGIN above."""
    return first_hops_accuracy > chains_accuracy + WITNESS_MARGIN


def scored_parts(weights: Sequence[float]) -> list[int]:
    """The indices of the averaged models scored one by one: the MAX_PARTS_SCORED heaviest, in order."""
    return sorted(sorted(range(len(weights)), key=lambda i: -weights[i])[:MAX_PARTS_SCORED])


def parts_due(aggregation: int, last: bool) -> bool:
    """Whether the `aggregation`-th aggregation scores the averaged models one by one."""
    return last or aggregation == 1 or aggregation % PART_CHECK_EVERY == 0


def check_affordable(spent: float, cost: float, elapsed: float) -> bool:
    """Whether a check whose evaluations cost `cost` seconds may run, the checks having spent
    `spent` seconds of the run's `elapsed`: it is cheaper than CHECK_FREE_SECONDS, or the
    checks' seconds stay within CHECK_SHARE of the run's with it."""
    return cost < CHECK_FREE_SECONDS or spent + cost <= CHECK_SHARE * elapsed


@dataclass(frozen=True)
class Divergence:
    """How far the chains' models ended apart when they were averaged.

    `update` is the mean distance each model moved from the common start, `spread` the mean
    distance of each model from their weighted average, `ratio` = spread / update (0: the
    chains all moved alike; ≈ sqrt(1 − 1/K): K independent directions of equal length).
    """

    update: float
    spread: float
    ratio: float

    def as_record(self) -> dict[str, float]:
        """JSON-ready, rounded."""
        return {"update": round(self.update, 6), "spread": round(self.spread, 6), "ratio": round(self.ratio, 4)}


def divergence(start: Weights, models: Sequence[Weights], weights: Sequence[float]) -> Divergence:
    """The `Divergence` of `models` (all trained from `start`) around their `weights`-weighted mean."""
    if not models:
        raise ValueError("no models to compare")
    origin = flatten(start)
    vectors = np.stack([flatten(model) for model in models])
    share = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    average = share @ vectors
    update = float(np.mean(np.linalg.norm(vectors - origin, axis=1)))
    spread = float(np.mean(np.linalg.norm(vectors - average, axis=1)))
    return Divergence(update, spread, spread / update if update > 0 else 0.0)


def chance_level(start_accuracy: float, start_loss: float | None = None) -> float | None:
    """The accuracy of guessing, estimated from the model a run starts from: its accuracy, or
    e^(−its cross-entropy loss) when larger (an untrained model's loss is about ln C, so e^−loss
    is about 1/C even when its accuracy happens to fall below 1/C). None for a start model that
    is trained already (accuracy ≥ TRAINED_START): it is not at chance."""
    if start_accuracy >= TRAINED_START:
        return None
    if start_loss is None or not math.isfinite(start_loss):
        return start_accuracy
    return max(start_accuracy, min(TRAINED_START, math.exp(-start_loss)))


def fedavg_as_low(chance: float | None, first_hops_accuracy: float | None) -> bool:
    """Whether the FedAvg round the chains' first hops form, at its last comparison
    (`first_hops_accuracy`), scored as near `chance` as a stalled run: below
    EARLY_STALL_FACTOR·chance. A stall is then no evidence against the chains alone, and the
    warning says so. On the swap map's 100 × 400 CIFAR-10 cells FedSeq was still near chance at
    aggregation 5 while ahead of FedAvg with every node, its first hops' round at 0.09-0.10; a run
    whose chains broke the model at its first aggregation (the sequential-stability map's
    paper-exact FedSeq, quickstart at lr 0.05) shows the same figures. Only a FedAvg run of the
    same settings tells the two apart."""
    return chance is not None and first_hops_accuracy is not None and first_hops_accuracy < EARLY_STALL_FACTOR * chance


def stalled(aggregation: int, chance: float | None, average_accuracy: float, last: bool = False) -> str | None:
    """`diverged`'s first sign alone: why the averaged model counts as still near `chance`, or None."""
    factor = FINAL_STALL_FACTOR if last else EARLY_STALL_FACTOR if aggregation >= STALL_AGGREGATIONS else None
    if chance is None or factor is None or average_accuracy >= factor * chance:
        return None
    return (
        f"after {aggregation} aggregation{'s' if aggregation != 1 else ''} the averaged model scores "
        f"{average_accuracy:.3f}, under {factor:g}x chance ({chance:.3f}, the level of the model the run started from)"
    )


def diverged(
    aggregation: int,
    chance: float | None,
    average_accuracy: float | None,
    part_accuracies: Sequence[float],
    last: bool = False,
) -> str | None:
    """Why the chains look broken at their `aggregation`-th averaging (counted from 1), or None.

    Two signs, both from accuracies on the server's test set: the averaged model is still near
    `chance` (`chance_level`; below EARLY_STALL_FACTOR·chance from the STALL_AGGREGATIONS-th
    aggregation on, below FINAL_STALL_FACTOR·chance at the run's `last` one), or it scores much
    worse than the models it averages.
    """
    if average_accuracy is None:
        return None
    if reason := stalled(aggregation, chance, average_accuracy, last):
        return reason
    if part_accuracies:
        mean_part = float(np.mean(part_accuracies))
        if average_accuracy < mean_part - AVERAGE_ACCURACY_DROP_LIMIT:
            return (
                f"the average scores {average_accuracy:.3f} while the models it averages score "
                f"{mean_part:.3f} on average"
            )
    return None
