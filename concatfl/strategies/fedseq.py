"""FedSeq and FedSeqInter (Zaccone et al. 2022): sequential training inside superclients.

Stage 1 (`setup`, once): every connected client pre-trains the initial model; the server turns
each returned model into an approximation ψ of the client's label distribution and groups the
clients into superclients of diverse data (`concatfl.core.superclients`). Stage 1, and the
placement of nodes that join later, live in `fedseq_stage1` (`SuperclientStage`, FedSeq's base).

Stage 2 (rounds): the model of a selected superclient travels along its shuffled client chain.
The server is the relay: hop h sends, in one batch, each selected superclient's current model to
its h-th client, so a round has as many hops as the longest chain. Only ordinary train messages
are used, so any Flower ClientApp that trains on "arrays" + "config" works.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from logging import WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore import log
from torch import nn

from ..config import FEDSEQ_DISTRIBUTION_METRICS, parse_hop_step
from ..core import superclients as sc
from .common import (
    METRICS_KEY, NUM_EXAMPLES_KEY, HopResult, Request, live_node_ids, to_numpy, to_record, train_content, weighted_average,
)
from .fedavg import sample_count
from .feddyn import FedDynServer, from_config as feddyn_from_config
from .fedseq_stage1 import SuperclientStage
from .guard import DEFAULT_UPDATE_CLIP, DEFAULT_WEIGHT_CLIP
from .sequential import DEFAULT_HOP_CLIP, SIZED, ChainGuard, FirstHopWitness

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..runtime import ServerEnv

APPROXIMATORS = ("conf", "clf")
# The witness cannot tell damping from divergence: it names both ways of the hop step.
ADVICE = (
    "FedAvg with every node may do better; so may superclients of other sizes (min_samples) or another hop step: "
    "a larger one where the clients' local steps are small (the default takes hops whole only where the first "
    "round's were short against the model: hop_step=1 forces it), a smaller one where the chains diverge (the "
    "divergence warning says so)."
)


@dataclass
class _Chain:
    """One selected superclient during a round: where its model is and what happened to it."""

    superclient: int
    order: list[int]  # node ids, one pass repeated E_S times, then the clients retried
    model: dict[str, np.ndarray]  # as numpy: encoded only when sent
    weight: int  # |D_S|
    slot: int | None = None
    trained: int = 0
    examples: int = 0  # folded into `model` so far (the running mean's weight)
    missed: list[int] = field(default_factory=list)
    retried: list[int] = field(default_factory=list)  # missed clients given a last turn (`aggregate_hop`)
    planned: int = field(init=False)  # hops of the E_S passes

    def __post_init__(self) -> None:
        self.planned = len(self.order)

    def chain_pass(self, hop: int, passes: int) -> int:
        """Which of the `passes` passes hop `hop` belongs to (a retried client's turn: the last)."""
        return min(hop * passes // self.planned, passes - 1)


class FedSeq(SuperclientStage):
    """FedSeq: superclients of diverse clients, each training one model sequentially.

    Every round a fraction of the superclients is sampled; in each, the client order is
    shuffled and the model goes from client to client (each trains its `local-epochs`), the
    whole chain `superclient_epochs` times. The new global model is the average of the
    superclient models weighted by their sample counts |D_S|. A client that misses its turn
    (no reply, error, invalid reply) is skipped: the model it was given goes on to the next
    client. One whose reply came but was not usable (an error, a rejected reply) gets one more
    turn, after the last client of its chain in the same round, else its data would not train
    this round; one that sent nothing in time does not (a second wait for a node that is gone
    would make the round twice as long). A node that left the grid is dropped from its
    superclient before the next round (a superclient left empty disappears) and rejoins it in
    the first round it is connected again.

    Nodes without a place (`RelayStrategy.place`, recorded under ``placements``): a node that
    connects after stage 1 pre-trains the initial model as stage 1 would have had it do, at the
    start of the round in which it is first seen, and joins the superclient its approximation
    fits (`core.superclients.fitting_superclient`: among those with fewer than `max_clients`
    members, the one whose estimated distribution lacks its classes most; with
    `approximator='clf'`, whose PCA was fitted on stage 1's clients, the one with the fewest
    samples). A node whose stage-1 pre-training reply is missing or rejected is asked once
    more right after stage 1, as a node that joins. A node whose pre-training reply is missing
    or rejected again (or when it joins) has no approximation and joins the superclient with
    the fewest samples, its size counted as the median client's, so its data still trains the
    model. When every superclient
    is full, a newcomer starts a superclient of its own. The superclients formed in stage 1 are
    not regrouped: their chains keep their order of diversity.

    Parameters
    ----------
    make_model : Callable[[], nn.Module]
        Builds the run's model; stage 1 loads each client's pre-trained weights into it.
    num_classes : int
        Number of classes (length of the confidence vectors; k of the K-means grouping).
    exemplar_pool : tuple[torch.Tensor, torch.Tensor] | None (default: None)
        (x in [0, 1], y) from which the `conf` approximator draws its public exemplars, usually
        the global test split. Required when `approximator='conf'`; without it the default
        approximator is `clf`, which needs no data on the server.
    exclude_exemplars : Callable[[np.ndarray], None] | None (default: None)
        Called with the exemplars' indices into `exemplar_pool` as soon as they are drawn (in
        the constructor) and again after `load_state_dict`, so the caller removes them from its
        evaluation set.
    normalization : Callable[[torch.Tensor], torch.Tensor] | None (default: None)
        Applied to the exemplars before the forward pass (identity when None).
    device : torch.device | str (default: "cpu")
        Where the server runs the exemplars through the clients' models.
    approximator : str | None (default: None)
        ψ: `conf` (confidence vectors on the exemplars) or `clf` (classifier weights + PCA).
        None: `conf` when an `exemplar_pool` is given (the paper's best), else `clf`.
    exemplars_per_class : int (default: 10)
        J, exemplars drawn per class for `conf`.
    conf_normalize : str (default: "sum")
        How p_k becomes a distribution: `sum` (divide by the sum) or `softmax` (paper's Eq. 3).
    clf_layers : str (default: "all")
        Fully-connected layers read by `clf`: `all`, `last2` or `last` (the classifier).
    metric : str | None (default: None)
        τ of the greedy grouping: `kl`, `cosine`, `euclidean`, `wasserstein` or `gini`. `kl`,
        `wasserstein` and `gini` compare distributions and need `approximator='conf'`. None:
        `kl` with `conf`, `cosine` with `clf`.
    grouping : str (default: "greedy")
        φ: `greedy` (paper's Alg. 3), `kmeans` (Alg. 2) or `random`.
    greedy_merge : str (default: "half")
        How greedy updates D_S after adding client j: `half` = ½·D_S + ½·D̃_j (paper's Alg. 3)
        or `weighted` = the sample-weighted mean of the members' vectors (see
        `concatfl.core.superclients.greedy_grouping` for why it can matter).
    min_samples : int (default: 800)
        |D_S|min: a superclient stops growing once it holds this many samples.
    max_clients : int (default: 11)
        K_S,max: a superclient stops growing at this many clients.
    pretrain_epochs : int (default: 10)
        Local epochs of stage 1's pre-training (sent as ``config["local-epochs"]``). A client
        that reads its epoch count elsewhere pre-trains for its own count; one that reports the
        epochs it trained (``metrics["local-epochs"]``) has them recorded in `setup_record`
        (`pretrain_epochs_reported`), with a warning where they differ.
    superclient_epochs : int (default: 1)
        E_S: passes of the model along a superclient's chain per round.
    fraction_train : float (default: 1.0)
        C: fraction of the superclients selected per round (at least one).
    proximal_mu : float (default: 0.0)
        Sent as ``config["proximal-mu"]`` in stage 2; > 0 makes each client's FedProx term pull
        toward the model it received, i.e. the previous client's (paper's Eq. 5).
    feddyn : FedDynServer | None (default: None)
        FedSeq + FedDyn (the FedSeq paper's best combination): every client of a chain runs
        FedDyn's objective regularized toward the model it received (the previous client's), and
        the server applies FedDyn's step to the new global model with the superclients as its m
        clients, θ_prev the round's start model and the |D_S|-weighted average as the mean.
        FedSeqInter applies it at its every-N_S-rounds aggregation, with the slots as the m
        clients and θ_prev the model the slots last restarted from. Pre-training (stage 1) is
        always plain SGD.
    report_label_counts : bool (default: False)
        Diagnostic for simulations: ask every client for its true label counts (a "query"
        message answered with ``metrics["label-counts"]``) and report the superclients'
        balance from them too.
    hop_step, hop_clip, check_parts (default: 'sized', 1.5, True)
        The server's damped (η) and bounded (c) hops and its divergence check: see `ChainGuard`
        and docs/strategies.md. 'sized': 0.25 until the first aggregation, then 1 (the paper's)
        where the hops before it moved the model by at most 0.15 of its norm (small local steps;
        `core.sequential.sized_step`), else 0.25. A hop counts at least its client's share of
        the superclient's data, so a chain of one client is a FedAvg client: its hop is taken
        whole. `hop_step=1, hop_clip=0` (with `update_clip=0`) is the paper's algorithm exactly.
    witness : bool (default: True)
        With the run's `evaluate_fn`, compare the chains' average with the FedAvg round their
        first hops form now and then, and warn when the chains keep losing or end behind
        (`FirstHopWitness`; FedSeq without FedDyn only): a federation where they do worse than
        FedAvg is said in the log.
    fraction_evaluate, round_timeout, seed, update_clip, weight_clip, history_check
        See `RelayStrategy`. The pre-training replies are bounded against each other (stream
        "pretrain"): their sample counts are the superclients' weights.
    """

    # pylint: disable=too-many-arguments, too-many-locals, too-many-instance-attributes
    def __init__(
        self,
        make_model: Callable[[], nn.Module],
        num_classes: int,
        *,
        exemplar_pool: tuple[torch.Tensor, torch.Tensor] | None = None,
        exclude_exemplars: Callable[[np.ndarray], None] | None = None,
        normalization: Callable[[torch.Tensor], torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
        approximator: str | None = None,
        exemplars_per_class: int = 10,
        conf_normalize: str = "sum",
        clf_layers: str = "all",
        metric: str | None = None,
        grouping: str = "greedy",
        greedy_merge: str = "half",
        min_samples: int = 800,
        max_clients: int = 11,
        pretrain_epochs: int = 10,
        superclient_epochs: int = 1,
        fraction_train: float = 1.0,
        proximal_mu: float = 0.0,
        feddyn: FedDynServer | None = None,
        report_label_counts: bool = False,
        hop_step: float | str = SIZED,
        hop_clip: float = DEFAULT_HOP_CLIP,
        check_parts: bool = True,
        witness: bool = True,
        fraction_evaluate: float = 0.0,
        round_timeout: float | None = None,
        seed: int = 0,
        update_clip: float = DEFAULT_UPDATE_CLIP,
        weight_clip: float = DEFAULT_WEIGHT_CLIP,
        history_check: bool = True,
    ) -> None:
        super().__init__(fraction_evaluate, round_timeout, seed, update_clip, weight_clip, history_check)
        if approximator is None:
            approximator = "conf" if exemplar_pool is not None else "clf"
        if metric is None:
            metric = "kl" if approximator == "conf" else "cosine"
        _check_choice("approximator", approximator, APPROXIMATORS)
        _check_choice("conf_normalize", conf_normalize, sc.CONF_NORMALIZATIONS)
        _check_choice("clf_layers", clf_layers, sc.CLF_LAYERS)
        _check_choice("metric", metric, tuple(sc.METRICS))
        _check_choice("grouping", grouping, sc.GROUPINGS)
        _check_choice("greedy_merge", greedy_merge, sc.GREEDY_MERGES)
        if grouping == "greedy" and metric in FEDSEQ_DISTRIBUTION_METRICS and approximator != "conf":
            raise ValueError(
                f"metric '{metric}' compares distributions and needs approximator 'conf'; "
                "with 'clf' and greedy grouping use 'cosine' or 'euclidean'"
            )
        if approximator == "conf" and exemplar_pool is None:
            raise ValueError(
                "approximator 'conf' needs an exemplar_pool (x, y) of labelled data on the server; "
                "without one use approximator 'clf' (the default when no exemplar_pool is given)"
            )
        for name, value in (("min_samples", min_samples), ("max_clients", max_clients),
                            ("pretrain_epochs", pretrain_epochs), ("superclient_epochs", superclient_epochs),
                            ("exemplars_per_class", exemplars_per_class), ("num_classes", num_classes)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        if proximal_mu < 0:
            raise ValueError(f"proximal_mu must be >= 0, got {proximal_mu}")
        self.num_classes = num_classes
        self.approximator = approximator
        self.exemplars_per_class = exemplars_per_class
        self.conf_normalize = conf_normalize
        self.clf_layers = clf_layers
        self.metric = metric
        self.grouping = grouping
        self.greedy_merge = greedy_merge
        self.min_samples = min_samples
        self.max_clients = max_clients
        self.pretrain_epochs = pretrain_epochs
        self.superclient_epochs = superclient_epochs
        self.fraction_train = fraction_train
        self.proximal_mu = proximal_mu
        self.feddyn = feddyn
        self.report_label_counts = report_label_counts
        keys = ("fedseq-hop-step", "fedseq-hop-clip")
        self.chain = ChainGuard(
            type(self).__name__, self.guard, hop_step, hop_clip, keys, check_parts, share_floor=True
        )
        # FedDyn's corrected average is no plain average of first hops: no witness then.
        self.witness = witness
        self._witness = FirstHopWitness(type(self).__name__, update_clip, ADVICE, self.chain.budget) if witness and feddyn is None else None
        self.plan: dict[int, list[int]] = {}  # the superclients: stage 1's, with the nodes placed since
        self.superclients: dict[int, list[int]] = {}  # this round's: the plan's connected members
        self.client_samples: dict[int, int] = {}
        # Per superclient, Σ n_j·D̃_j over the members with an approximation (ψ = conf): D_S up to scale.
        self.estimates: dict[int, np.ndarray] = {}
        self._initial: ArrayRecord | None = None  # what pre-training starts from (stage 1 and newcomers)
        self._make_model = make_model
        self._normalization = normalization if normalization is not None else _identity
        self._device = torch.device(device)
        self._exclude_exemplars = exclude_exemplars
        self._pool = exemplar_pool
        self._exemplars = np.zeros(0, dtype=np.int64)
        if approximator == "conf" and exemplar_pool is not None:
            self._exemplars = sc.exemplar_indices(exemplar_pool[1].numpy(), exemplars_per_class, self.rng)
            self._announce_exemplars()
        self._chains: list[_Chain] = []
        self._round_start: ArrayRecord | None = None  # FedDyn's θ_prev
        self._hops_done = 0
        self._round_metrics: list[RecordDict] = []

    # ------------------------------------------------------------------ stage 2
    def train_requests(
        self, server_round: int, hop: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Request]:
        """Hop h: each selected superclient's current model to the h-th client of its chain."""
        if hop == 0:
            self._start_round(arrays, grid)
        settings: dict[str, Any] = {**dict(config), "server-round": server_round, "proximal-mu": self.proximal_mu}
        if self.feddyn is not None:
            settings.update(self.feddyn.settings())
        # "chain-pass" (0 … E_S − 1) lets a client shuffle differently when the chain comes back.
        return [
            Request(
                chain.order[hop],
                train_content(to_record(chain.model), {**settings, "chain-pass": chain.chain_pass(hop, self.superclient_epochs)}),
                tag=chain.superclient,
            )
            for chain in self._chains
            if hop < len(chain.order)
        ]

    def aggregate_hop(
        self, server_round: int, hop: HopResult
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Move each chain's model on; after the last hop, combine the superclient models."""
        chains = {chain.superclient: chain for chain in self._chains}
        firsts = [reply for reply in hop.replies if chains[reply.request.tag].trained == 0]
        laters = [reply for reply in hop.replies if chains[reply.request.tag].trained > 0]
        held = [float(chains[reply.request.tag].examples) for reply in laters]
        # A chain passes its superclient's data E_S times: that is what its hops fold in all.
        planned = lambda replies: [float(chains[r.request.tag].weight * self.superclient_epochs) for r in replies]  # noqa: E731
        hops = lambda replies: [chains[r.request.tag].planned for r in replies]  # noqa: E731
        folded = self.chain.fold(firsts, first_hop=True, planned=planned(firsts), chain_hops=hops(firsts))
        if self._witness is not None:
            self._witness.note(firsts, folded)
        folded += self.chain.fold(laters, first_hop=False, held=held, planned=planned(laters), chain_hops=hops(laters))
        for reply in folded:
            chain = chains[reply.request.tag]
            chain.model = reply.numpy()
            chain.trained += 1
            chain.examples += reply.num_examples
            self._round_metrics.append(RecordDict({METRICS_KEY: reply.metrics}))
        for miss in hop.misses:
            # The chain keeps the model the missing client was given: the next client gets it.
            chain, node = chains[miss.request.tag], miss.request.node_id
            chain.missed.append(node)
            if miss.answered and node not in chain.retried:
                chain.retried.append(node)
                chain.order.append(node)
        self._hops_done += 1
        if any(self._hops_done < len(chain.order) for chain in self._chains):
            return None, None
        self.record(
            "superclients",
            [
                {
                    "id": chain.superclient,
                    "order": chain.order[: chain.planned // self.superclient_epochs],
                    "samples": chain.weight,
                    "slot": chain.slot,
                    "trained_hops": chain.trained,
                    "missed": chain.missed,
                    "retried": chain.retried,
                }
                for chain in self._chains
            ],
        )
        metrics = aggregate_metricrecords(self._round_metrics, NUM_EXAMPLES_KEY) if self._round_metrics else None
        return self._finish_round(server_round, [chain for chain in self._chains if chain.trained > 0]), metrics

    def _start_round(self, arrays: ArrayRecord, grid: Grid) -> None:
        """Drop vanished nodes, select superclients, give each a start model and a shuffled chain."""
        self._follow_live_nodes(set(self.awake(live_node_ids(grid))))
        self._chains, self._hops_done, self._round_metrics = [], 0, []
        self._round_start, start = arrays, to_numpy(arrays)
        if self._witness is not None:
            self._witness.begin(start)
        ids = sorted(self.superclients)
        if not ids:
            log(WARNING, "FedSeq: no superclient left; the round trains nothing")
            return
        count = sample_count(self.fraction_train, len(ids))
        selected = sorted(int(sid) for sid in self.rng.choice(ids, size=count, replace=False))
        for sid, (model, slot) in zip(selected, self._start_models(len(selected), start)):
            members = self.superclients[sid]
            # Shuffle positions, not the uint64 node ids (numpy would turn those into floats).
            one_pass = [members[int(i)] for i in self.rng.permutation(len(members))]
            weight = sum(self.client_samples[node] for node in members)
            self._chains.append(_Chain(sid, one_pass * self.superclient_epochs, model, weight, slot))

    def _start_models(self, count: int, start: dict[str, np.ndarray]) -> list[tuple[dict[str, np.ndarray], int | None]]:
        """(start model, slot) of each of the `count` selected superclients: the global model `start`."""
        return [(start, None)] * count

    def _finish_round(self, server_round: int, trained: list[_Chain]) -> ArrayRecord | None:
        """|D_S|-weighted average of the superclients that trained (None when none did), with
        FedDyn's server step when FedDyn is on, and the divergence check."""
        if not trained:
            return None
        models, weights = [chain.model for chain in trained], [float(chain.weight) for chain in trained]
        assert self._round_start is not None
        average = self._feddyn_step(self._round_start, models, weighted_average(models, weights), len(self.superclients))
        chained = any(chain.planned > 1 for chain in trained)  # chains of one hop are FedAvg's clients
        self._check_divergence(server_round, self._round_start, models, weights, average, chained)
        if chained and self._witness:
            last = server_round == self.last_round
            if compared := self._witness.compare(server_round, average, self.evaluate_on_server(server_round), last):
                self.record("witness", compared)
        return average

    def _check_divergence(
        self, server_round: int, start: ArrayRecord, models: list[dict[str, np.ndarray]], weights: list[float],
        average: ArrayRecord, chained: bool = True,
    ) -> None:
        """Record (``divergence``) how far the averaged superclient models ended apart."""
        evaluate, last = self.evaluate_on_server(server_round), server_round == self.last_round
        fedavg = self._witness.first_hops_accuracy if self._witness else None  # its last comparison's
        self.record("divergence", self.chain.check(start, models, weights, average, evaluate, last, chained, fedavg))

    def _feddyn_step(
        self, previous: ArrayRecord, models: list[dict[str, np.ndarray]], average: ArrayRecord, num_clients: int
    ) -> ArrayRecord:
        """FedDyn's server correction of `average` (unchanged without FedDyn)."""
        if self.feddyn is None:
            return average
        corrected = self.feddyn.step(previous, models, average, num_clients)
        self.record("feddyn_h_norm", self.feddyn.h_norm)
        return corrected

    def _follow_live_nodes(self, live: set[int]) -> None:
        """This round's superclients: the plan's members in `live` (connected, not resting). A node
        that left or rests is dropped from its superclient for the round (an emptied superclient
        sits the round out) and is back in it when it is back."""
        current = {sid: [node for node in members if node in live] for sid, members in self.plan.items()}
        if emptied := [sid for sid in sorted(self.plan) if self.superclients.get(sid) and not current[sid]]:
            log(WARNING, "FedSeq: superclients %s have no connected, awake member; they sit out until one is back", emptied)
        self.superclients = {sid: members for sid, members in current.items() if members}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Base state plus the superclient plan, the sample counts and the exemplars."""
        return {
            **super().state_dict(),
            "plan": {sid: list(nodes) for sid, nodes in self.plan.items()},
            "superclients": {sid: list(nodes) for sid, nodes in self.superclients.items()},
            "client_samples": dict(self.client_samples),
            "estimates": {sid: estimate.copy() for sid, estimate in self.estimates.items()},
            "initial": None if self._initial is None else to_numpy(self._initial),
            "exemplars": self._exemplars.copy(),
            "chain": self.chain.state_dict(),
            **({"feddyn": self.feddyn.state_dict()} if self.feddyn is not None else {}),
            **({"witness": self._witness.state_dict()} if self._witness is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output and exclude the restored exemplars again."""
        super().load_state_dict(state)
        self.plan = {int(sid): list(nodes) for sid, nodes in state["plan"].items()}
        self.superclients = {int(sid): list(nodes) for sid, nodes in state["superclients"].items()}
        self.client_samples = {int(node): int(n) for node, n in state["client_samples"].items()}
        self.estimates = {int(sid): np.asarray(estimate, dtype=np.float64) for sid, estimate in state["estimates"].items()}
        self._initial = None if state["initial"] is None else to_record(state["initial"])
        self._exemplars = np.asarray(state["exemplars"], dtype=np.int64)
        self.chain.load_state_dict(state["chain"])
        if self.feddyn is not None:
            self.feddyn.load_state_dict(state["feddyn"])
        if self._witness is not None:
            self._witness.load_state_dict(state["witness"])
        self._announce_exemplars()

    def _announce_exemplars(self) -> None:
        if self._exclude_exemplars is not None and len(self._exemplars):
            self._exclude_exemplars(self._exemplars.copy())


class FedSeqInter(FedSeq):
    """FedSeqInter: FedSeq whose superclient models are passed on between rounds.

    There are max(1, round(C·N_S)) model slots, as many as superclients selected per round.
    Each round the selected superclients are matched to the slots in random order; each
    continues its slot's model along its chain and writes it back, and the slot's sample
    counter grows by |D_S| (not when no client of the chain trained). Every N_S rounds (N_S =
    the current number of superclients) the slots are averaged, weighted by their counters,
    and all slots restart from that average with zeroed counters. Between aggregations the
    model the strategy returns (and that is evaluated) is the counter-weighted average of the
    slots. Parameters are FedSeq's; where most superclients are single clients, or the slots are
    averaged too rarely for the checks to judge the run early, it warns before round 1
    (`core.superclients.single_client_relay`, `core.superclients.slots_judged_late`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._witness = None  # a slot's first hop continues the slot's model, not the global one
        self._slots: list[dict[str, np.ndarray]] = []  # as numpy, like the chains' models
        self._slot_start: ArrayRecord | None = None  # FedDyn's θ_prev: the model the slots restarted from
        self.slot_samples: list[float] = []
        self.rounds_since_average = 0

    def setup(self, grid: Grid, initial_arrays: ArrayRecord, train_config: ConfigRecord) -> None:
        """FedSeq's stage 1, then every slot starts from the initial model."""
        super().setup(grid, initial_arrays, train_config)
        if reason := sc.single_client_relay(list(self.superclients.values()), self.setup_record["min_samples"]):
            log(WARNING, "FedSeqInter: %s", reason)
        if self.last_round and (reason := sc.slots_judged_late(len(self.superclients), self.last_round)):
            log(WARNING, "FedSeqInter: %s", reason)
        count = sample_count(self.fraction_train, len(self.superclients))
        self._slots = [to_numpy(initial_arrays)] * count
        self._slot_start = initial_arrays
        self.slot_samples = [0.0] * count
        self.setup_record["slots"] = count

    def _start_models(self, count: int, start: dict[str, np.ndarray]) -> list[tuple[dict[str, np.ndarray], int | None]]:
        """The selected superclients take the slots in random order."""
        slots = [int(s) for s in self.rng.permutation(len(self._slots))[:count]]
        return [(self._slots[slot], slot) for slot in slots]

    def _finish_round(self, server_round: int, trained: list[_Chain]) -> ArrayRecord | None:
        """Write the chains back to their slots; every N_S rounds average and reset the slots."""
        for chain in trained:
            assert chain.slot is not None
            self._slots[chain.slot] = chain.model
            self.slot_samples[chain.slot] += chain.weight
        self.rounds_since_average += 1
        aggregate = self.rounds_since_average >= max(1, len(self.superclients))
        filled = [i for i, n in enumerate(self.slot_samples) if n > 0]
        if not filled:
            if aggregate:  # nothing trained since the last average: the slots still hold it
                self.rounds_since_average = 0
            return None
        arrays = [self._slots[i] for i in filled]
        average = weighted_average(arrays, [self.slot_samples[i] for i in filled])
        self.record("slots", {"samples": list(self.slot_samples), "aggregated": aggregate})
        if aggregate:
            assert self._slot_start is not None
            weights = [self.slot_samples[i] for i in filled]
            average = self._feddyn_step(self._slot_start, arrays, average, len(self._slots))
            self._check_divergence(server_round, self._slot_start, arrays, weights, average)
            self._slot_start = average
            self._slots = [to_numpy(average)] * len(self._slots)
            self.slot_samples = [0.0] * len(self._slots)
            self.rounds_since_average = 0
        elif server_round == self.last_round:  # the run ends between two averages: warn if it never learned
            assert self._slot_start is not None
            self.chain.check_last(self._slot_start, average, self.evaluate_on_server(server_round))
        return average

    def state_dict(self) -> dict[str, Any]:
        """FedSeq's state plus the slot models, their counters and the aggregation clock."""
        return {
            **super().state_dict(),
            "slots": [dict(slot) for slot in self._slots],
            "slot_samples": list(self.slot_samples),
            "rounds_since_average": self.rounds_since_average,
            "slot_start": None if self._slot_start is None else to_numpy(self._slot_start),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output."""
        super().load_state_dict(state)
        self._slots = [{key: np.asarray(value) for key, value in slot.items()} for slot in state["slots"]]
        self.slot_samples = [float(n) for n in state["slot_samples"]]
        self.rounds_since_average = int(state["rounds_since_average"])
        start = state.get("slot_start")
        self._slot_start = None if start is None else to_record(start)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def build(config: RunConfig, env: ServerEnv) -> FedSeq:
    """FedSeq (`strategy='fedseq'`) or FedSeqInter (`'fedseq-inter'`) from the run config.

    The exemplars come from the global test split and are removed from the evaluation set.
    """
    cls = FedSeqInter if config.strategy == "fedseq-inter" else FedSeq
    return cls(
        env.make_model,
        env.num_classes,
        exemplar_pool=(env.data.x_test, env.data.y_test),
        exclude_exemplars=env.exclude_from_evaluation,
        normalization=env.normalization,
        device=env.device,
        approximator=config.fedseq_approximator,
        exemplars_per_class=config.fedseq_exemplars_per_class,
        conf_normalize=config.fedseq_conf_normalize,
        clf_layers=config.fedseq_clf_layers,
        metric=config.fedseq_metric,
        grouping=config.fedseq_grouping,
        greedy_merge=config.fedseq_greedy_merge,
        min_samples=config.fedseq_min_samples,
        max_clients=config.fedseq_max_clients,
        pretrain_epochs=config.fedseq_pretrain_epochs,
        superclient_epochs=config.fedseq_superclient_epochs,
        fraction_train=config.fraction_train,
        proximal_mu=config.proximal_mu,
        feddyn=feddyn_from_config(config, env),
        report_label_counts=config.report_label_counts,
        hop_step=parse_hop_step(config.fedseq_hop_step),
        hop_clip=config.fedseq_hop_clip,
        witness=config.fedseq_witness,
        fraction_evaluate=config.fraction_evaluate,
        round_timeout=config.timeout,
        seed=config.seed,
        update_clip=config.update_clip,
        weight_clip=config.weight_clip,
        history_check=config.checks_update_history,
    )
