"""Witnesses for an update's direction: a node's own earlier updates.

A reply can be well-formed and of ordinary length and still undo training: an update with its
sign flipped (a wrong loss sign, gradient ascent, an attacker) moves the model exactly as far as
an honest one, the other way. Its length says nothing; its direction does. A node trains on the
same data every time it is asked, so its updates point much the same way from round to round:
measured over ten seeds at 30 % fuzzed replies (docs/strategies.md, "Directions"), the cosine of a
node's full-model update with its own previous honest update was 0.01 to 1 in FedSeq, 0.04 to 1
in FedAvg, −0.02 once and else 0.16 to 1 for the quickstart app's FedSeq; a sign-flipped update
after an honest one −0.96 to −0.12, an honest update after a sign-flipped one at most −0.43.

So an update is believed unless it disagrees (cosine below a bound, 0) with *every* witness
there is (`believed`). A node's witnesses are its last update the server *took* and its last
update the server *saw* (taken or not): with the taken one alone, a node whose first update was
reversed (taken: there was nothing to measure it against) would have every honest update after
it rejected; with the seen one alone, the honest update after a rejected reversed one would be
lost too. With both, one reversed update costs its own reply, and a node recovers by its next.
A node with no earlier update is believed (its first update has no witness).

The premise fails where something besides the node's data steers its update: SCAFFOLD's control
variates and FedDyn's linear term turn it toward the federation's direction, and a model that
already fits the node's few classes (a FedConcat cluster's) only swings about its optimum. Honest
updates disagree there, so those run without the check (docs/strategies.md, "Directions").

The server keeps these witnesses for every node, so they must be small whatever the model:
an update of more than SKETCH_SIZE numbers is kept as its count sketch (`sketch`: each
coordinate added, with a random sign, to one of SKETCH_SIZE buckets, the same for every node).
The sketch preserves inner products on average, and the cosine of two sketches differs from
the updates' own by about √((1 + cos²)/SKETCH_SIZE), 0.02–0.03 here (tests/test_witness.py checks
0.05 on updates of 100,000 numbers), well inside the 0.1 margin that separates the honest updates
measured above from the reversed ones. Kept at unit length as float16 (its rounding moves a
cosine by about 10⁻³): 4 KiB a sketch, one per node and stream while its last update seen is
its last taken, two after a rejection; 40 MiB for 10,000 nodes of one stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import numpy as np

# Buckets of an update's count sketch; an update of at most this many numbers is kept whole.
SKETCH_SIZE = 2048
# An update whose cosine with every witness is below this is not believed.
AGREEMENT_BOUND = 0.0
_SKETCH_SEED = 20_240_613  # one hash for every node and run: sketches must be comparable


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """cos(a, b); 0 when either is zero (no direction to compare)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / norms) if norms > 0 else 0.0


def believed(agreements: Mapping[str, float], bound: float = AGREEMENT_BOUND) -> bool:
    """Whether an update with these cosines with its witnesses is believed: unless every one is
    below `bound` (no witness at all: believed)."""
    return not agreements or max(agreements.values()) >= bound


def sketch(update: np.ndarray, size: int = SKETCH_SIZE) -> np.ndarray:
    """The direction of `update` (a flat vector) as kept for a witness: itself when it has at most
    `size` numbers, else its count sketch of `size` buckets (the same buckets and signs for every
    update of that length, so that sketches of two updates compare as the updates do); scaled to
    unit length (only the direction is compared) and stored as float16 (zeros stay zeros)."""
    update = np.asarray(update, dtype=np.float64).ravel()
    if update.size > size:
        buckets, signs = _hash(update.size, size)
        update = np.bincount(buckets, weights=signs * update, minlength=size)
    norm = float(np.linalg.norm(update))
    return (update / norm if norm > 0 else update).astype(np.float16)


@lru_cache(maxsize=8)
def _hash(length: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(_SKETCH_SEED)
    return rng.integers(0, size, length), rng.choice(np.array([-1.0, 1.0]), length)


def update_believed(
    update: np.ndarray, last_taken: np.ndarray | None, last_seen: np.ndarray | None, bound: float = AGREEMENT_BOUND
) -> tuple[bool, dict[str, float]]:
    """Whether a node's update (as `sketch` keeps it) is believed, and its cosine with each of its
    node's witnesses there is: its last update taken and its last seen (one witness when they
    are the same update)."""
    agreements = {}
    if last_taken is not None:
        agreements["taken"] = cosine(update, last_taken)
    if last_seen is not None and last_seen is not last_taken:
        agreements["seen"] = cosine(update, last_seen)
    return believed(agreements, bound), agreements
