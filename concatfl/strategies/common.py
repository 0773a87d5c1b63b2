"""Plumbing shared by every concatfl strategy: requests, reply validation, the relay hop.

A *hop* is one batch of messages sent at once and the replies collected for it. FedAvg and
FedCat need one hop per round, FedSeq one hop per position in its client chains, FedConcat one
per stage round. Whatever the algorithm, a reply that is missing, carries an error or fails
validation becomes a `Miss` with a logged reason; it never reaches aggregation.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from .wire import message_bytes

ARRAYS_KEY = "arrays"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
NUM_EXAMPLES_KEY = "num-examples"
NO_REPLY = "no reply before the round timeout"  # a Miss's reason when nothing came
PULL_INTERVAL = 0.1  # seconds between two pulls of `relay_in_batches` (StableNodeGrid's default too)
# A Miss's reason when `relay_in_batches` never sent the request: the window was still full at the deadline.
NOT_SENT = "not sent before the round timeout (the hop's requests in flight did not answer)"
IN_FLIGHT = 256  # requests `relay_in_batches` keeps out at once


@dataclass
class Request:
    """One message the server wants to send in a hop.

    `tag` is the caller's label for the request (FedCat's copy index, FedSeq's superclient id,
    FedConcat's cluster id) so replies can be routed back without bookkeeping by node id.
    `expect_arrays` is the template a reply's ``"arrays"`` must match (keys, shapes, dtypes);
    by default the ``"arrays"`` that were sent, or no arrays check when none were sent.
    """

    node_id: int
    content: RecordDict
    message_type: str = MessageType.TRAIN
    tag: Any = None
    expect_arrays: ArrayRecord | None = None
    require_num_examples: bool = True

    def template(self) -> ArrayRecord | None:
        """ArrayRecord the reply must match, or None when the reply carries no model."""
        if self.expect_arrays is not None:
            return self.expect_arrays
        sent = self.content.array_records.get(ARRAYS_KEY)
        return sent


@dataclass
class Reply:
    """A validated reply: its content and its weight (num-examples).

    Once `guard.ReplyGuard.bound` has bounded it: `length` is the norm of its update as the
    client sent it, `reference` the reference length it was measured against and `share` the
    share of that update its content now holds.

    `decoded` holds its ArrayRecords as numpy, by record key, each decoded once: validation
    decodes the model while it checks it (`collect`), and the guard, the bounds and the
    aggregation read those very arrays (`numpy`). Arrays the guard bounded live there alone
    (their record leaves `content`); `record` encodes them when they leave the server.
    """

    request: Request
    content: RecordDict
    num_examples: int
    length: float | None = None
    reference: float | None = None
    share: float = 1.0
    decoded: dict[str, dict[str, np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def node_id(self) -> int:
        """Node that sent the reply."""
        return self.request.node_id

    @property
    def arrays(self) -> ArrayRecord:
        """The model (or model part) as an ArrayRecord (`record`)."""
        return self.record(ARRAYS_KEY)

    def record(self, key: str = ARRAYS_KEY) -> ArrayRecord:
        """The ArrayRecord under `key`: the one received, or, for arrays the guard bounded,
        encoded from `decoded` on first use (on their way out of the server)."""
        if key not in self.content.array_records:
            self.content = RecordDict({**dict(self.content.items()), key: to_record(self.decoded[key])})
        return self.content.array_records[key]

    @property
    def metrics(self) -> MetricRecord:
        """The client's MetricRecord."""
        return self.content.metric_records[METRICS_KEY]

    def numpy(self, key: str = ARRAYS_KEY) -> dict[str, np.ndarray]:
        """The ArrayRecord under `key` as numpy arrays (decoded on first use, then shared: do
        not change them in place)."""
        if key not in self.decoded:
            self.decoded[key] = to_numpy(self.content.array_records[key])
        return self.decoded[key]

    def drop_arrays(self) -> None:
        """Let go of the reply's arrays, keeping its metrics (a caller took what it needed)."""
        self.content = RecordDict(dict(self.content.metric_records))
        self.decoded = {}


