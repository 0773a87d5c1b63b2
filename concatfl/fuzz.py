"""A Flower ClientApp mod that replaces a share of replies with malformed or poisoned ones.

Test a server setup against buggy or hostile clients with one line in any ClientApp:

    from concatfl.fuzz import fuzz_mod
    app = ClientApp(mods=[fuzz_mod])

and switch it on with a node-config key (one SuperNode: ``--node-config "... fuzz-share=0.3"``)
or a run-config key (every node; the app's pyproject.toml must declare it, as concatfl's does):

``fuzz-share``  share of eligible replies replaced, in [0, 1] (default 0: the mod does nothing)
``fuzz-kinds``  "all", "malformed", "poisoned" or a comma-separated list of the kinds below
``fuzz-seed``   seeds the draws (with the node's partition-id, else its node id, and a count
                of the messages it saw, kept in ``context.state``): a run is reproducible
``fuzz-log``    a file that gets one JSON line per replaced reply (the ground truth a benchmark
                compares the server's records with); "" for none

A node-config value wins over the run config's. Eligible replies: those to train messages that
return ``"arrays"`` (ordinary training, FedConcat's head rounds) and to FedConcat's label query;
every other message passes untouched, as do error replies. Every replaced reply is logged as a
WARNING by the node. The kinds:

malformed (a server must reject them): ``nan``, ``inf`` (in the first floating-point array),
``wrong-shape`` (the first array one row longer), ``missing-arrays``, ``extra-array``,
``negative-examples``, ``zero-examples``, ``float64``, ``int64`` (every array converted),
``empty`` (no records at all), ``label-negative`` (a negative probability), ``label-scaled``
(the distribution × 1000);

stalled (asked for by name only, never part of a group): ``hang`` (the reply comes HANG_SECONDS
late, long after any round timeout: a ClientApp that hangs; the node's later messages wait
behind it, as they would behind a hung process);

poisoned (well-formed; a server can only bound them): ``scaled`` (every weight × 10⁶),
``huge-examples`` (num-examples 10¹²), ``sign-flip`` (the update reversed: what was sent minus
the client's update; −update for a reply that is an update itself, such as concatfl's SCAFFOLD
reply with its ``"control"`` record), ``label-lie`` (a one-hot distribution on a random class).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.supercore import log

SHARE_KEY, KINDS_KEY, SEED_KEY, LOG_KEY = "fuzz-share", "fuzz-kinds", "fuzz-seed", "fuzz-log"
STATE_KEY = "fuzz"
LABELS_MESSAGE_TYPE = "query.fedconcat_labels"  # concatfl.protocol's, repeated: this module stands alone
LABEL_DISTRIBUTION = "label-distribution"
CONTROL_KEY = "control"  # concatfl.objectives' SCAFFOLD record

TRAIN_MALFORMED = (
    "nan", "inf", "wrong-shape", "missing-arrays", "extra-array", "negative-examples", "zero-examples",
    "float64", "int64", "empty",
)
TRAIN_POISONED = ("scaled", "huge-examples", "sign-flip")
LABEL_MALFORMED = ("label-negative", "label-scaled")
LABEL_POISONED = ("label-lie",)
MALFORMED = TRAIN_MALFORMED + LABEL_MALFORMED
POISONED = TRAIN_POISONED + LABEL_POISONED
STALLED = ("hang",)
KINDS = MALFORMED + POISONED + STALLED
GROUPS = {"all": MALFORMED + POISONED, "malformed": MALFORMED, "poisoned": POISONED}
HANG_SECONDS = 3600.0
HUGE_EXAMPLES = 10**12
SCALE = 1e6


def parse_kinds(text: str) -> tuple[str, ...]:
    """`fuzz-kinds` as a tuple of kinds: a group name or a comma-separated list; ValueError
    naming the unknown ones."""
    if text in GROUPS:
        return GROUPS[text]
    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown fuzz kinds {unknown or [text]}; use {', '.join(GROUPS)} or some of {', '.join(KINDS)}")
    return kinds


def fuzz_mod(message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """The ClientApp's reply, or with probability `fuzz-share` a malformed or poisoned one."""
    reply = call_next(message, context)
    share = float(_setting(context, SHARE_KEY, 0.0))
    if share <= 0 or reply.has_error():
        return reply
    kinds = _applicable(message, reply, parse_kinds(str(_setting(context, KINDS_KEY, "all"))))
    if not kinds:
        return reply
    rng = np.random.default_rng([int(_setting(context, SEED_KEY, 0)), _node_key(context), _next_count(context)])
    if rng.random() >= share:
        return reply
    kind = kinds[int(rng.integers(len(kinds)))]
    _report(message, context, kind)
    if kind == "hang":
        time.sleep(HANG_SECONDS)
        return reply
    return Message(corrupt(message, reply.content, kind, rng), reply_to=message)


