"""concatfl's ClientApp, except that a node started with `--node-config "... misbehave='cycle'"`
corrupts its train replies: round 1 NaN weights, round 2 a wrong shape, round 3 a negative
num-examples (then again from the start). Other nodes behave."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from concatfl.client_app import evaluate_handler, train_handler

FAULTS = ("nan", "shape", "negative")

app = ClientApp()
app.evaluate()(evaluate_handler)


def fault_of_round(server_round: int) -> str:
    """The fault a misbehaving node commits in `server_round` (1-based)."""
    return FAULTS[(server_round - 1) % len(FAULTS)]


def corrupt(reply: Message, fault: str) -> Message:
    """The reply with one fault: NaN in the first array, a first array of the wrong shape, or
    num-examples made negative."""
    arrays = reply.content.array_records["arrays"]
    first = next(iter(arrays.keys()))
    if fault == "nan":
        values = arrays[first].numpy().copy()
        values.flat[0] = np.nan
        arrays[first] = Array(values)
    elif fault == "shape":
        arrays[first] = Array(np.zeros((3, 3), dtype=np.float32))
    else:
        metrics = reply.content.metric_records["metrics"]
        metrics["num-examples"] = -int(metrics["num-examples"])
    reply.content.array_records["arrays"] = ArrayRecord(dict(arrays.items()))
    return reply


@app.train()
def train(message: Message, context: Context) -> Message:
    """concatfl's training, then the fault this round calls for when the node misbehaves."""
    reply = train_handler(message, context)
    if context.node_config.get("misbehave") != "cycle":
        return reply
    server_round = int(message.content.config_records["config"]["server-round"])
    return corrupt(reply, fault_of_round(server_round))
