"""FedCat's rules as pure functions (Hu et al., "FedCat: Towards Accurate Federated Learning
via Device Concatenation").

Notation: K copies of the global model travel over K devices per round; r counts rounds from
0 (since the current K took effect), offset = r % K is the position inside the K-round cycle,
and every λ·K rounds the nodes are redrawn into K groups. Everything here is numpy in, numpy
(or plain Python) out; randomness comes only from the `numpy.random.Generator` passed in, so the
strategy's one seeded generator makes a run reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .sequential import averaged_too_rarely


def devices_per_round(requested: int, fraction: float, num_nodes: int) -> int:
    """K before it is capped by the nodes available: `requested` when > 0, else
    round(fraction · N) and at least 2 (a cycle of one device would concatenate nothing)."""
    if requested > 0:
        return requested
    return max(2, int(round(fraction * num_nodes)))


# The longest cycle measured level with or ahead of FedAvg at FedCat's participation on label-skewed
# real images (docs/results.md): K = 2 and 3 were ahead; K = 4, 5 and 10 trailed.
LEVEL_K = 3


def long_cycle(k: int) -> str | None:
    """Why FedCat with this K is expected to trail FedAvg at its participation, or None. Each copy
    takes K hops between averages, over K clients' skewed data, where FedAvg(fraction_train=K/N)
    averages every round. Measured on real images: K = 2 ahead in every cell (CIFAR-10 and
    Fashion-MNIST, 10 clients of 4,000 images; Fashion-MNIST, 100 of 400, 40 rounds), K = 3 ahead
    (Fashion-MNIST, 100 of 400, 40 rounds); K = 4 behind on 20 clients of 600 (MNIST Dir(0.1)
    within noise, CIFAR-10 Dir(1.0) by 9 points); K = 5 behind by 4 after 40 rounds, K = 10 at
    every horizon from 10 to 100 rounds (taking hops whole did not help). A K above the longest
    cycle measured level (`LEVEL_K`) is told, whatever the run's length."""
    if k <= LEVEL_K:
        return None
    return (
        f"K = {k}: each copy takes {k} hops between averages, where FedAvg(fraction_train=K/N) averages every "
        "round; on label-skewed images FedCat trailed FedAvg at that participation with K = 4 (CIFAR-10 Dir(1.0), "
        "20 clients: 9 points), K = 5 (4 after 40 rounds) and K = 10 (at every horizon from 10 to 100 rounds: 3-14 "
        f"points), while K <= {LEVEL_K} was ahead in every cell measured (docs/results.md). Use k <= {LEVEL_K} "
        "(k=, fraction_train=), FedAvg(fraction_train=K/N), or FedSeq"
    )


def judged_late(k: int, num_rounds: int) -> str | None:
    """Why no check can judge a FedCat run early, or None: its copies are averaged every K rounds
    (`core.sequential.averaged_too_rarely`). The reason quotes the swap map's runs whose checks
    spoke only at their last round (docs/results.md)."""
    if (reason := averaged_too_rarely(f"K = {k} copies", k, num_rounds)) is None:
        return None
    return (
        f"{reason}; over 20 rounds K = N on 10 CIFAR-10 clients ended 19 and 22 points behind FedAvg with every "
        "node, K = 10 of 100 Fashion-MNIST clients 6-20 behind FedAvg at that participation (docs/results.md). "
        "Use a smaller K (k=, fraction_train=), more rounds, or FedAvg"
    )


def cycle_offset(round_index: int, k: int) -> int:
    """Position of round r inside its K-round cycle (0 = the cycle starts, copies are made)."""
    return round_index % k


def is_grouping_round(round_index: int, k: int, group_cycles: int) -> bool:
    """Whether the nodes are redrawn into groups at round r (every λ·K rounds, λ = `group_cycles`)."""
    return round_index % (group_cycles * k) == 0


def make_groups(nodes: Sequence[int], k: int, rng: np.random.Generator) -> list[list[int]]:
    """Randomly split `nodes` into `k` groups whose sizes differ by at most one.

    Indices are shuffled rather than the ids themselves, so node ids of any size (Flower's are
    unsigned 64-bit) stay plain Python ints.
    """
    if not 1 <= k <= len(nodes):
        raise ValueError(f"cannot split {len(nodes)} nodes into {k} non-empty groups")
    order = rng.permutation(len(nodes))
    return [[int(nodes[i]) for i in part] for part in np.array_split(order, k)]


