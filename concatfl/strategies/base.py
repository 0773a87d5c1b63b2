"""`RelayStrategy`: the base of every concatfl strategy.

A round is a sequence of hops (see `common.relay`). A subclass says what each hop sends
(`train_requests`) and what to make of its replies (`aggregate_hop`); the base runs the
rounds, measures bytes and seconds, evaluates the global model whenever it changes, and keeps
one JSON-ready record per round in `history` (the rounds of metrics.json). At the start of every
round it looks at the connected nodes and asks the subclass (`place`) where each node that
joined after the start, or came back, goes (`membership`, `admission`): one mechanism for every strategy.

Flower's own hooks are honoured: `configure_train`/`aggregate_train` are the same two steps
seen from Flower's side (one hop each call), so a user who drives the strategy by hand sees
the usual Message API; `start()` is the usual entry point and returns a Flower `Result`.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import textwrap
import time
from abc import abstractmethod
from collections.abc import Callable, Hashable, Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from torch import nn
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore import log

from .common import (
    ARRAYS_KEY,
    CONFIG_KEY,
    NUM_EXAMPLES_KEY,
    HopResult,
    Miss,
    Reply,
    Request,
    collect,
    live_node_ids,
    message_bytes,
    relay,
    relay_in_batches,
    reply_problem,
    sample_nodes,
    to_messages,
)
from ..config import DEFAULT_ROUND_TIMEOUT
from .guard import DEFAULT_UPDATE_CLIP, DEFAULT_WEIGHT_CLIP, ReplyGuard
from .admission import Admission
from .membership import RETURNED, Membership
from .summary import round_line, summary_value
from .privacy import PrivacyState, check_driver, enforce_clipping, explain_mod_errors, stage_failure

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
_ABSENT = object()


class RelayStrategy(Admission, Strategy):
    """Base class: rounds of relay hops with measured traffic and per-round records.

    Parameters
    ----------
    fraction_evaluate : float (default: 0.0)
        Fraction of connected nodes asked to evaluate the global model on their local test
        split after each round (Flower's federated evaluation). 0 skips it; the server-side
        `evaluate_fn` is the main measure in concatfl.
    round_timeout : float | None (default: None)
        Seconds to wait for the replies of one hop; a reply that does not come in time is a
        miss. None: `start()`'s timeout (default 600 s, as the run config's `round-timeout`).
    seed : int (default: 0)
        Seed of the strategy's one random generator (`self.rng`): every random choice on the
        server draws from it, so a run is reproducible.
    update_clip : float (default: 4.0)
        c ≥ 1: no reply's update moves a model more than c times the reference length of
        updates of its kind (the lower median of the recent ones); 0 turns the bound off
        (`guard.ReplyGuard`).
    weight_clip : float (default: 4.0)
        c_w ≥ 1: no reply's num-examples counts more than c_w times the lower median of the
        recent ones; 0 turns the bound off.
    history_check : bool (default: True)
        Reject a reply whose update is reversed against its node's own earlier updates of the
        same kind (cosine below 0 with both its last update taken and its last seen;
        `core.witness`), like a lost reply; False (or `update_clip` 0): off.

    Attributes
    ----------
    after_round : Callable[[int, ArrayRecord, Result], None] | None
        Called at the end of every round with the round number, the global model and the
        `Result` so far, once the round's record is in `history` (concatfl's ServerApp writes
        its checkpoint there).
    """

    def __init__(
        self,
        fraction_evaluate: float = 0.0,
        round_timeout: float | None = None,
        seed: int = 0,
        update_clip: float = DEFAULT_UPDATE_CLIP,
        weight_clip: float = DEFAULT_WEIGHT_CLIP,
        history_check: bool = True,
    ) -> None:
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ValueError(f"fraction_evaluate must be in [0, 1], got {fraction_evaluate}")
        self.fraction_evaluate = fraction_evaluate
        self.round_timeout = round_timeout
        self.seed = seed
        self.update_clip = update_clip
        self.weight_clip = weight_clip
        self.guard = ReplyGuard(type(self).__name__, update_clip, weight_clip, history_check, self._reject_guarded)
        self.rng = np.random.default_rng(seed)
        self.history: list[dict[str, Any]] = []
        self.setup_record: dict[str, Any] = {}
        self.after_round: Callable[[int, ArrayRecord, Result], None] | None = None
        self._round_extras: dict[str, Any] = {}
        self._evaluate_fn: EvaluateFn | None = None
        self._evaluated: dict[tuple[int, int], tuple[ArrayRecord, MetricRecord | None]] = {}  # this round's
        self._pending: list[Request] = []
        self._pending_messages: list[Message] = []
        self._hop_position: tuple[int, int] = (0, 0)
        self._modules: dict[str, tuple[Hashable, nn.Module]] = {}  # reusable_module's, by slot
        self.membership = Membership()
        self._round_hops: list[HopResult] = []  # every hop of the current round (or of setup)
        self._placing_hops: list[HopResult] = []  # those of them that placed nodes
        self._membership_record: dict[str, Any] = {}  # the current round's membership counts
        self._deferred: set[int] = set()  # nodes stage 1 asks again (`defer`)
        self._train_config = ConfigRecord()  # the run's training config (placing nodes may train them)
        self.last_round: int | None = None  # the run's last round, once `start()` knows it
        self._round = 0  # the round being run (0: setup)
        self._privacy = PrivacyState()  # Flower's DP pieces around the run (`privacy`)

    # ------------------------------------------------------------------ subclass hooks
    def setup(self, grid: Grid, initial_arrays: ArrayRecord, train_config: ConfigRecord) -> None:
        """Work done once before round 1 (FedSeq's grouping, FedConcat's clustering).

        Use `self.hop(grid, requests)` to talk to nodes and `self.setup_record` to report.
        """

    def place(self, grid: Grid, nodes: list[int], why: str, server_round: int) -> dict[int, Any]:
        """Where each of `nodes` goes (JSON-ready), for the reason `why` (`membership`'s START,
        JOINED, ASKED_AGAIN, RETURNED, or a strategy's own).

        Called at the start of a round for nodes that joined or came back (`server_round`), and
        once after `setup` for the nodes connected at the start that setup did not place. The
        default suits strategies that sample from every connected node each round: a node is in
        the "pool" from the moment it connects, and a returning node keeps its place. A strategy
        may talk to the nodes here (`self.hop(grid, requests, placing=True)`) and may leave a
        node out of the answer: it is asked again in the next round.
        """
        if why == RETURNED:
            return {node: self.membership.places[node] for node in nodes}
        return {node: "pool" for node in nodes}

    @abstractmethod
    def train_requests(
        self, server_round: int, hop: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Request]:
        """The requests of hop `hop` (0, 1, …) of `server_round`; an empty list ends the round.

        `arrays` is the current global model and `config` the training config of the run.
        """

    @abstractmethod
    def aggregate_hop(
        self, server_round: int, hop: HopResult
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Absorb one hop's replies and misses.

        Returns the new global model when this hop changed it (None otherwise) and the
        aggregated training metrics of the replies (or None).
        """

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run: a JSON/pickle-friendly dict."""
        return {
            "rng": self.rng.bit_generator.state,
            "history": copy.deepcopy(self.history),
            "setup_record": copy.deepcopy(self.setup_record),
            "guard": self.guard.state_dict(),
            "membership": self.membership.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.rng.bit_generator.state = state["rng"]
        self.history = copy.deepcopy(state["history"])
        self.setup_record = copy.deepcopy(state["setup_record"])
        self.guard.load_state_dict(state["guard"])
        self.membership.load_state_dict(state["membership"])

    def global_module(self, arrays: ArrayRecord, make_model: Callable[[], nn.Module]) -> nn.Module:
        """The torch module that `arrays` (the global model this strategy returns) stands for.

        Most strategies return the weights of the run's model; FedConcat returns the
        concatenated-encoder model and overrides this. The module is built once
        (`reusable_module`) and `arrays` loaded into it: the next call loads its own arrays into
        the same module, so copy it to keep it.
        """
        model = self.reusable_module("model", make_model, make_model)
        model.load_state_dict(arrays.to_torch_state_dict())
        return model

    def reusable_module(self, slot: str, factory: Hashable, build: Callable[[], nn.Module]) -> nn.Module:
        """The module last built in `slot` by `factory`, else a new one from `build()`.

        Evaluating every round then costs no random initialization. `build()` runs outside
        torch's global random stream, so building a module never moves the run's seeded
        generator: the run stays reproducible and resume-exact whether or not a module was
        already there.
        """
        cached = self._modules.get(slot)
        if cached is not None and cached[0] == factory:
            return cached[1]
        with torch.random.fork_rng(devices=[]):
            module = build()
        self._modules[slot] = (factory, module)
        return module

    # ------------------------------------------------------------------ helpers for subclasses
    def hop(
        self,
        grid: Grid,
        requests: list[Request],
        placing: bool = False,
        digest: Callable[[list[Reply]], None] | None = None,
    ) -> HopResult:
        """Run one relay hop with this strategy's timeout; its rejected replies count against
        their nodes (`guard.ReplyGuard`). The hop's traffic counts in the current round's (or
        setup's) record; `placing`: it serves to place nodes (`place`), so its replies do not
        count as the round's training.

        `digest`: for a hop to every node (stage 1), whose models together would not fit in
        memory at 10,000 clients. It is given the replies as they arrive, a pull's worth at a
        time (`common.relay_in_batches`), keeps what it needs of them (it may `reject` some),
        and the replies then let go of their arrays: the hop returned holds their metrics only."""
        hop = HopResult()
        self._round_hops.append(hop)
        if placing:
            self._placing_hops.append(hop)
        parts = [relay(grid, requests, self.round_timeout)] if digest is None else relay_in_batches(
            grid, requests, self.round_timeout
        )
        for part in parts:
            self.guard.note_rejected(part.misses)
            explain_mod_errors(self, self._privacy, part.misses)
            self._note_silences(part)
            hop.add(part)
            if digest is not None and part.replies:
                digest(list(part.replies))
                for reply in part.replies:
                    reply.drop_arrays()
        return hop

    def reject(self, hop: HopResult, reply: Reply, problem: str) -> None:
        """Move a reply that failed a strategy's own check (SCAFFOLD's control variate,
        FedConcat's label distribution) from `hop.replies` to its misses, logged and counted;
        `reply` may be the guard's bounded copy of the one received (matched by its request)."""
        kept = [mine for mine in hop.replies if mine.request is not reply.request]
        if len(kept) == len(hop.replies):
            raise RuntimeError(f"node {reply.node_id}'s reply is not among its hop's replies")
        hop.replies[:] = kept
        miss = Miss(reply.request, f"rejected: {problem}")
        hop.misses.append(miss)
        self.guard.note_rejected([miss])
        log(WARNING, "Node %s (%s) left out: %s", reply.node_id, reply.request.tag, problem)

    def _reject_guarded(self, reply: Reply, problem: str) -> None:
        """The guard's rejection of a reply (too long to be an update, or reversed): it leaves the
        replies of the hop of this round that brought it (matched by its request) for its misses."""
        for hop in reversed(self._round_hops):
            own = next((mine for mine in hop.replies if mine.request is reply.request), None)
            if own is not None:
                self.reject(hop, own, problem)
                return
        raise RuntimeError(f"the guard rejected a reply of node {reply.node_id} that no hop of this round brought")

    def evaluate_on_server(self, server_round: int) -> Callable[[ArrayRecord], MetricRecord | None] | None:
        """The run's `evaluate_fn` for models of round `server_round` (None when the run has none)."""
        evaluate_fn = self._evaluate_fn
        if evaluate_fn is None:
            return None

        def evaluate(arrays: ArrayRecord) -> MetricRecord | None:
            # A model evaluated once this round is not evaluated again (a strategy's check scores
            # the model it then returns as the global one); the record is held so its id stays its own.
            if (server_round, id(arrays)) not in self._evaluated:
                self._evaluated[(server_round, id(arrays))] = (arrays, evaluate_fn(server_round, arrays))
            return self._evaluated[(server_round, id(arrays))][1]

        return evaluate

    def record(self, key: str, value: Any) -> None:
        """Add a strategy-specific entry (JSON-ready) to the current round's record."""
        self._round_extras[key] = value

    # ------------------------------------------------------------------ Flower's Strategy API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Messages of the round's next hop (FedSeq rounds have several; others one).

        A strategy with a stage 1 (FedSeq, FedSeqInter, FedConcat) raises RuntimeError here when
        called outside its `start()`, which runs that stage. Under one of Flower's DP wrappers, a
        strategy that does not compose with it raises ValueError here, before any message
        (`privacy.check_driver`)."""
        check_driver(self, self._privacy, config)
        if self.last_round is None and type(self).setup is not RelayStrategy.setup:
            raise RuntimeError(
                f"{type(self).__name__} is driven through its own start(grid=..., initial_arrays=..., "
                "num_rounds=...): its stage 1 (setup) runs there before round 1, so configure_train "
                "cannot be called on its own; FedAvg, FedProx, SCAFFOLD, FedDyn, MOON, FedRS, FedLC and "
                "FedCat can"
            )
        last_round, last_hop = self._hop_position
        hop = last_hop if last_round == server_round else 0
        if hop == 0:
            self._round_hops, self._placing_hops, self._train_config = [], [], config
            self._admit(grid, server_round)
        self._pending = self.train_requests(server_round, hop, arrays, config, grid)
        self._hop_position = (server_round, hop + 1)
        self._pending_messages = to_messages(self._pending)
        return self._pending_messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate the replies to the last `configure_train` and aggregate them."""
        hop = collect(self._pending, replies, self._pending_messages)
        hop.replies = enforce_clipping(self, self._privacy, hop.replies)
        self.guard.note_rejected(hop.misses)
        explain_mod_errors(self, self._privacy, hop.misses)
        self._note_silences(hop)
        return self.aggregate_hop(server_round, hop)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Ask a `fraction_evaluate` sample of the awake nodes to evaluate the global model."""
        nodes = self.awake(live_node_ids(grid))
        count = int(round(self.fraction_evaluate * len(nodes)))
        if count == 0:
            return []
        chosen = sample_nodes(self.rng, nodes, count)
        config = ConfigRecord({**dict(config), "server-round": server_round})
        return [
            Message(
                content=RecordDict({ARRAYS_KEY: arrays, CONFIG_KEY: config}),
                dst_node_id=node_id,
                message_type=MessageType.EVALUATE,
            )
            for node_id in chosen
        ]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Average the evaluation metrics, weighted by num-examples (replies without a positive
        num-examples, e.g. from clients with an empty local test split, are left out)."""
        good = [
            reply.content
            for reply in replies
            if not reply.has_error() and reply_problem(reply.content, template=None) is None
        ]
        return aggregate_metricrecords(good, NUM_EXAMPLES_KEY) if good else None

    def summary(self) -> None:
        """Log the strategy and its parameters in a few lines (see `summary_lines`)."""
        for line in self.summary_lines():
            log(INFO, "%s", line)

    def summary_lines(self, width: int = 100) -> list[str]:
        """The strategy's name and the current value of every constructor parameter, wrapped
        to `width` characters.

        The parameters are those of `__init__` along the class hierarchy, so a subclass's new
        parameters appear without further code (stored under the same name, as every concatfl
        strategy does). Values are shown as `summary_value` renders them: callables (model
        factories, evaluation functions) and parameters not kept under their own name are left
        out; internal state (plans, caches, records) is never shown.
        """
        items = []
        for name in _constructor_parameters(type(self)):
            value = getattr(self, name, _ABSENT)
            if value is _ABSENT or callable(value):
                continue
            items.append(f"{name}={summary_value(value)}")
        return textwrap.wrap(
            ", ".join(items), width, initial_indent=f"{type(self).__name__}: ", subsequent_indent="    "
        )

    # pylint: disable=too-many-arguments, too-many-locals
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = DEFAULT_ROUND_TIMEOUT,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> Result:
        """Run `num_rounds` rounds and return Flower's `Result`.

        `timeout` is used as the per-hop timeout when the strategy was built without a
        `round_timeout` (default DEFAULT_ROUND_TIMEOUT, the run config's `round-timeout`, where
        Flower's strategies default to 3600 s). `evaluate_fn(round, arrays)` is called on the initial model and after
        every round that changed the global model.
        """
        if self.round_timeout is None:
            self.round_timeout = timeout
        self._evaluate_fn = evaluate_fn
        self.last_round = num_rounds
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        self._train_config = train_config
        result = Result(arrays=initial_arrays)
        arrays = initial_arrays
        if evaluate_fn and not self.history:
            evaluated = evaluate_fn(0, initial_arrays)
            if evaluated is not None:
                result.evaluate_metrics_serverapp[0] = evaluated

        started = time.perf_counter()
        if not self.history:
            self.guard.begin_round(0)
            self._round_hops, self._placing_hops = [], []
            try:
                self.setup(grid, initial_arrays, train_config)
            except RuntimeError as error:  # stage 1 heard nothing usable: say why when DP mods refused
                if (explained := stage_failure(error, self._privacy)) is None:
                    raise
                raise explained from error
            self._place_start(grid)
            if guarded := self.guard.round_record():
                self.setup_record["guard"] = guarded
        for server_round in range(len(self.history) + 1, num_rounds + 1):
            round_started = time.perf_counter()
            self._round_extras, self._evaluated = {}, {}
            self.guard.begin_round(server_round)
            self._round_hops, self._placing_hops = [], []
            self._admit(grid, server_round)
            changed = False
            for position in itertools.count():
                requests = self.train_requests(server_round, position, arrays, train_config, grid)
                if not requests:
                    break
                hop = self.hop(grid, requests)
                new_arrays, train_metrics = self.aggregate_hop(server_round, hop)
                if new_arrays is not None:
                    arrays, changed = new_arrays, True
                if train_metrics is not None:
                    result.train_metrics_clientapp[server_round] = train_metrics
            hops = self._round_hops
            trained = self._trained_nodes()
            self.membership.trained |= trained
            self._membership_record["trained"] = len(trained)
            record: dict[str, Any] = {
                "round": server_round,
                "bytes_sent": sum(h.bytes_sent for h in hops),
                "bytes_received": sum(h.bytes_received for h in hops),
                "hops": [h.as_record() for h in hops],
                "aggregated": changed,
                "membership": self._membership_record,
                **self._round_extras,
            }
            if guarded := self.guard.round_record():
                record["guard"] = guarded
            federated, evaluation_bytes = self._federated_evaluation(server_round, arrays, evaluate_config, grid)
            if federated is not None:
                result.evaluate_metrics_clientapp[server_round] = federated
                record["federated_evaluation"] = dict(federated)
            if evaluation_bytes is not None:
                record["evaluation_bytes"] = evaluation_bytes
                record["bytes_sent"] += evaluation_bytes["sent"]
                record["bytes_received"] += evaluation_bytes["received"]
            if changed:
                result.arrays = arrays
                if evaluate_fn:
                    evaluated = self.evaluate_on_server(server_round)(arrays)  # type: ignore[misc]
                    if evaluated is not None:
                        result.evaluate_metrics_serverapp[server_round] = evaluated
                        record.update(dict(evaluated))
            record["seconds"] = round(time.perf_counter() - round_started, 4)
            self.history.append(record)
            log(INFO, "[ROUND %s/%s] %s", server_round, num_rounds, round_line(record))
            if self.after_round is not None:
                self.after_round(server_round, arrays, result)

        # Flower's own strategies print the whole Result here; its per-round metrics would repeat
        # the round lines above (they stay in the returned Result and in metrics.json).
        log(INFO, "Strategy execution finished in %.2fs", time.perf_counter() - started)
        return result

    def _federated_evaluation(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> tuple[MetricRecord | None, dict[str, int] | None]:
        """The aggregated client metrics and the bytes the evaluation moved (None, None: no evaluation)."""
        messages = list(self.configure_evaluate(server_round, arrays, config, grid))
        if not messages:
            return None, None
        sent = sum(message_bytes(message) for message in messages)
        replies = list(grid.send_and_receive(messages, timeout=self.round_timeout))
        received = sum(message_bytes(reply) for reply in replies)
        return self.aggregate_evaluate(server_round, replies), {"sent": sent, "received": received}


def _constructor_parameters(cls: type) -> list[str]:
    """Named parameters of `__init__` along `cls`'s hierarchy, subclass first, each once."""
    names: dict[str, None] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or not issubclass(klass, RelayStrategy):
            continue
        for parameter in inspect.signature(klass.__init__).parameters.values():
            if parameter.name != "self" and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                names.setdefault(parameter.name)
    return list(names)
