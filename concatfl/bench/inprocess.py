"""Run a benchmark cell in one process: an app's ServerApp against its ClientApp.

For studies of the algorithms themselves (many small runs), where a Flower simulation's start-up
(SuperLink, Ray: ~30 s a run) would cost more than the training. The ServerApp runs unchanged
over `InProcessGrid`, which hands every Flower `Message` to the ClientApp of its destination node
(each node with its own `Context`: node config and persistent state; the ClientApp's mods
included) and returns its reply, as a simulation does, minus the transport. Accuracy, bytes and
records are those of a `flwr run` simulation of the same run config; wall times exclude Flower's
messaging. The app is concatfl's own, or any Flower app folder whose ServerApp writes concatfl's
metrics.json (tests/apps/quickstart does), loaded as `flwr run` loads it: its pyproject.toml's
components and run-config defaults.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.task_identity import TaskIdentity

from ..config import RunConfig
from ..metrics import read_metrics

PROJECT_DIR = Path(__file__).resolve().parents[2]



@dataclass
class Later:
    """A reply that can be pulled only `seconds` after its message was pushed (a slow node)."""

    reply: Message
    seconds: float


Handler = Callable[[Message], Message | Later | None]  # None: the node never replies
FIRST_NODE_ID = 1_000  # node ids are arbitrary; partition i runs on node FIRST_NODE_ID + i


class InProcessGrid(Grid):
    """A Grid whose nodes are Python callables answering each message at once. A handler that
    returns None is a node that never replies (the caller's timeout decides); one that returns
    `Later(reply, seconds)` a node whose reply can be pulled only that long after the push."""

    def __init__(self, handlers: Mapping[int, Handler]) -> None:
        self.handlers = dict(handlers)
        self._replies: dict[str, tuple[float, Message]] = {}  # message id -> (pullable from, reply)
        self._pushed = 0

    def set_run(self, run_id: int) -> None:
        raise NotImplementedError("an in-process grid serves one run")

    @property
    def run(self):  # type: ignore[override]
        raise NotImplementedError("an in-process grid serves one run")

    def create_message(self, *args: Any, **kwargs: Any) -> Message:  # type: ignore[override]
        raise NotImplementedError("build Message objects directly")

    def get_node_ids(self) -> Iterable[int]:
        return list(self.handlers)

    def get_nodes(self):  # type: ignore[override]
        raise NotImplementedError("use get_node_ids")

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Give each message an id (as Flower does on push) and answer it (a `Later` reply is
        held back for its seconds)."""
        batch = list(messages)
        for message in batch:
            message.metadata.__dict__["_message_id"] = f"message-{self._pushed}"
            self._pushed += 1
        now = time.monotonic()
        for answer in self._answer(batch):
            reply, delay = (answer.reply, answer.seconds) if isinstance(answer, Later) else (answer, 0.0)
            self._replies[reply.metadata.reply_to_message_id] = (now + delay, reply)
        return [message.metadata.message_id for message in batch]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        now = time.monotonic()
        ready = [mid for mid in message_ids if mid in self._replies and self._replies[mid][0] <= now]
        return [self._replies.pop(message_id)[1] for message_id in ready]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return [answer.reply if isinstance(answer, Later) else answer for answer in self._answer(list(messages))]

    def _answer(self, batch: list[Message]) -> list[Message | Later]:
        answers = []
        for message in batch:
            handler = self.handlers.get(message.metadata.dst_node_id)
            if handler is None:
                raise ValueError(f"invalid destination node id {message.metadata.dst_node_id}")
            answer = handler(message)
            if answer is not None:
                answers.append(answer)
        return answers


@dataclass(frozen=True)
class App:
    """A Flower app as `flwr run` sees it: its ServerApp, ClientApp and run-config defaults."""

    server: ServerApp
    client: ClientApp
    defaults: dict[str, Any]

    @classmethod
    def load(cls, app_dir: Path = PROJECT_DIR) -> App:
        """Import the components named in `app_dir`/pyproject.toml (the folder joins sys.path)."""
        with (Path(app_dir) / "pyproject.toml").open("rb") as handle:
            flwr_app = tomllib.load(handle)["tool"]["flwr"]["app"]
        if str(app_dir) not in sys.path:
            sys.path.insert(0, str(app_dir))

        def component(kind: str) -> Any:
            module, _, attribute = flwr_app["components"][kind].partition(":")
            return getattr(importlib.import_module(module), attribute)

        return cls(component("serverapp"), component("clientapp"), dict(flwr_app.get("config", {})))

    def run_config(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """The defaults with `overrides`, which must name declared keys (as `flwr run` requires)."""
        unknown = sorted(set(overrides) - set(self.defaults))
        if unknown:
            raise ValueError(f"run-config keys {unknown} are not declared by the app; declared: {sorted(self.defaults)}")
        return {**self.defaults, **overrides}


def client_node(
    run_config: dict[str, Any], partition_id: int, num_partitions: int, client_app: ClientApp | None = None
) -> Handler:
    """The ClientApp (concatfl's by default) as the node holding partition `partition_id`, with its own state."""
    client_app = client_app or App.load().client
    context = Context(
        run_id=1,
        node_id=FIRST_NODE_ID + partition_id,
        node_config={"partition-id": partition_id, "num-partitions": num_partitions},
        state=RecordDict(),
        run_config=run_config,
    )
    return lambda message: client_app(message, context)


def simulate_in_process(
    run_config: Mapping[str, Any],
    num_supernodes: int,
    workdir: Path,
    *,
    torch_threads: int = 1,
    app_dir: Path = PROJECT_DIR,
) -> dict[str, Any]:
    """Run one cell (`run_config` over the app's defaults) with `num_supernodes` clients;
    metrics.json goes to `<workdir>/output` and is returned. `torch_threads`: the threads that
    train every client (1 by default; the machine's cores when nothing else runs). `app_dir`:
    the Flower app (concatfl's own by default)."""
    app = App.load(app_dir)
    own_app = Path(app_dir).resolve() == PROJECT_DIR
    # Every in-process node is there from the start: concatfl's start policy need not wait.
    config = app.run_config({**({"start-settle": 0.0} if own_app else {}), **run_config, "output-dir": str(Path(workdir) / "output")})
    if own_app:
        config = RunConfig.from_mapping(config).as_dict()  # concatfl's keys, checked and typed
    grid = InProcessGrid(
        {FIRST_NODE_ID + i: client_node(config, i, num_supernodes, app.client) for i in range(num_supernodes)}
    )
    # One process trains every client: one torch thread by default avoids oversubscribing the
    # cores (two threads on a busy 2-core machine made training many times slower). The caller's
    # setting is restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    # Flower stamps every new Message with the running task's identity, which its runtime sets.
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    flower_log = logging.getLogger("flwr")
    level = flower_log.level
    flower_log.setLevel(logging.WARNING)  # the harness prints one line per run; warnings still show
    try:
        app.server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))
    finally:
        flower_log.setLevel(level)
        torch.set_num_threads(threads)
    return read_metrics(config["output-dir"])
