"""What a strategy logs about itself: its parameters in a few lines, one line per round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def summary_value(value: Any, max_items: int = 4, max_chars: int = 60) -> str:
    """A short rendering of a parameter value for logs: numbers, strings and short sequences as
    they are; arrays and tensors by their shape; long sequences by their length; any other object
    by its repr when that is short, else by its type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (Path, torch.device)):
        return repr(str(value))
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return f"{type(value).__name__} of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        if len(value) > max_items:
            return f"<{len(value)} items>"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k!r}: {summary_value(v)}" for k, v in value.items()) + "}"
        inner = ", ".join(summary_value(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    text = repr(value)
    return text if len(text) <= max_chars and "\n" not in text else f"<{type(value).__name__}>"


def round_line(record: dict[str, Any]) -> str:
    """One round's progress line: accuracy and loss (when evaluated), traffic and time."""
    parts = [f"{key} {record[key]:.4f}" for key in ("accuracy", "loss") if key in record]
    parts.append(f"sent {record['bytes_sent'] / 1e6:.2f} MB, received {record['bytes_received'] / 1e6:.2f} MB")
    misses = [miss for hop in record["hops"] for miss in hop["misses"]]
    if misses:
        rejected = sum(miss["reason"].startswith("rejected") for miss in misses)
        parts.append(f"{len(misses)} missed replies" + (f" ({rejected} rejected)" if rejected else ""))
    for kind in ("clipped", "down-weighted"):
        if events := record.get("guard", {}).get(kind):
            parts.append(f"{len(events)} {kind}")
    return ", ".join(parts) + f", {record['seconds']:.2f} s"