def corrupt(message: Message, content: RecordDict, kind: str, rng: np.random.Generator) -> RecordDict:
    """A copy of the reply `content` to `message` with the fault `kind` (module docstring)."""
    if kind == "empty":
        return RecordDict()
    records = dict(content.items())
    if kind in LABEL_MALFORMED + LABEL_POISONED:
        distribution = np.asarray(records["metrics"][LABEL_DISTRIBUTION], dtype=np.float64)
        if kind == "label-lie":
            distribution = np.eye(len(distribution))[int(rng.integers(len(distribution)))]
        elif kind == "label-negative":
            distribution = distribution + np.r_[-1.5, 1.5, np.zeros(len(distribution) - 2)]  # sum kept
        else:
            distribution = distribution * 1000.0
        records["metrics"] = MetricRecord({**dict(records["metrics"]), LABEL_DISTRIBUTION: distribution.tolist()})
        return RecordDict(records)
    if kind == "missing-arrays":
        del records["arrays"]
        return RecordDict(records)
    if kind in ("negative-examples", "zero-examples", "huge-examples"):
        examples = int(records["metrics"]["num-examples"])
        value = {"negative-examples": -examples, "zero-examples": 0, "huge-examples": HUGE_EXAMPLES}[kind]
        records["metrics"] = MetricRecord({**dict(records["metrics"]), "num-examples": value})
        return RecordDict(records)
    arrays = {key: array.numpy() for key, array in records["arrays"].items()}
    sent = message.content.array_records.get("arrays")
    # A reply that carries SCAFFOLD's control-variate delta sends an update, not a model.
    is_update = CONTROL_KEY in content.array_records
    corrupted = _corrupt_arrays(arrays, sent, kind, is_update)
    records["arrays"] = ArrayRecord({k: Array(np.asarray(v, order="C")) for k, v in corrupted.items()})
    return RecordDict(records)


def _corrupt_arrays(
    arrays: dict[str, np.ndarray], sent: ArrayRecord | None, kind: str, is_update: bool
) -> dict[str, np.ndarray]:
    floats = [key for key, value in arrays.items() if np.issubdtype(value.dtype, np.floating)]
    if kind in ("nan", "inf"):
        first = arrays[floats[0]].copy()
        first.flat[0] = np.nan if kind == "nan" else np.inf
        return {**arrays, floats[0]: first}
    if kind == "wrong-shape":
        key = next(iter(arrays))
        value = np.atleast_1d(arrays[key])
        return {**arrays, key: np.concatenate([value, np.zeros((1, *value.shape[1:]), dtype=value.dtype)])}
    if kind == "extra-array":
        return {**arrays, "fuzz.extra": np.zeros(1, dtype=np.float32)}
    if kind == "float64":
        return {key: value.astype(np.float64) if key in floats else value for key, value in arrays.items()}
    if kind == "int64":
        with np.errstate(invalid="ignore"):  # a model already wrecked (NaN) casts to anything
            return {key: value.astype(np.int64) for key, value in arrays.items()}
    if kind == "scaled":
        return {key: (value * SCALE).astype(value.dtype) if key in floats else value for key, value in arrays.items()}
    # sign-flip: sent − (returned − sent), where the reply matches what was sent (else −returned)
    before = {key: array.numpy() for key, array in sent.items()} if sent is not None and not is_update else {}
    flipped = {}
    for key, value in arrays.items():
        if key not in floats:
            flipped[key] = value
        elif key in before and before[key].shape == value.shape:
            flipped[key] = (2 * before[key].astype(np.float64) - value).astype(value.dtype)
        else:
            flipped[key] = -value
    return flipped


def _applicable(message: Message, reply: Message, kinds: tuple[str, ...]) -> tuple[str, ...]:
    message_type = message.metadata.message_type
    if message_type == LABELS_MESSAGE_TYPE and LABEL_DISTRIBUTION in reply.content.metric_records.get("metrics", {}):
        return tuple(kind for kind in kinds if kind in LABEL_MALFORMED + LABEL_POISONED)
    if message_type.split(".")[0] == "train" and "arrays" in reply.content.array_records:
        return tuple(kind for kind in kinds if kind in TRAIN_MALFORMED + TRAIN_POISONED + STALLED)
    return ()


def _setting(context: Context, key: str, default: Any) -> Any:
    if key in context.node_config:
        return context.node_config[key]
    return context.run_config.get(key, default)


def _node_key(context: Context) -> int:
    return int(context.node_config.get("partition-id", context.node_id))


def _next_count(context: Context) -> int:
    """How many eligible messages this node has seen, kept in its state across messages."""
    record = context.state.config_records.get(STATE_KEY)
    count = int(record["messages"]) if record is not None else 0
    context.state[STATE_KEY] = ConfigRecord({"messages": count + 1})
    return count


def _report(message: Message, context: Context, kind: str) -> None:
    config = message.content.config_records.get("config", {})
    entry = {
        "run_id": int(context.run_id),
        "node_id": int(context.node_id),
        "partition_id": context.node_config.get("partition-id"),
        "server_round": config.get("server-round"),
        "message_type": message.metadata.message_type,
        "kind": kind,
    }
    log(WARNING, "fuzz: node %s replies to a '%s' message of round %s with '%s' instead of its reply",
        entry["node_id"], entry["message_type"], entry["server_round"], kind)
    path = str(_setting(context, LOG_KEY, ""))
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with Path(path).open("a", encoding="utf-8") as handle:  # one short line per write: appends do not interleave
            handle.write(json.dumps(entry) + "\n")
