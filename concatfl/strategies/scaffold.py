"""SCAFFOLD (Karimireddy et al. 2020): stochastic controlled averaging with control variates.

The server keeps the global model x and the control variate c (zeros at first, over the model's
parameters). Each round it sends x under ``"arrays"`` and c under ``"control"`` to a random
fraction of the nodes; each client corrects every local step by c − c_i, updates its own c_i
(option II, kept in its ``context.state``; see `concatfl.objectives`) and replies with the model
delta Δy_i = y_i − x under ``"arrays"`` and Δc_i under ``"control"``. With S the valid replies
and N the connected nodes:

    x ← x + η_g·(1/|S|)·Σ_{i∈S} Δy_i        c ← c + (1/N)·Σ_{i∈S} Δc_i

Both directions carry two model-sized records, so a round costs about twice FedAvg's bytes.

c = (1/N)·Σ c_i holds only while every client's c_i moves exactly when the server adds its
Δc_i. A reply can be lost on the way, come too late or be rejected after the client moved its
c_i; the paper assumes every reply arrives. So the server remembers, per node, the round of the
last reply it took and the share of Δc_i its bound let in, and tells the node both in its next
message (``config["scaffold-taken-round"]``, ``["scaffold-taken-share"]``); the client commits
its pending Δc_i only then (`concatfl.objectives.commit_scaffold_control`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from ..objectives import CONTROL_KEY, SCAFFOLD_TAKEN_ROUND, SCAFFOLD_TAKEN_SHARE
from .base import RelayStrategy
from .aggregation import Aggregation, as_aggregation, from_config as aggregation_from_config
from .common import (
    ARRAYS_KEY,
    NUM_EXAMPLES_KEY,
    HopResult,
    Request,
    live_node_ids,
    reply_problem,
    sample_nodes,
    to_numpy,
    to_record,
    train_content,
)
from .fedavg import sample_count
from .feddyn import parameter_names
from .guard import DEFAULT_UPDATE_CLIP, DEFAULT_WEIGHT_CLIP

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..runtime import ServerEnv

State = dict[str, np.ndarray]


def scaffold_server_update(
    model: Mapping[str, np.ndarray],
    control: Mapping[str, np.ndarray],
    model_delta: Mapping[str, np.ndarray],
    control_deltas: Sequence[Mapping[str, np.ndarray]],
    server_lr: float,
    num_clients: int,
) -> tuple[State, State]:
    """(x, c) after one round: x + η_g·Δy and c + Σ Δc_i / N, each array keeping its dtype.

    Δy is the round's combined model delta (the mean of the Δy_i, or a robust rule's result).
    η_g scales the arrays that have control variates (the parameters); the others (BatchNorm's
    running statistics and `num_batches_tracked`, rounded) move by Δy as it is, since a scaled
    running variance could turn negative.
    """
    new_model = {}
    for key, value in model.items():
        rate = server_lr if key in control else 1.0
        moved = value.astype(np.float64) + rate * model_delta[key].astype(np.float64)
        new_model[key] = (np.rint(moved) if np.issubdtype(value.dtype, np.integer) else moved).astype(value.dtype)
    new_control = {
        key: (value + sum(delta[key].astype(np.float64) for delta in control_deltas) / num_clients).astype(value.dtype)
        for key, value in control.items()
    }
    return new_model, new_control


class Scaffold(RelayStrategy):
    """SCAFFOLD: FedAvg with server and client control variates that correct client drift.

    Replies are validated like every strategy's (``"arrays"``, the model delta, must match the
    model's keys, shapes and dtypes and be finite; ``num-examples`` > 0), and ``"control"`` must
    match c the same way; a reply failing either is a logged miss, and its client's c_i does
    not move (see the module docstring). Both deltas are bounded
    (`update_clip`: Δy against the recent Δy, Δc against the recent Δc). The mean of the model
    deltas is unweighted, as in the paper; a robust `aggregation` replaces it.

    Parameters
    ----------
    fraction_train : float (default: 1.0)
        Fraction of the connected nodes sampled each round (at least `min_train_nodes`).
    min_train_nodes : int (default: 1)
        Lower bound on the nodes sampled per round.
    server_lr : float (default: 1.0)
        η_g, the global learning rate (run-config `scaffold-server-lr`).
    control_keys : Sequence[str] | None (default: None)
        The arrays that have control variates: the model's parameters (`feddyn.parameter_names`).
        None: every floating-point array of the initial model.
    aggregation : str | Aggregation (default: "mean")
        How the model deltas Δy_i are combined (see `FedAvg`); c always moves by Σ Δc_i / N.
    fraction_evaluate, round_timeout, seed, update_clip, weight_clip
        See `RelayStrategy`.
    """

    # pylint: disable=too-many-arguments
    def __init__(
        self,
        fraction_train: float = 1.0,
        min_train_nodes: int = 1,
        server_lr: float = 1.0,
        control_keys: Sequence[str] | None = None,
        aggregation: str | Aggregation = "mean",
        fraction_evaluate: float = 0.0,
        round_timeout: float | None = None,
        seed: int = 0,
        update_clip: float = DEFAULT_UPDATE_CLIP,
        weight_clip: float = DEFAULT_WEIGHT_CLIP,
    ) -> None:
        # No history check: corrected by the control variates, an honest node's updates follow the
        # federation's direction, not its own, and successive ones disagree (ten clean runs of the
        # robustness bench: 736 of their 2,000 replies would have been rejected).
        super().__init__(fraction_evaluate, round_timeout, seed, update_clip, weight_clip, history_check=False)
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        if not server_lr > 0:
            raise ValueError(f"server_lr must be > 0, got {server_lr}")
        self.fraction_train = fraction_train
        self.min_train_nodes = min_train_nodes
        self.server_lr = server_lr
        self.control_keys = None if control_keys is None else list(control_keys)
        self.aggregation = as_aggregation(aggregation)
        self.control: ArrayRecord | None = None  # c, created from the first model sent
        self.taken: dict[int, tuple[int, float]] = {}  # node -> (round, share of Δc_i) of its last reply taken
        self._sent: ArrayRecord | None = None
        self._num_nodes = 0

    def train_requests(
        self, server_round: int, hop: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Request]:
        """Hop 0: x and c to a fresh random sample of nodes."""
        if hop > 0:
            return []
        if self.control is None:
            self.control = _zeros(arrays, self.control_keys)
        live = live_node_ids(grid)
        nodes = self.awake(live)
        chosen = sample_nodes(self.rng, nodes, sample_count(self.fraction_train, len(nodes), self.min_train_nodes))
        self._sent, self._num_nodes = arrays, len(live)
        self.record("selected", sorted(chosen))
        settings: dict[str, Any] = {
            **dict(config),
            "server-round": server_round,
            "proximal-mu": 0.0,
            "local-objective": "sgd",
        }
        requests = []
        for node in chosen:
            taken_round, share = self.taken.get(node, (0, 1.0))
            content = train_content(arrays, {**settings, SCAFFOLD_TAKEN_ROUND: taken_round, SCAFFOLD_TAKEN_SHARE: share})
            content[CONTROL_KEY] = self.control
            requests.append(Request(node, content))
        return requests

    def aggregate_hop(
        self, server_round: int, hop: HopResult
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Drop replies with an unusable control variate, bound both deltas, then update x and c."""
        assert self.control is not None and self._sent is not None
        for reply in list(hop.replies):
            problem = control_problem(reply.content, self.control)
            if problem is not None:
                self.reject(hop, reply, problem)
        replies = self.guard.bound(hop.replies, stream="model-delta", from_zero=True)
        replies = self.guard.bound(replies, stream="control-delta", key=CONTROL_KEY, from_zero=True, weights=False)
        if not replies:
            return None, None
        deltas = [reply.numpy() for reply in replies]
        model, control = scaffold_server_update(
            to_numpy(self._sent),
            to_numpy(self.control),
            to_numpy(self.aggregation.combine(deltas, [1.0] * len(deltas))),
            [reply.numpy(CONTROL_KEY) for reply in replies],
            self.server_lr,
            self._num_nodes,
        )
        self.control = to_record(control)
        self.taken.update({reply.node_id: (server_round, reply.share) for reply in replies})
        metrics = aggregate_metricrecords([reply.content for reply in replies], NUM_EXAMPLES_KEY)
        return to_record(model), metrics

    def state_dict(self) -> dict[str, Any]:
        """Base state plus c."""
        return {
            **super().state_dict(),
            "control": None if self.control is None else to_numpy(self.control),
            "taken": {str(node): list(taken) for node, taken in self.taken.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        super().load_state_dict(state)
        self.control = None if state["control"] is None else to_record(state["control"])
        self.taken = {int(node): (int(taken[0]), float(taken[1])) for node, taken in state["taken"].items()}


def control_problem(content: RecordDict, control: ArrayRecord) -> str | None:
    """Why a reply's ``"control"`` (Δc_i) is unusable (missing, keys/shapes/dtypes unlike c, NaN/Inf), or None."""
    delta = content.array_records.get(CONTROL_KEY)
    if delta is None:
        return f"no ArrayRecord under '{CONTROL_KEY}' (SCAFFOLD's Δc_i)"
    # The shared validation, applied to the control variate instead of the model.
    problem = reply_problem(RecordDict({ARRAYS_KEY: delta}), control, require_num_examples=False)
    return None if problem is None else f"control variate: {problem}"


def _zeros(arrays: ArrayRecord, keys: Sequence[str] | None) -> ArrayRecord:
    model = to_numpy(arrays)
    chosen = keys if keys is not None else [k for k, v in model.items() if np.issubdtype(v.dtype, np.floating)]
    return to_record({key: np.zeros_like(model[key]) for key in chosen})




def build(config: RunConfig, env: ServerEnv) -> Scaffold:
    """SCAFFOLD from the run config, with control variates over the model's parameters."""
    return Scaffold(
        fraction_train=config.fraction_train,
        server_lr=config.scaffold_server_lr,
        control_keys=parameter_names(env.make_model),
        aggregation=aggregation_from_config(config),
        fraction_evaluate=config.fraction_evaluate,
        round_timeout=config.timeout,
        seed=config.seed,
        update_clip=config.update_clip,
        weight_clip=config.weight_clip,
    )