@dataclass
class Miss:
    """A request that produced no usable reply, and why."""

    request: Request
    reason: str

    def as_record(self) -> dict[str, Any]:
        """JSON-ready description for metrics.json."""
        return {"node": self.request.node_id, "tag": jsonable(self.request.tag), "reason": self.reason}

    @property
    def answered(self) -> bool:
        """Whether a reply came (an error, or one that was rejected), as opposed to none in time
        (or no request sent)."""
        return self.reason not in (NO_REPLY, NOT_SENT)

    @property
    def short_reason(self) -> str:
        """The reason in one line, for logs: an error reply carries the client's whole traceback
        (kept in metrics.json); its last line holds the error's message."""
        lines = [line.strip() for line in self.reason.splitlines() if line.strip()]
        if len(lines) <= 1:
            return self.reason
        kind = self.reason.split(":", 1)[0]
        return f"{kind}: " + lines[-1].removesuffix("'>")


@dataclass
class HopResult:
    """Everything one hop produced, with its measured traffic and wall time."""

    replies: list[Reply] = field(default_factory=list)
    misses: list[Miss] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0

    def add(self, part: HopResult) -> None:
        """Take in a part of the same hop (`relay_in_batches`)."""
        self.replies.extend(part.replies)
        self.misses.extend(part.misses)
        self.bytes_sent += part.bytes_sent
        self.bytes_received += part.bytes_received
        self.seconds += part.seconds

    def as_record(self) -> dict[str, Any]:
        """JSON-ready summary of the hop for metrics.json."""
        return {
            "sent": len(self.replies) + len(self.misses),
            "replies": len(self.replies),
            "misses": [miss.as_record() for miss in self.misses],
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "seconds": round(self.seconds, 4),
        }


def reply_problem(
    content: RecordDict, template: ArrayRecord | None, require_num_examples: bool = True
) -> str | None:
    """Why a reply's content is unusable, or None when it is fine (`check_reply`'s verdict)."""
    return check_reply(content, template, require_num_examples)[0]


def check_reply(
    content: RecordDict, template: ArrayRecord | None, require_num_examples: bool = True
) -> tuple[str | None, dict[str, np.ndarray]]:
    """Why a reply's content is unusable (None when it is fine), and its model as decoded while
    checking it ({} when there is no template, or the reply is unusable).

    Checks the reply against the model that was sent (same keys, shapes and dtypes, in each
    array's header and in its decoded data: the client writes both), that every array is
    finite, and that ``metrics["num-examples"]`` is a whole number ≥ 1.
    """
    decoded: dict[str, np.ndarray] = {}
    if template is not None:
        arrays = content.array_records.get(ARRAYS_KEY)
        if arrays is None:
            return f"no ArrayRecord under '{ARRAYS_KEY}'", {}
        if set(arrays.keys()) != set(template.keys()):
            missing = sorted(set(template.keys()) - set(arrays.keys()))
            extra = sorted(set(arrays.keys()) - set(template.keys()))
            return f"array keys differ from the model sent (missing {missing}, unexpected {extra})", {}
        for key, expected in template.items():
            got = arrays[key]
            if tuple(got.shape) != tuple(expected.shape):
                return f"shape of '{key}' is {tuple(got.shape)}, expected {tuple(expected.shape)}", {}
            if got.dtype != expected.dtype:
                return f"dtype of '{key}' is {got.dtype}, expected {expected.dtype}", {}
            try:
                values = got.numpy()
            except Exception as error:  # pylint: disable=broad-except  # client bytes must never crash the server
                return f"'{key}' does not decode as a numpy array ({type(error).__name__}: {error})", {}
            if values.shape != tuple(expected.shape) or str(values.dtype) != expected.dtype:
                return (
                    f"data of '{key}' is {values.shape} {values.dtype}, not the {tuple(expected.shape)} "
                    f"{expected.dtype} its header declares"
                ), {}
            if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
                return f"non-finite values (NaN/Inf) in '{key}'", {}
            decoded[key] = values
        # in the reply's own key order, as to_numpy would give them
        decoded = {key: decoded[key] for key in arrays.keys()}
    if require_num_examples:
        metrics = content.metric_records.get(METRICS_KEY)
        if metrics is None or NUM_EXAMPLES_KEY not in metrics:
            return f"no '{METRICS_KEY}' MetricRecord with '{NUM_EXAMPLES_KEY}'", {}
        num_examples = metrics[NUM_EXAMPLES_KEY]
        if (
            isinstance(num_examples, list)
            or not math.isfinite(num_examples)
            or num_examples < 1
            or num_examples != int(num_examples)
        ):
            return f"'{NUM_EXAMPLES_KEY}' must be a whole positive number, got {num_examples!r}", {}
    return None, decoded


def without(content: RecordDict, key: str) -> RecordDict:
    """`content` less its record `key` (a reply whose arrays under `key` were replaced in `decoded`)."""
    return RecordDict({name: record for name, record in content.items() if name != key})


