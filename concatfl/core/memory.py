"""Update memory: a client whose reply is lost still counts, with its latest update.

Averaging only the replies that arrived moves the model toward the data of the clients that
answered. Under label skew that is a different direction every round: a round that lost the
replies of the clients holding classes 3 and 7 pushes the model away from 3 and 7, the next
round away from others, and the model oscillates with whatever the last round happened to miss
(measured on FedConcat's classifier rounds, docs/strategies.md "Lost head replies").

With a memory the server keeps, per client, its latest update u_i = returned_i − sent_i and its
weight n_i, and aggregates the latest update of every client it has heard from, the fresh ones
where a reply arrived this round and the remembered ones where it did not:

    w ← aggregate over remembered clients i of (w + u_i), weighted by n_i

which for the weighted mean is w + Σ n_i u_i / Σ n_i (MIFA: Gu et al., 2021, "Fast Federated
Learning in the Presence of Arbitrary Device Unavailability"). When every client's reply
arrives it is the ordinary average of the replies. An update is remembered as the server took
it, after the reply bounds (`core.bounds`), so a remembered update is never longer than one the
server would have accepted.

Models are `{name: numpy array}` mappings; everything here is pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .bounds import Weights


@dataclass
class Remembered:
    """A client's latest update, its weight and the round it was sent in."""

    update: dict[str, np.ndarray]
    weight: float
    server_round: int


def update_of(sent: Weights, returned: Weights) -> dict[str, np.ndarray]:
    """returned − sent for the floating-point arrays (float32 kept); integer arrays (counters)
    have no update and are left out."""
    if set(sent) != set(returned):
        raise ValueError(f"models differ in keys: {sorted(set(sent) ^ set(returned))}")
    return {
        key: (np.asarray(returned[key]) - np.asarray(value)).astype(np.asarray(value).dtype)
        for key, value in sent.items()
        if np.issubdtype(np.asarray(value).dtype, np.floating)
    }


def applied(start: Weights, update: Weights) -> dict[str, np.ndarray]:
    """start + update, key by key (arrays without an update keep `start`'s value)."""
    return {
        key: (value + update[key]).astype(value.dtype) if key in update else np.array(value, copy=True)
        for key, value in ((key, np.asarray(value)) for key, value in start.items())
    }


class UpdateMemory:
    """Every client's latest update, keyed by node id."""

    def __init__(self) -> None:
        self.entries: dict[int, Remembered] = {}

    def remember(self, node: int, sent: Weights, returned: Weights, weight: float, server_round: int) -> None:
        """Keep `node`'s update (returned − sent) and weight, replacing what it sent before."""
        self.entries[node] = Remembered(update_of(sent, returned), float(weight), server_round)

    def models(self, start: Weights) -> tuple[list[dict[str, np.ndarray]], list[float]]:
        """(start + u_i, n_i) of every remembered client, in node order: what the aggregation
        combines."""
        nodes = sorted(self.entries)
        return [applied(start, self.entries[node].update) for node in nodes], [self.entries[node].weight for node in nodes]

    def summary(self, server_round: int) -> dict[str, Any]:
        """How many remembered updates are from `server_round` (fresh) and how many older
        (replayed), with the nodes replayed and the oldest round replayed."""
        replayed = {node: entry.server_round for node, entry in self.entries.items() if entry.server_round != server_round}
        return {
            "fresh": len(self.entries) - len(replayed),
            "replayed": sorted(replayed),
            "oldest_round": min(replayed.values()) if replayed else server_round,
        }

    def state_dict(self) -> dict[int, dict[str, Any]]:
        """The entries as plain data (for checkpoints)."""
        return {
            node: {"update": dict(entry.update), "weight": entry.weight, "server_round": entry.server_round}
            for node, entry in self.entries.items()
        }

    def load_state_dict(self, state: dict[Any, dict[str, Any]]) -> None:
        """Restore what `state_dict` returned."""
        self.entries = {
            int(node): Remembered(
                {key: np.asarray(value) for key, value in saved["update"].items()},
                float(saved["weight"]),
                int(saved["server_round"]),
            )
            for node, saved in state.items()
        }
