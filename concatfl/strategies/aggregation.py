"""How the FedAvg family combines the (bounded) models of a round: the mean, or a robust rule.

The bound on every reply (`guard.ReplyGuard`) stops outsized replies; it cannot stop replies
that stay inside it, such as a sign-flipped update of ordinary length. The robust rules can,
as long as such replies are a minority of the round:

* ``mean``: the num-examples-weighted average (FedAvg; the default);
* ``median``: the coordinate-wise median (Yin et al. 2018; Flower's FedMedian);
* ``trimmed-mean``: the coordinate-wise mean without the `trim` largest and smallest shares
  (Yin et al. 2018; Flower's `trim_mean`, also the code of its FedTrimmedAvg);
* ``krum``: the one model closest to its n − f − 2 nearest neighbours (Blanchard et al. 2017),
  f = `byzantine`; ``multi-krum``: the weighted average of the n − f best-scored models
  (Flower's `select_multikrum`, the code of its Krum and MultiKrum).

Median and trimmed mean ignore num-examples (as Flower's do). Integer arrays (BatchNorm's
`num_batches_tracked`) are rounded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.multikrum import select_multikrum

from ..config import AGGREGATIONS
from .common import ARRAYS_KEY, to_record, weighted_average

if TYPE_CHECKING:
    from ..config import RunConfig

DEFAULT_TRIM = 0.2
DEFAULT_BYZANTINE = 1


@dataclass(frozen=True)
class Aggregation:
    """A rule that combines a round's models into one.

    Parameters
    ----------
    method : str (default: "mean")
        One of AGGREGATIONS (module docstring).
    trim : float (default: 0.2)
        ``trimmed-mean``: the share of values cut at each end of every coordinate, in [0, 0.5).
    byzantine : int (default: 1)
        ``krum``/``multi-krum``: f, the number of bad replies a round is assumed to hold.
    """

    method: str = "mean"
    trim: float = DEFAULT_TRIM
    byzantine: int = DEFAULT_BYZANTINE

    def __post_init__(self) -> None:
        if self.method not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.method!r}")
        if not 0.0 <= self.trim < 0.5:
            raise ValueError(f"the trimmed mean's trim must be in [0, 0.5), got {self.trim}")
        if self.byzantine < 0:
            raise ValueError(f"Krum's byzantine count must be >= 0, got {self.byzantine}")

    def __repr__(self) -> str:
        extra = {"trimmed-mean": f", trim={self.trim}", "krum": f", byzantine={self.byzantine}"}
        extra["multi-krum"] = extra["krum"]
        return f"Aggregation({self.method!r}{extra.get(self.method, '')})"

    def combine(self, models: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> ArrayRecord:
        """The `models` (numpy arrays by key, e.g. `Reply.numpy()`) with their `weights` combined into one."""
        if not models:
            raise ValueError("nothing to aggregate")
        if self.method == "mean":
            return weighted_average(models, weights)
        if self.method == "median":
            return _coordinatewise(models, lambda stacked: np.median(stacked, axis=0))
        if self.method == "trimmed-mean":
            return _coordinatewise(models, lambda stacked: trim_mean(stacked, self.trim))
        # Flower's selection reads records: Krum's rounds encode their models once more.
        contents = [RecordDict({ARRAYS_KEY: to_record(model)}) for model in models]
        selected = 1 if self.method == "krum" else max(1, len(models) - self.byzantine)
        chosen = {id(content) for content in select_multikrum(contents, self.byzantine, selected)}
        kept = [i for i, content in enumerate(contents) if id(content) in chosen]
        return weighted_average([models[i] for i in kept], [weights[i] for i in kept])


def from_config(config: RunConfig) -> Aggregation:
    """The run config's `aggregation`, `aggregation-trim` and `aggregation-byzantine`."""
    return Aggregation(config.aggregation, config.aggregation_trim, config.aggregation_byzantine)


def as_aggregation(value: str | Aggregation) -> Aggregation:
    """A strategy's `aggregation` argument: a method name (default settings) or an Aggregation."""
    return value if isinstance(value, Aggregation) else Aggregation(value)


def _coordinatewise(models: Sequence[Mapping[str, np.ndarray]], statistic) -> ArrayRecord:
    combined = {}
    for key in models[0].keys():
        arrays = [model[key] for model in models]
        dtype = arrays[0].dtype
        value = statistic(np.stack([a.astype(np.float64) for a in arrays]))
        value = np.rint(value) if np.issubdtype(dtype, np.integer) else value
        combined[key] = Array(np.asarray(value, dtype=dtype))
    return ArrayRecord(combined)
