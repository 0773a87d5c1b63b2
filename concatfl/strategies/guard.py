"""The server's guard over replies: no single reply may move a model or weigh in without bound.

Validation (`common.reply_problem`) rejects replies that are malformed: wrong keys, shapes or
dtypes, NaN/Inf, a num-examples that is not a whole number ≥ 1. A reply can be well-formed and
still wrong: every weight multiplied by 10⁶ (an fp16 overflow, a wrong loss scale, or an
attacker), a num-examples of 10¹² (a loader that double counts). Averaged as it is, one such
reply wrecks the global model for good. `ReplyGuard.bound` applies the rule of
`concatfl.core.bounds` to every reply a strategy aggregates:

* its update (returned − sent) moves the model at most `update_clip` times the reference length
  r of its *stream* (the lower median of the recent lengths of updates of the same kind: FedAvg's
  client updates, FedCat's and FedSeq's first hops, SCAFFOLD's Δy, FedConcat's head updates…;
  a chain's later hops, which start from models fitted to other clients, are a kind of their own),
  or of every stream while its own has fewer than two lengths (`core.bounds.stream_reference`:
  a lone length would be the reply's own); an update longer than `core.bounds.REJECT_BEYOND`
  bounds is rejected instead (`on_reject`: the strategy moves it to its hop's misses), and so is
  a reply with no other length at all whose update is longer than that many bounds of the norm
  of the model it was sent (`core.bounds.outsized_alone`: the run's first reply, the rest of
  its hop lost);
* its weight (num-examples) counts at most `weight_clip` times the lower median of the recent
  weights of all replies (a node's data size does not depend on the kind of message it answers;
  one reference for all streams also keeps a few large members of one FedConcat cluster from
  being measured against a single small one); a report more than that many times both the
  reference and its node's own previous report counts as that previous report
  (`core.bounds.bounded_weight`);
* its direction (with `history_check`): an update whose cosine is below 0 with both its node's
  last update taken and last update seen in the same stream is reversed, and rejected like an
  outsized one (`core.witness`; the witnesses are kept as sketches, 4 KiB per node and stream, 8
  after a rejection).

Every clipped or down-weighted reply is recorded (node, stream, factor) under ``"guard"`` in the
round's record, and counted in the round's log line (rejected replies are the hops' misses); the
record also keeps, per stream, the reference and the largest length and weight relative to it
(``"streams"``: how close the round's replies came to the bounds); a node whose
replies are clipped, down-weighted or rejected in `WARN_AFTER_ROUNDS` rounds gets one WARNING
that names it. The sequential strategies' damped step η and their bound on later hops are the
same rule with another step and another clip (`ChainGuard`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.supercore import log

from ..core.bounds import (
    DEFAULT_UPDATE_CLIP,
    DEFAULT_WEIGHT_CLIP,
    REFERENCE_WINDOW,
    REJECT_BEYOND,
    bound_share,
    bounded_weight,
    move,
    outsized,
    outsized_alone,
    reference,
    scale,
    stream_reference,
    update_vector,
)
from ..core.witness import AGREEMENT_BOUND, sketch, update_believed
from .common import ARRAYS_KEY, METRICS_KEY, NUM_EXAMPLES_KEY, Miss, Reply, jsonable, to_numpy, without

# A node whose replies were clipped, down-weighted or rejected in this many rounds is named once.
WARN_AFTER_ROUNDS = 3
# A rejected update whose cosines with its witnesses are all closer to 0 than this shares no direction
# with them (noise, e.g. local DP) rather than reversing them: its reason says so. Reversed updates
# measured −0.96 to −0.12 (`core.witness`); two random directions of SKETCH_SIZE numbers about ±0.02.
NOISE_COSINE = 0.05


def check_clip(name: str, value: float) -> None:
    """A clip factor is 0 (off) or at least 1 (a bound below the reference would cut typical replies)."""
    if not (value == 0 or value >= 1):
        raise ValueError(f"{name} must be 0 (off) or >= 1, got {value}")


class ReplyGuard:
    """Bounded updates and weights for one strategy, and the record of every intervention.

    Parameters
    ----------
    strategy : str
        Name used in log messages.
    update_clip : float (default: DEFAULT_UPDATE_CLIP)
        c ≥ 1: an update moves the model at most c times the reference length of its stream;
        0 turns the bound off.
    weight_clip : float (default: DEFAULT_WEIGHT_CLIP)
        c_w ≥ 1: a reply's num-examples counts at most c_w times the lower median of the recent
        weights of all replies, and a report more than c_w times both that and its node's own
        previous report counts as the previous report; 0 turns both off.
    history_check : bool (default: True)
        Reject an update whose direction disagrees with its node's own last update taken and
        last update seen of the same stream (`core.witness.update_believed`: a reversed update);
        False: every update within the length bounds is taken. Off with `update_clip` 0 too
        (the bounds off: every reply taken as it is, the papers' algorithms).
    on_reject : Callable[[Reply, str], None] | None (default: None)
        Told of every reply `bound` leaves out (too long to be an update, or reversed against
        its node's history), with the reason (a strategy moves it to its hop's misses,
        `RelayStrategy.reject`); None: logged only.
    """

    def __init__(
        self,
        strategy: str,
        update_clip: float = DEFAULT_UPDATE_CLIP,
        weight_clip: float = DEFAULT_WEIGHT_CLIP,
        history_check: bool = True,
        on_reject: Callable[[Reply, str], None] | None = None,
    ) -> None:
        check_clip("update_clip", update_clip)
        check_clip("weight_clip", weight_clip)
        self.strategy = strategy
        self.update_clip = update_clip
        self.weight_clip = weight_clip
        self.history_check = history_check and update_clip > 0
        self.on_reject = on_reject
        self._lengths: dict[str, deque[float]] = {}
        self._weights: deque[float] = deque(maxlen=REFERENCE_WINDOW)
        self._reported: dict[int, float] = {}  # each node's latest num-examples, as reported
        # Each (stream, node)'s witnesses: the sketches of its last update taken and last seen.
        self._witnesses: dict[tuple[str, int], tuple[np.ndarray | None, np.ndarray]] = {}
        self._round = 0
        self._events: list[dict[str, Any]] = []
        self._streams: dict[str, dict[str, float | None]] = {}
        self._node_rounds: dict[int, set[int]] = {}
        self._warned: set[int] = set()

    # ------------------------------------------------------------------ bounding
    # pylint: disable=too-many-arguments, too-many-locals
    def bound(
        self,
        replies: Sequence[Reply],
        *,
        stream: str = "model",
        step: float | Callable[[int, int], float] = 1.0,
        hop_clip: float = 0.0,
        joins: bool = True,
        key: str = ARRAYS_KEY,
        from_zero: bool = False,
        weights: bool = True,
        peers: Sequence[str] = (),
    ) -> list[Reply]:
        """The replies with their updates and weights bounded (new `Reply` objects; a reply
        within every bound keeps its arrays object), less those whose update is too long to be
        one (`core.bounds.outsized`: handed to `on_reject`, their lengths and weights kept out
        of the references).

        `stream` names the reference the replies are measured against; `joins`: their lengths join
        it (updates from a common start: FedAvg's, a chain's first hops), else they are a chain's
        later hops: measured against `stream` (the hop clip, the outsized test, the direction check)
        and, for the update clip, against their own recent lengths (``stream/later``). `step` is the
        share the strategy takes of an update within the bounds (a chain's damped η), or
        `step(i, n)` for the i-th reply whose bounded num-examples are n (a chain's running mean);
        `hop_clip` a further bound (a chain's later hops). `key` is the ArrayRecord bounded;
        `from_zero`: its arrays are updates themselves (SCAFFOLD), else models to compare with what
        was sent. `weights`: bound num-examples too. `peers`: streams whose updates are of the same
        kind (FedConcat's other clusters); their lengths complete a reference that rests on fewer
        than two of the stream's own. With `history_check`, an update reversed against its node's
        earlier updates of the stream is rejected too. Each returned reply carries `length`,
        `reference` and `share`.
        """
        replies = list(replies)  # `on_reject` may take a reply out of the list passed (a hop's replies)
        if not replies:
            return []
        sent: dict[int, dict[str, np.ndarray]] = {}  # a hop sends most of its replies' origin once
        origins = [None if from_zero else _decoded_once(_sent(reply, key), sent) for reply in replies]
        returned = [reply.numpy(key) for reply in replies]
        lengths, directions = [], []  # one flat update at a time: a hop's together would be a copy of each model
        for origin, values in zip(origins, returned):
            update = update_vector(origin, values)
            lengths.append(float(np.linalg.norm(update)))
            directions.append(sketch(update) if self.history_check else None)
        window = self._lengths.setdefault(stream, deque(maxlen=REFERENCE_WINDOW))
        others = [length for name in peers if name != stream for length in self._lengths.get(name, ())]
        ref = stream_reference([*window, *(lengths if joins else [])], others)
        # Later hops start from models fitted to other clients' classes: about twice a first hop's length on
        # real images, they are clipped against their own recent lengths. The hop clip, the outsized test,
        # the direction check and the record keep the stream's.
        kind = stream if joins else f"{stream}/later"
        joined = self._lengths.setdefault(kind, deque(maxlen=REFERENCE_WINDOW))  # `window` itself for first hops
        clip_ref = ref if joins else stream_reference([*joined, *lengths], [] if ref is None else [ref])
        # No length but each reply's own: the model it was sent gives the scale of the rejection.
        alone = not window and not others and (len(lengths) == 1 or not joins)
        weight_ref = reference([*self._weights, *(reply.num_examples for reply in replies)]) if weights else None
        bounded = []
        for index, (reply, origin, values, direction, length) in enumerate(
            zip(replies, origins, returned, directions, lengths)
        ):
            if outsized(length, ref, self.update_clip):
                assert ref is not None
                self._reject(reply, f"update of length {length:.4g}, {length / ref:.3g} times the reference {ref:.4g} "
                             f"of stream '{stream}': beyond {REJECT_BEYOND:g} bounds, not an update")
                continue
            if alone and outsized_alone(length, origin, self.update_clip):
                self._reject(reply, f"update of length {length:.4g}, the first of stream '{stream}' with no other to measure "
                             f"it against: beyond {REJECT_BEYOND:g} bounds of the norm of the model it was sent, not an update")
                continue
            if direction is not None and not self._believed(reply, stream, direction):
                continue
            content = reply.content
            num_examples = reply.num_examples
            if weights:
                previous = self._reported.get(reply.node_id)
                self._reported[reply.node_id] = reply.num_examples
                num_examples = max(1, int(bounded_weight(reply.num_examples, weight_ref, self.weight_clip, previous)))
                if num_examples < reply.num_examples:
                    self._note(
                        reply, "down-weighted", stream=stream, factor=num_examples / reply.num_examples,
                        reported=reply.num_examples, weight=num_examples,
                        **({} if previous is None else {"previous": previous}),
                    )
                    content = _with_num_examples(content, num_examples)
            wanted = step(index, num_examples) if callable(step) else float(step)
            share = bound_share(length, clip_ref, self.update_clip, wanted)
            if share < wanted:
                self._note(reply, "clipped", stream=kind, factor=share / wanted, length=length,
                           bound=self.update_clip * clip_ref)
            share = min(share, bound_share(length, ref, hop_clip, wanted))
            decoded = reply.decoded
            if share < 1.0:
                moved = scale(values, share) if origin is None else move(origin, values, share)
                content = without(content, key)
                decoded = {**decoded, key: moved}
            bounded.append(
                dataclasses.replace(
                    reply, content=content, num_examples=num_examples, length=length, reference=ref, share=share,
                    decoded=decoded,
                )
            )
        self._measure(kind, ref, max(lengths), weight_ref, replies)
        joined.extend(reply.length for reply in bounded)
        if weights:  # as taken: a report of 10¹² examples joins as its bound, not as a new reference
            self._weights.extend(reply.num_examples for reply in bounded)
        return bounded

    def _believed(self, reply: Reply, stream: str, kept: np.ndarray) -> bool:
        """Whether the node's update (its `core.witness.sketch`) agrees with one of its witnesses;
        it becomes the node's last seen, and its last taken if believed; a reversed one is rejected."""
        taken, seen = self._witnesses.get((stream, reply.node_id), (None, None))
        trusted, agreements = update_believed(kept, taken, seen)
        self._witnesses[(stream, reply.node_id)] = (kept if trusted else taken, kept)
        if not trusted:
            cosines = ", ".join(f"{value:.2f} with its last update {name}" for name, value in agreements.items())
            self._reject(reply, f"update reversed against its node's own earlier ones in stream '{stream}' "
                         f"(cosine {cosines}; below {AGREEMENT_BOUND:g} with every one)" + _noise_hint(agreements))
        return trusted

    def _reject(self, reply: Reply, problem: str) -> None:
        if self.on_reject is not None:
            self.on_reject(reply, problem)
        else:
            log(WARNING, "%s: node %s left out: %s", self.strategy, reply.node_id, problem)

    # ------------------------------------------------------------------ records
    def begin_round(self, server_round: int) -> None:
        """Start the record of `server_round` (0: the strategy's setup before round 1)."""
        self._round, self._events, self._streams = server_round, [], {}

    def note_rejected(self, misses: Sequence[Miss]) -> None:
        """Count the rejected replies among `misses` (validation failures, not absences)."""
        for miss in misses:
            if miss.reason.startswith("rejected"):
                self._count(miss.request.node_id)

    def round_record(self) -> dict[str, Any]:
        """The interventions of the current round by kind, and the streams' figures ({} when no
        reply was bounded)."""
        record: dict[str, Any] = {}
        for event in self._events:
            record.setdefault(event["kind"], []).append({k: v for k, v in event.items() if k != "kind"})
        if self._streams:
            record["streams"] = {name: dict(figures) for name, figures in self._streams.items()}
        return record

    def _measure(
        self, name: str, ref: float | None, longest: float, weight_ref: float | None, replies: Sequence[Reply]
    ) -> None:
        """Keep the largest length and weight over their references that stream `name` saw this round."""
        figures = self._streams.setdefault(name, {"max_length_ratio": None, "max_weight_ratio": None})
        figures["reference"] = None if ref is None else round(ref, 6)
        if ref:
            figures["max_length_ratio"] = round(max(figures["max_length_ratio"] or 0.0, longest / ref), 4)
        if weight_ref:
            heaviest = max(reply.num_examples for reply in replies) / weight_ref
            figures["max_weight_ratio"] = round(max(figures["max_weight_ratio"] or 0.0, heaviest), 4)

    def _note(self, reply: Reply, kind: str, **details: Any) -> None:
        event = {"kind": kind, "node": reply.node_id, "tag": jsonable(reply.request.tag)}
        event.update({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in details.items()})
        self._events.append(event)
        self._count(reply.node_id)

    def _count(self, node_id: int) -> None:
        rounds = self._node_rounds.setdefault(node_id, set())
        rounds.add(self._round)
        if len(rounds) >= WARN_AFTER_ROUNDS and node_id not in self._warned:
            self._warned.add(node_id)
            log(
                WARNING,
                "%s: node %s sent replies that were clipped, down-weighted or rejected in rounds %s; its "
                "ClientApp may be buggy or hostile. Each case is recorded under 'guard' and in the hops' "
                "misses of metrics.json; this warning is logged once per node.",
                self.strategy,
                node_id,
                sorted(rounds),
            )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The references and the per-node counts: a resumed run bounds and warns as this one would."""
        return {
            "lengths": {stream: list(values) for stream, values in self._lengths.items()},
            "weights": list(self._weights),
            "reported": {str(node): weight for node, weight in self._reported.items()},
            "witnesses": [[stream, node, taken, seen] for (stream, node), (taken, seen) in self._witnesses.items()],
            "node_rounds": {str(node): sorted(rounds) for node, rounds in self._node_rounds.items()},
            "warned": sorted(self._warned),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output."""
        self._lengths = {s: deque(map(float, v), maxlen=REFERENCE_WINDOW) for s, v in state["lengths"].items()}
        self._weights = deque(map(float, state["weights"]), maxlen=REFERENCE_WINDOW)
        self._reported = {int(node): float(weight) for node, weight in state["reported"].items()}
        self._witnesses = {(stream, int(node)): (taken, seen) for stream, node, taken, seen in state["witnesses"]}
        self._node_rounds = {int(node): set(rounds) for node, rounds in state["node_rounds"].items()}
        self._warned = {int(node) for node in state["warned"]}


def _noise_hint(agreements: dict[str, float]) -> str:
    """What a rejection says when its cosines are all within NOISE_COSINE of 0: the update shares
    no direction with its node's earlier ones, which is what an update drowned in noise gives."""
    if not all(abs(value) < NOISE_COSINE for value in agreements.values()):
        return ""
    return (
        f"; cosines within {NOISE_COSINE:g} of 0 are also what updates drowned in noise give, such as those of "
        "Flower's LocalDpMod: with DP noise on the clients turn the check off (history_check=False, "
        "docs/privacy.md)"
    )


def _sent(reply: Reply, key: str) -> ArrayRecord:
    """What the request sent under `key` (its template for the model)."""
    if key == ARRAYS_KEY:
        template = reply.request.template()
        if template is not None:
            return template
    return reply.request.content.array_records[key]


def _decoded_once(record: ArrayRecord, decoded: dict[int, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """`record` as numpy, decoded on its first call with this `decoded` cache (keyed by object)."""
    if id(record) not in decoded:
        decoded[id(record)] = to_numpy(record)
    return decoded[id(record)]


def _with_num_examples(content: RecordDict, num_examples: int) -> RecordDict:
    metrics = content.metric_records[METRICS_KEY]
    return RecordDict({**dict(content.items()), METRICS_KEY: MetricRecord({**dict(metrics), NUM_EXAMPLES_KEY: num_examples})})

