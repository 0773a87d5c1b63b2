"""The bound on what one reply may do to a model: one rule for every strategy.

A reply moves a model from the `origin` it was sent (FedAvg's global model, FedCat's copy, the
previous client's model in a FedSeq chain) to the model it returns; its *update* is the
difference, its *length* the update's norm. The server takes a share s of each update:

    s = min(step, c·r/length)

where `step` is what the strategy would take anyway (1 for an average; a sequential strategy's
damped step η) and c·r the bound: c times the *reference* r, the lower median of the recent
lengths of honest-looking updates of the same kind. An update no longer than c·r is taken as the
strategy would take it; a longer one is scaled down to length c·r, so no single reply can move
the model further than c ordinary updates, whatever its client sent. A reply's weight (its
num-examples) is bounded the same way: at most c_w times the lower median of the recent weights.
A capped weight still counts c_w times an ordinary one, which, where few replies are averaged
(FedConcat's head over ten label-skewed nodes, a small cluster), is enough for one node's classes
to take over. So a node's weight is also measured against its own previous report: a report more
than c_w times both that and the reference (10¹² examples from a node that has reported 400)
counts as the previous report (`bounded_weight`); its update, which nothing says is wrong, is
kept. A node that reports a large size from the first, or keeps reporting it, is capped at c_w·r:
its size is consistent, and a large client is not told apart from a liar by one report.

The lower median (the ⌈n/2⌉-th smallest value) rather than the median: of two values it is the
smaller, so one honest and one outsized reply give the honest one's length, not their mean.

An update longer than REJECT_BEYOND bounds (REJECT_BEYOND·c·r: 100 r at the default c) is not
scaled down but rejected, as a malformed reply is. No honest update comes near it (the longest
measured in any clean run of the robustness bench and the digits suites: 8 r), and the
direction of a reply a million times too long, a bug or an attack, is worth no share: clipped,
a reply × 10⁶ still moves the model c·r along its own weights, which grows them (measured:
FedConcat's clusters of two members, FedDyn's h; docs/strategies.md "Bounded replies").

A reference rests on at least two lengths. One length alone is the reply's own (the first reply
of a stream, e.g. a FedConcat cluster of one member whose earlier replies were all rejected):
measured against itself, even a reply × 10⁶ would pass. Such a stream is measured against the
recent lengths of its peers too, streams whose updates are of the same kind (FedConcat's other
clusters; `stream_reference`). A reply with no other length at all (the very first reply of a
run with the rest of its hop lost, e.g. FedCat's first hop) is measured against the model it was
sent: an update longer than REJECT_BEYOND·c times that model's norm is rejected
(`outsized_alone`; no honest update moves a model a hundred times its own length, and a reply ×
10⁶ is a million times it). That norm is no update length, so nothing is clipped against it.

Models are `{name: numpy array}` mappings; everything here is pure numpy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

Weights = Mapping[str, np.ndarray]

# How many recent lengths (or weights) of earlier hops join the reference, besides the hop's own.
REFERENCE_WINDOW = 10
# The default clips c (updates) and c_w (weights) of every strategy (run-config `update-clip`,
# `weight-clip`); docs/strategies.md, "Bounded replies", gives the evidence behind them.
DEFAULT_UPDATE_CLIP = 4.0
DEFAULT_WEIGHT_CLIP = 4.0
# An update longer than this many bounds is rejected instead of clipped.
REJECT_BEYOND = 25.0


def flatten(model: Weights) -> np.ndarray:
    """The model's floating-point arrays as one float64 vector (keys in sorted order)."""
    floats = [
        np.asarray(model[key], dtype=np.float64).ravel()
        for key in sorted(model)
        if np.issubdtype(np.asarray(model[key]).dtype, np.floating)
    ]
    return np.concatenate(floats) if floats else np.zeros(0)


def update_vector(origin: Weights | None, returned: Weights) -> np.ndarray:
    """returned − origin over the floating-point arrays, flat (origin None: returned, for replies
    that are updates themselves, such as SCAFFOLD's Δy and Δc); its norm is the update's length."""
    return flatten(returned) if origin is None else flatten(returned) - flatten(origin)


def reference(values: Iterable[float]) -> float | None:
    """r: the lower median of `values` (the ⌈n/2⌉-th smallest), None when there are none."""
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2]) if ordered else None


def stream_reference(own: Sequence[float], others: Iterable[float]) -> float | None:
    """r of a stream whose recent and current lengths are `own`: their lower median when there are
    at least two, else the lower median of `own` with `others` (its peer streams' lengths)."""
    return reference(own if len(own) >= 2 else [*own, *others])


def bound_share(length: float, ref: float | None, clip: float, step: float = 1.0) -> float:
    """s = min(step, clip·r/length): the share of an update of this `length` the server takes.

    No bound applies when `clip` is 0 (off), when there is no reference yet (r None or 0), or to
    an update that did not move the model.
    """
    if clip <= 0 or ref is None or ref <= 0 or length <= 0:
        return step
    return min(step, clip * ref / length)


def outsized(length: float, ref: float | None, clip: float) -> bool:
    """Whether an update of this `length` is too long to be an update at all: longer than
    REJECT_BEYOND·clip·r (never when `clip` is 0, the bound off, or there is no reference)."""
    return clip > 0 and ref is not None and ref > 0 and length > REJECT_BEYOND * clip * ref


def outsized_alone(length: float, origin: Weights | None, clip: float) -> bool:
    """Whether an update with no other length to be measured against is too long to be one: longer
    than REJECT_BEYOND·clip times the norm of `origin`, the model it was sent (never for updates
    that are replies themselves, origin None; never with `clip` 0, the bound off)."""
    return origin is not None and outsized(length, float(np.linalg.norm(flatten(origin))), clip)


def bounded_weight(weight: float, ref: float | None, clip: float, previous: float | None = None) -> float:
    """min(weight, clip·r): a reply's weight (num-examples) bounded by its reference (clip 0: off);
    a weight more than clip times both r and its node's `previous` report is a jump no node's
    data makes, and counts as that previous report (bounded the same way)."""
    if clip <= 0 or ref is None or ref <= 0:
        return weight
    if previous is not None and weight > clip * max(previous, ref):
        weight = previous
    return min(weight, clip * ref)


def move(origin: Weights, returned: Weights, share: float) -> dict[str, np.ndarray]:
    """origin + share·(returned − origin), key by key, each array keeping its dtype.

    Integer arrays (BatchNorm's `num_batches_tracked`) are counters, not weights: they take the
    returned value. `share` = 1 returns `returned` exactly.
    """
    if not 0.0 < share <= 1.0:
        raise ValueError(f"the share of an update must be in (0, 1], got {share}")
    if set(origin) != set(returned):
        raise ValueError(f"models differ in keys: {sorted(set(origin) ^ set(returned))}")
    moved = {}
    for key, before in origin.items():
        after = returned[key]
        if share == 1.0 or not np.issubdtype(before.dtype, np.floating):
            moved[key] = np.array(after, copy=True)
        else:
            step = before.astype(np.float64) + share * (after.astype(np.float64) - before.astype(np.float64))
            moved[key] = step.astype(before.dtype)
    return moved


def scale(update: Weights, share: float) -> dict[str, np.ndarray]:
    """share·update for the floating-point arrays (an update that is itself the reply, e.g.
    SCAFFOLD's Δy); integer arrays are kept as they are."""
    return {
        key: (value.astype(np.float64) * share).astype(value.dtype) if np.issubdtype(value.dtype, np.floating) else value
        for key, value in update.items()
    }
