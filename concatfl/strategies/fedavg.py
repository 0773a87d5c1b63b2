"""FedAvg and FedProx on concatfl's relay base (McMahan et al. 2017; Li et al. 2020)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from ..config import FEDPROX_DEFAULT_MU
from . import feddyn as feddyn_server
from .base import RelayStrategy
from .common import (
    NUM_EXAMPLES_KEY,
    HopResult,
    Request,
    live_node_ids,
    sample_nodes,
    train_content,
)
from .guard import DEFAULT_UPDATE_CLIP, DEFAULT_WEIGHT_CLIP
from .aggregation import Aggregation, as_aggregation, from_config as aggregation_from_config

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..runtime import ServerEnv


def sample_count(fraction: float, available: int, minimum: int = 1) -> int:
    """How many of `available` nodes a fraction selects: round(fraction·N), at least `minimum`,
    never more than are available."""
    return min(available, max(minimum, int(round(fraction * available))))


class FedAvg(RelayStrategy):
    """Federated Averaging: each round a random fraction of nodes trains the global model and
    the server replaces it with the num-examples-weighted average of the returned models.

    Behaves like Flower's own FedAvg, plus what every concatfl strategy does: invalid replies
    (wrong shapes or dtypes, NaN/Inf, num-examples ≤ 0) are rejected with a logged reason,
    every reply's update and weight is bounded (`update_clip`, `weight_clip`: an outsized reply
    is scaled down and recorded, never averaged as it is; one beyond 25 bounds is rejected as no
    update at all, `core.bounds.outsized`), bytes and seconds are measured per
    round, and the run is reproducible from `seed`.

    Parameters
    ----------
    fraction_train : float (default: 1.0)
        Fraction of the connected nodes sampled each round (at least `min_train_nodes`).
    min_train_nodes : int (default: 1)
        Lower bound on the nodes sampled per round.
    proximal_mu : float (default: 0.0)
        Sent to clients as ``config["proximal-mu"]``; > 0 turns the client objective into
        FedProx's μ/2·‖θ − θ_received‖² regularized loss. The server side is unchanged.
    feddyn : FedDynServer | None (default: None)
        FedDyn (Acar et al. 2021): the clients are told to run FedDyn's objective and the
        server forms θ = mean(θ_k) − h/α with the *unweighted* mean, as in the paper, and m =
        the number of connected nodes (`concatfl.strategies.feddyn`). With a robust
        `aggregation`, the robust rule (unweighted) stands in for that mean.
    aggregation : str | Aggregation (default: "mean")
        How the round's (bounded) models are combined: "mean" (weighted by num-examples),
        "median", "trimmed-mean", "krum" or "multi-krum" (`concatfl.strategies.aggregation`).
    fraction_evaluate, round_timeout, seed, update_clip, weight_clip, history_check
        See `RelayStrategy`.
    """

    def __init__(
        self,
        fraction_train: float = 1.0,
        min_train_nodes: int = 1,
        proximal_mu: float = 0.0,
        feddyn: feddyn_server.FedDynServer | None = None,
        aggregation: str | Aggregation = "mean",
        fraction_evaluate: float = 0.0,
        round_timeout: float | None = None,
        seed: int = 0,
        update_clip: float = DEFAULT_UPDATE_CLIP,
        weight_clip: float = DEFAULT_WEIGHT_CLIP,
        history_check: bool = True,
    ) -> None:
        super().__init__(fraction_evaluate, round_timeout, seed, update_clip, weight_clip, history_check)
        if feddyn is not None and proximal_mu > 0:
            raise ValueError("FedDyn has its own proximal term; use proximal_mu=0 with feddyn")
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        if proximal_mu < 0:
            raise ValueError(f"proximal_mu must be >= 0, got {proximal_mu}")
        self.fraction_train = fraction_train
        self.min_train_nodes = min_train_nodes
        self.proximal_mu = proximal_mu
        self.feddyn = feddyn
        self.aggregation = as_aggregation(aggregation)
        # The global model the current round started from, and the number of connected nodes (FedDyn's m).
        self._sent: ArrayRecord | None = None
        self._num_nodes = 0

    def train_requests(
        self, server_round: int, hop: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Request]:
        """Hop 0: the global model to a fresh random sample of nodes."""
        if hop > 0:
            return []
        live = live_node_ids(grid)
        nodes = self.awake(live)
        count = sample_count(self.fraction_train, len(nodes), self.min_train_nodes)
        chosen = sample_nodes(self.rng, nodes, count)
        settings: dict[str, Any] = {**dict(config), "server-round": server_round, "proximal-mu": self.proximal_mu}
        if self.feddyn is not None:
            settings.update(self.feddyn.settings())
        self._sent, self._num_nodes = arrays, len(live)
        self.record("selected", sorted(chosen))
        return [Request(node, train_content(arrays, settings)) for node in chosen]

    def aggregate_hop(
        self, server_round: int, hop: HopResult
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The `aggregation` of the valid replies, bounded (FedDyn: its corrected plain mean); the
        model is kept when none came back."""
        replies = self.guard.bound(hop.replies)
        if not replies:
            return None, None
        models = [reply.numpy() for reply in replies]
        metrics = aggregate_metricrecords([reply.content for reply in replies], NUM_EXAMPLES_KEY)
        if self.feddyn is None:
            return self.aggregation.combine(models, [reply.num_examples for reply in replies]), metrics
        assert self._sent is not None
        averaged = self.feddyn.step(self._sent, models, self.aggregation.combine(models, [1.0] * len(models)), self._num_nodes)
        self.record("feddyn_h_norm", self.feddyn.h_norm)
        return averaged, metrics

    def state_dict(self) -> dict[str, Any]:
        """Base state plus FedDyn's h when FedDyn is on."""
        state = super().state_dict()
        if self.feddyn is not None:
            state["feddyn"] = self.feddyn.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        super().load_state_dict(state)
        if self.feddyn is not None:
            self.feddyn.load_state_dict(state["feddyn"])


class FedProx(FedAvg):
    """FedProx (Li et al. 2020): FedAvg whose clients add μ/2·‖θ − θ_received‖² to their loss.

    Parameters are FedAvg's; `proximal_mu` (default 0.01) must be > 0.
    """

    def __init__(self, proximal_mu: float = FEDPROX_DEFAULT_MU, **kwargs: Any) -> None:
        if proximal_mu <= 0:
            raise ValueError(f"FedProx needs proximal_mu > 0, got {proximal_mu}")
        super().__init__(proximal_mu=proximal_mu, **kwargs)


def build(config: RunConfig, env: ServerEnv) -> FedAvg:
    """FedAvg (or FedProx) from the run config; with `local-objective='feddyn'`, FedAvg + FedDyn."""
    common: dict[str, Any] = {
        "fraction_train": config.fraction_train,
        "aggregation": aggregation_from_config(config),
        "fraction_evaluate": config.fraction_evaluate,
        "round_timeout": config.timeout,
        "seed": config.seed,
        "update_clip": config.update_clip,
        "weight_clip": config.weight_clip,
        "history_check": config.checks_update_history,
    }
    if config.strategy == "fedprox":
        return FedProx(proximal_mu=config.proximal_mu, **common)
    return FedAvg(proximal_mu=config.proximal_mu, feddyn=feddyn_server.from_config(config, env), **common)