def to_messages(requests: Sequence[Request]) -> list[Message]:
    """One Message per request (callers give each request its own RecordDict: `train_content`)."""
    node_ids = [request.node_id for request in requests]
    if len(set(node_ids)) != len(node_ids):
        raise ValueError(f"a hop sends at most one message per node, got nodes {node_ids}")
    return [
        Message(content=req.content, dst_node_id=req.node_id, message_type=req.message_type)
        for req in requests
    ]


def collect(
    requests: Sequence[Request], replies: Iterable[Message], messages: Sequence[Message] = ()
) -> HopResult:
    """Match replies to requests, validate them, and turn the rest into misses.

    A reply is matched by the id of the message it answers (Flower sets it on push) and else
    by its source node: when a node goes away the SuperLink itself answers with a "node
    unavailable" error whose source is the SuperLink, so the source alone would misfile it.
    `messages` are the sent messages, in the order of `requests`.
    """
    hop = HopResult()
    by_node = {request.node_id: request for request in requests}
    by_message = {m.metadata.message_id: r for m, r in zip(messages, requests) if m.metadata.message_id}
    answered: set[int] = set()
    for reply in replies:
        hop.bytes_received += message_bytes(reply)
        request = by_message.get(reply.metadata.reply_to_message_id) or by_node.get(reply.metadata.src_node_id)
        if request is None or request.node_id in answered:
            log(WARNING, "Ignoring an unexpected reply from node %s", reply.metadata.src_node_id)
            continue
        answered.add(request.node_id)
        if reply.has_error():
            hop.misses.append(Miss(request, f"error reply: {reply.error.reason}"))
            continue
        problem, decoded = check_reply(reply.content, request.template(), request.require_num_examples)
        if problem is not None:
            hop.misses.append(Miss(request, f"rejected: {problem}"))
            continue
        num_examples = (
            int(reply.content.metric_records[METRICS_KEY][NUM_EXAMPLES_KEY])
            if request.require_num_examples
            else 0
        )
        hop.replies.append(Reply(request, reply.content, num_examples, decoded={ARRAYS_KEY: decoded} if decoded else {}))
    for node_id, request in by_node.items():
        if node_id not in answered:
            hop.misses.append(Miss(request, NO_REPLY))
    for miss in hop.misses:
        log(WARNING, "Node %s (%s) left out: %s", miss.request.node_id, miss.request.tag, miss.short_reason)
    return hop


def relay(grid: Grid, requests: Sequence[Request], timeout: float | None) -> HopResult:
    """The one relay primitive: send a hop of requests, collect and validate the replies.

    At most one request per node per hop (replies are matched to requests by node id).
    `timeout` (seconds, None = wait for all) bounds the wait; a reply that does not come in
    time counts as missing. Bytes are what Flower ships for the messages (`wire.message_bytes`),
    time is measured on the wall.
    """
    if not requests:
        return HopResult()
    messages = to_messages(requests)
    bytes_sent = sum(message_bytes(message) for message in messages)
    started = time.perf_counter()
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    seconds = time.perf_counter() - started
    hop = collect(requests, replies, messages)
    hop.bytes_sent, hop.seconds = bytes_sent, seconds
    return hop


