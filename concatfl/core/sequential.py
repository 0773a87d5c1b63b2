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
* `diverged`: the accuracy-based signs that the chains have broken the model (the warning).

Models are `{name: numpy array}` mappings; everything here is pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .bounds import Weights, flatten

# A run whose averaged model, from its STALL_AGGREGATIONS-th aggregation on, scores below
# STALL_FACTOR times the model it started from (a random model: about chance) has stopped
# learning through its chains. In the sequential-stability map (digits, 3 seeds, 144 FedCat and
# FedSeq runs) it warned in every run that ended below 0.30 (23 of the 45 that ended more than
# 10 points below FedAvg) and in 3 of the 99 others (docs/results.md).
STALL_AGGREGATIONS = 3
STALL_FACTOR = 1.5
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


def diverged(
    aggregation: int,
    start_accuracy: float | None,
    average_accuracy: float | None,
    part_accuracies: Sequence[float],
) -> str | None:
    """Why the chains look broken at their `aggregation`-th averaging (counted from 1), or None.

    Two signs, both from accuracies on the server's test set: the averaged model has not left
    the level of the model the run started from (`start_accuracy`) by the
    STALL_AGGREGATIONS-th aggregation, or it scores much worse than the models it averages.
    """
    if average_accuracy is None:
        return None
    if (
        start_accuracy is not None
        and aggregation >= STALL_AGGREGATIONS
        and average_accuracy < STALL_FACTOR * start_accuracy
    ):
        return (
            f"after {aggregation} aggregations the averaged model scores {average_accuracy:.3f}, under "
            f"{STALL_FACTOR}x the {start_accuracy:.3f} of the model the run started from"
        )
    if part_accuracies:
        mean_part = float(np.mean(part_accuracies))
        if average_accuracy < mean_part - AVERAGE_ACCURACY_DROP_LIMIT:
            return (
                f"the average scores {average_accuracy:.3f} while the models it averages score "
                f"{mean_part:.3f} on average"
            )
    return None
