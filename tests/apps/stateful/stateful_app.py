"""Scripted messages for executor tests (tests/test_warm_executor.py).

ServerApp: sends every connected node the run config's `plan` (comma-separated actions), one
message at a time, and writes each node's replies to `<output-dir>/replies.json`:
`{partition-id: [{"action", "count", "version", "pid", "rss"} or {"action", "error"} or {"action", "missing"}]}`.

ClientApp: every train message increments a counter kept in `context.state`, then acts:
`count` replies with the counter, VERSION, the process id and its resident memory; `raise` raises
RuntimeError; `exit` ends the process at once (`os._exit`), as a crash would; `sleep` replies
after 60 s (a task still running when its SuperNode dies).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from concatfl.client_app import query_handler
from concatfl.deployment.grid import StableNodeGrid

ACTIONS = ("count", "raise", "exit", "sleep")
COUNTER = "counter"
VERSION = 1  # tests change it in a copy of this app: a new app version (FAB hash)

client = ClientApp()
client.query()(query_handler)  # the identity query: nodes are named by their partition-id


@client.train()
def act(message: Message, context: Context) -> Message:
    """Count the message in context.state, then do what its `action` says."""
    action = message.content.config_records["config"]["action"]
    counter = context.state.config_records.get(COUNTER, ConfigRecord({"count": 0}))
    count = int(counter["count"]) + 1
    context.state[COUNTER] = ConfigRecord({"count": count})
    if action == "raise":
        raise RuntimeError(f"raised on purpose at message {count}")
    if action == "exit":
        os._exit(3)
    if action == "sleep":
        time.sleep(60)
    process = psutil.Process()
    metrics = MetricRecord({"count": count, "version": VERSION, "pid": process.pid, "rss": process.memory_info().rss})
    return Message(RecordDict({"metrics": metrics}), reply_to=message)


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    """Send the plan to every node, one message after the other; write the replies."""
    plan = str(context.run_config["plan"]).split(",")
    unknown = sorted(set(plan) - set(ACTIONS))
    if unknown:
        raise ValueError(f"run config 'plan' may hold only {', '.join(ACTIONS)}; got {', '.join(unknown)}")
    timeout = float(context.run_config["reply-timeout"])
    stable = StableNodeGrid(grid)
    replies: dict[int, list[dict]] = {node: [] for node in stable.get_node_ids()}
    for action in plan:
        for node, answers in replies.items():
            request = Message(
                RecordDict({"config": ConfigRecord({"action": action})}), dst_node_id=node, message_type=MessageType.TRAIN
            )
            answers.append({"action": action, **_answer(list(stable.send_and_receive([request], timeout=timeout)))})
    output = Path(str(context.run_config["output-dir"]))
    output.mkdir(parents=True, exist_ok=True)
    (output / "replies.json").write_text(json.dumps(replies))


def _answer(replies: list[Message]) -> dict:
    if not replies:
        return {"missing": True}
    if replies[0].has_error():
        return {"error": replies[0].error.reason}
    return {key: int(value) for key, value in replies[0].content.metric_records["metrics"].items()}