def relay_in_batches(
    grid: Grid, requests: Sequence[Request], timeout: float | None, in_flight: int = IN_FLIGHT
) -> Iterator[HopResult]:
    """`relay` for a hop whose replies are too many to hold at once (a stage 1 that hears from
    every node): the same messages, validation and misses, but the replies of each pull come as
    a part of the hop as soon as they arrive, in the order of their requests, and a last part
    holds the misses of the requests that got no reply in time, the bytes sent and the hop's
    seconds. A caller that keeps only what it needs of each part holds one pull's replies at a
    time; `HopResult.add` puts the parts together.

    At most `in_flight` requests are out at once: the next ones are sent, in order, once the
    caller has taken the part that answered earlier ones, so replies the caller has not digested
    yet never pile up by more than that (in simulation they wait in the ServerApp's own process).
    A request still unsent at the deadline is a miss too (`NOT_SENT`): the nodes that hold the
    window without answering (more than `in_flight` hung nodes) cost the others their turn."""
    if not requests:
        return
    messages = to_messages(requests)
    started = time.perf_counter()
    deadline = None if timeout is None else time.monotonic() + timeout
    unsent = deque(range(len(requests)))
    sent: dict[str, int] = {}  # message id -> request
    pending: set[str] = set()
    refused: list[int] = []  # requests the grid did not store
    bytes_sent = 0

    def send_more() -> None:
        nonlocal bytes_sent
        batch = [unsent.popleft() for _ in range(min(len(unsent), in_flight - len(pending)))]
        if not batch:
            return
        bytes_sent += sum(message_bytes(messages[i]) for i in batch)
        ids = list(grid.push_messages([messages[i] for i in batch]))
        refused.extend(i for i, mid in zip(batch, ids + [""] * (len(batch) - len(ids))) if not mid)
        fresh = {mid: i for i, mid in zip(batch, ids) if mid}
        sent.update(fresh)
        pending.update(fresh)

    position = lambda reply: sent.get(reply.metadata.reply_to_message_id, -1)  # noqa: E731
    send_more()
    while pending:
        past_deadline = deadline is not None and time.monotonic() >= deadline
        pulled = sorted(grid.pull_messages(list(pending)), key=position)
        answered = sorted({sent[mid] for reply in pulled if (mid := reply.metadata.reply_to_message_id) in pending})
        pending.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
        if pulled:
            yield collect([requests[i] for i in answered], pulled, [messages[i] for i in answered])
        if past_deadline:
            break
        send_more()
        if not pending:
            break
        time.sleep(PULL_INTERVAL)
    last = collect([requests[i] for i in sorted({sent[mid] for mid in pending} | set(refused))], [])
    last.misses.extend(Miss(requests[i], NOT_SENT) for i in unsent)
    for i in unsent:
        log(WARNING, "Node %s (%s) left out: %s", requests[i].node_id, requests[i].tag, NOT_SENT)
    last.bytes_sent, last.seconds = bytes_sent, time.perf_counter() - started
    yield last


def weighted_average(models: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> ArrayRecord:
    """Average models (numpy arrays by key) key by key with the given weights, keeping each
    array's dtype.

    Integer arrays (e.g. BatchNorm's `num_batches_tracked`) are averaged and rounded.
    """
    if not models:
        raise ValueError("nothing to average")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {list(weights)}")
    averaged: dict[str, Array] = {}
    for key in models[0].keys():
        stacked = [model[key] for model in models]
        mean = sum(w * arr.astype(np.float64) for w, arr in zip(weights, stacked)) / total
        dtype = stacked[0].dtype
        rounded = np.rint(mean) if np.issubdtype(dtype, np.integer) else mean
        averaged[key] = Array(np.asarray(rounded, dtype=dtype))  # 0-d stays an array (num_batches_tracked)
    return ArrayRecord(averaged)


def fingerprint(arrays: ArrayRecord) -> str:
    """Short SHA-256 of an ArrayRecord's keys and bytes (names a model: the encoders a FedConcat cache was built from, the model a run resumed from)."""
    digest = hashlib.sha256()
    for key, array in arrays.items():
        digest.update(key.encode())
        digest.update(np.ascontiguousarray(array.numpy()).tobytes())
    return digest.hexdigest()[:16]


def to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    """An ArrayRecord's arrays as numpy, by key (what strategies compute on and checkpoint)."""
    return {key: array.numpy() for key, array in record.items()}


def torch_state(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """`arrays` as a torch state dict (copies: a decoded reply's arrays are read-only)."""
    return {key: torch.from_numpy(np.array(value)) for key, value in arrays.items()}


def to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Numpy arrays by key as an ArrayRecord (same key order)."""
    return ArrayRecord({key: Array(np.asarray(value)) for key, value in arrays.items()})


def train_content(arrays: ArrayRecord, config: dict[str, Any]) -> RecordDict:
    """A fresh RecordDict carrying a model and its training config (one per message)."""
    return RecordDict({ARRAYS_KEY: arrays, CONFIG_KEY: ConfigRecord(dict(config))})


def live_node_ids(grid: Grid) -> list[int]:
    """Currently connected node ids, sorted so every plan built from them is reproducible."""
    return sorted(int(node_id) for node_id in grid.get_node_ids())


def sample_nodes(rng: np.random.Generator, nodes: Sequence[int], count: int) -> list[int]:
    """`count` distinct nodes drawn uniformly, as Python ints.

    Node ids are unsigned 64-bit numbers; a numpy array of them can silently become float64
    (and lose digits), so draw positions and index the Python list instead.
    """
    positions = rng.choice(len(nodes), size=count, replace=False)
    return [nodes[int(position)] for position in positions]


def jsonable(value: Any) -> Any:
    """A request tag (or any value) as JSON can hold it: lists stay lists, other objects become strings."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return str(value)
