"""What a table reports about one run: functions of a run's metrics.json, nothing else.

Every column is a `Column`: a title and a function from one run's metrics (the parsed
metrics.json) to a number, or None where the run has no such figure (e.g. FedSeq's balance
ratio for a FedAvg run). The report aggregates these per cell over seeds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Metrics = dict[str, Any]


@dataclass(frozen=True)
class Column:
    """One figure per run, summarized per cell as mean ± std over seeds, shown with `decimals`
    decimals (None: by magnitude)."""

    title: str
    extract: Callable[[Metrics], float | None]
    decimals: int | None = None


def total_megabytes(metrics: Metrics) -> float:
    """Measured bytes down + up over the whole run (setup stages included), in MB."""
    return (metrics["total_bytes_sent"] + metrics["total_bytes_received"]) / 1e6


def setup_value(key: str) -> Callable[[Metrics], float | None]:
    """A number the strategy put into metrics.json's `setup` (None when absent)."""
    return lambda metrics: metrics["setup"].get(key)


def mean_covered_classes(kind: str) -> Callable[[Metrics], float | None]:
    """FedSeq: classes covered per superclient, averaged over superclients (`kind`: true/estimated)."""

    def covered(metrics: Metrics) -> float | None:
        values = [entry[kind]["covered_classes"] for entry in metrics["setup"].get("superclients", []) if kind in entry]
        return sum(values) / len(values) if values else None

    return covered


def stage_megabytes(stage: str) -> Callable[[Metrics], float | None]:
    """FedConcat's per-stage byte total (down + up) from its last round's running totals, in MB."""

    def total(metrics: Metrics) -> float | None:
        stages = metrics["rounds"][-1].get("bytes_by_stage") if metrics["rounds"] else None
        return (stages[stage]["sent"] + stages[stage]["received"]) / 1e6 if stages else None

    return total


def label_stage_megabytes(metrics: Metrics) -> float | None:
    """FedConcat's stage 1 (label distributions, or FedConcat-ID's inference round), in MB."""
    if not metrics["strategy"].startswith("fedconcat"):
        return None
    return (metrics["setup"].get("bytes_sent", 0) + metrics["setup"].get("bytes_received", 0)) / 1e6


def curve(metrics: Metrics) -> list[tuple[int, float, float]]:
    """(round, cumulative MB, accuracy) at the initial model and after every evaluated round.

    Round 0 is the initial model at 0 MB. Bytes spent before round 1 (FedSeq's pre-training,
    FedConcat's label stage) count from round 1 on, so the curve shows what they cost.
    """
    points = [(0, 0.0, metrics["initial"]["accuracy"])]
    spent = metrics["setup"].get("bytes_sent", 0) + metrics["setup"].get("bytes_received", 0)
    for record in metrics["rounds"]:
        spent += record["bytes_sent"] + record["bytes_received"]
        if "accuracy" in record:
            points.append((record["round"], spent / 1e6, record["accuracy"]))
    return points


def best_accuracy(metrics: Metrics) -> float:
    """The highest accuracy the run's global model reached (initial model included)."""
    return max(accuracy for _, _, accuracy in curve(metrics))


def rounds_to(threshold: float) -> Callable[[Metrics], float | None]:
    """The first round whose accuracy is at least `threshold` (None: never reached)."""

    def first(metrics: Metrics) -> float | None:
        return next((float(r) for r, _, accuracy in curve(metrics)[1:] if accuracy >= threshold), None)

    return first


FINAL_ACCURACY = Column("final accuracy", lambda metrics: metrics["final_accuracy"])
FINAL_ACCURACY_PERCENT = Column("final accuracy (%)", lambda metrics: 100 * metrics["final_accuracy"], decimals=1)
TOTAL_MEGABYTES = Column("total MB (down+up)", total_megabytes)
WALL_SECONDS = Column("wall s", lambda metrics: metrics["wall_seconds"])