class CountTable:
    """M: how often each node was selected at each cycle offset (N × K, rows made on first use).

    A node never seen before has count 0 everywhere, so nodes that join later need no setup.
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self._rows: dict[int, np.ndarray] = {}

    def counts(self, nodes: Sequence[int], offset: int) -> np.ndarray:
        """M[node][offset] for each of `nodes`, in order."""
        return np.array([self._rows[n][offset] if n in self._rows else 0 for n in nodes], dtype=np.int64)

    def increment(self, node: int, offset: int) -> None:
        """M[node][offset] += 1."""
        self._rows.setdefault(int(node), np.zeros(self.k, dtype=np.int64))[offset] += 1

    def state_dict(self) -> dict[str, Any]:
        """The table as node ids and an N × K count array."""
        nodes = list(self._rows)
        table = np.stack([self._rows[n] for n in nodes]) if nodes else np.zeros((0, self.k), np.int64)
        return {"k": self.k, "nodes": nodes, "counts": table}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> CountTable:
        """Rebuild a table saved with `state_dict`."""
        table = cls(int(state["k"]))
        table._rows = {int(n): np.array(row, dtype=np.int64) for n, row in zip(state["nodes"], state["counts"])}
        return table


def mbie_weights(counts: np.ndarray) -> np.ndarray:
    """MBIE-EB exploration weights 1/√count; a count of 0 gives +inf (never tried: most wanted)."""
    with np.errstate(divide="ignore"):
        return 1.0 / np.sqrt(np.asarray(counts, dtype=np.float64))


def pick_in_group(counts: np.ndarray, epsilon: float, rng: np.random.Generator) -> int:
    """Index (into the group) of the device chosen given the group's counts at this offset.

    With probability ε the device of largest weight (fewest selections; ties at random);
    otherwise a draw with probability w/Σw. When some devices were never selected their weight
    is +inf and w/Σw tends to the uniform distribution over exactly those devices, which is what
    is drawn from.
    """
    weights = mbie_weights(counts)
    if rng.random() < epsilon:
        return int(rng.choice(np.flatnonzero(weights == weights.max())))
    unvisited = np.isinf(weights)
    probabilities = unvisited / unvisited.sum() if unvisited.any() else weights / weights.sum()
    return int(rng.choice(len(weights), p=probabilities))


def select_grouped(
    groups: Sequence[Sequence[int]], table: CountTable, offset: int, epsilon: float, rng: np.random.Generator
) -> list[int]:
    """L_dev: one device per group (in group order) by `pick_in_group`, counting each choice in
    M[dev][offset]."""
    selected = []
    for group in groups:
        node = int(group[pick_in_group(table.counts(group, offset), epsilon, rng)])
        table.increment(node, offset)
        selected.append(node)
    return selected


def select_replacement(
    candidates: Sequence[int], table: CountTable, offset: int, epsilon: float, rng: np.random.Generator
) -> int | None:
    """The device that takes over a copy whose device did not answer: one of `candidates` (the
    connected members of the lost device's group not selected this round) by `pick_in_group`,
    counted in M[dev][offset] like any selection; None when there is no candidate."""
    if not candidates:
        return None
    node = int(candidates[pick_in_group(table.counts(candidates, offset), epsilon, rng)])
    table.increment(node, offset)
    return node


def select_random(nodes: Sequence[int], k: int, rng: np.random.Generator) -> list[int]:
    """The "w/ DC" ablation's L_dev: k distinct nodes drawn uniformly (no groups, no counts)."""
    return [int(nodes[i]) for i in rng.choice(len(nodes), size=k, replace=False)]


def dispatch(selected: Sequence[int], offset: int) -> list[int]:
    """TrainIter: the device each copy goes to, `result[i]` for copy i = L_dev[(offset + i) % K].

    Over a cycle (offset 0..K-1) copy i therefore visits the devices of groups i, i+1, …, i+K-1
    (mod K): every group once, in the paper's order.
    """
    k = len(selected)
    return [int(selected[(offset + i) % k]) for i in range(k)]
