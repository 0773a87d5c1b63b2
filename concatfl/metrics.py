"""metrics.json: the one place a run's results go, with one schema for every strategy.

{ "run_config": {...}, "strategy": str, "num_nodes": int, "setup": {...strategy's setup report},
  "initial": {"accuracy", "loss"}, "rounds": [{"round", "bytes_sent", "bytes_received", "seconds",
  "hops": [...], "aggregated", "accuracy"?, "loss"?, ...strategy-specific}],
  "final_accuracy", "final_loss", "total_bytes_sent", "total_bytes_received", "wall_seconds",
  "membership"?: {"placed", "never_trained"},
  "node_identity"?: {"identified", "late", "flower_ids", "unanswered"},
  "timing"?: {"setup_seconds", "checkpoint_seconds", "checkpoint_bytes"} }
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.json"


def summarize(
    run_config: dict[str, Any],
    strategy: str,
    num_nodes: int,
    setup: dict[str, Any],
    initial: dict[str, float],
    rounds: list[dict[str, Any]],
    wall_seconds: float,
    node_identity: dict[str, Any] | None = None,
    membership: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble the metrics document; the final accuracy is the last evaluated round's.

    `node_identity` is `StableNodeGrid.identity_report()`, `membership` the strategy's
    `Membership.report()` (each left out when None)."""
    evaluated = [record for record in rounds if "accuracy" in record] or [initial]
    document = {
        "run_config": run_config,
        "strategy": strategy,
        "num_nodes": num_nodes,
        "setup": setup,
        "initial": initial,
        "rounds": rounds,
        "final_accuracy": evaluated[-1]["accuracy"],
        "final_loss": evaluated[-1]["loss"],
        "total_bytes_sent": sum(record["bytes_sent"] for record in rounds) + setup.get("bytes_sent", 0),
        "total_bytes_received": sum(record["bytes_received"] for record in rounds)
        + setup.get("bytes_received", 0),
        "wall_seconds": round(wall_seconds, 3),
    }
    if node_identity is not None:
        document["node_identity"] = node_identity
    if membership is not None:
        document["membership"] = membership
    return document


def write_metrics(output_dir: str | os.PathLike, document: dict[str, Any]) -> Path:
    """Write metrics.json atomically (a reader never sees a half-written file)."""
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / METRICS_FILE
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as handle:
        try:
            json.dump(document, handle, indent=1, default=_to_builtin)
        except BaseException:
            handle.close()
            os.unlink(handle.name)
            raise
    os.replace(handle.name, target)
    return target


def read_metrics(output_dir: str | os.PathLike) -> dict[str, Any]:
    """Load a run's metrics.json."""
    return json.loads((Path(output_dir) / METRICS_FILE).read_text())


def _to_builtin(value: Any) -> Any:
    """numpy scalars and arrays → plain Python for JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to metrics.json")
