"""FedCat: device concatenation with grouping- and count-based selection (Hu et al.).

The pure rules (grouping, count table, MBIE-EB/ε-greedy selection, dispatch) live in
`concatfl.core.fedcat`; this module turns them into train messages and folds the replies back
into the K model copies.
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore import log

from ..config import parse_hop_step
from ..core.fedcat import (
    CountTable,
    cycle_offset,
    devices_per_round,
    dispatch,
    is_grouping_round,
    judged_late,
    long_cycle,
    make_groups,
    select_grouped,
    select_random,
    select_replacement,
)
from .base import RelayStrategy
from .common import (
    NUM_EXAMPLES_KEY,
    HopResult,
    Miss,
    Request,
    live_node_ids,
    to_numpy,
    to_record,
    train_content,
    weighted_average,
)
from .feddyn import FedDynServer, from_config as feddyn_from_config
from .guard import DEFAULT_UPDATE_CLIP, DEFAULT_WEIGHT_CLIP
from .membership import RETURNED
from .sequential import DEFAULT_HOP_CLIP, FEDCAT_HOP_STEP, SIZED, ChainGuard, FirstHopWitness

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..runtime import ServerEnv

SELECTIONS = ("grouped-count", "random")
PAPER_FRACTION = 0.1  # the FedCat paper's share of devices selected per round


class FedCat(RelayStrategy):
    """FedCat: K copies of the global model each train on a chain of K devices, one per round,
    before the server averages them.

    At the start of each K-round cycle the server makes K copies m_1..m_K of the global model
    with accumulated data sizes d_i = 0. Every round it selects one device per group (L_dev) and
    sends copy i to L_dev[(offset + i) % K], offset = round % K; each device trains its copy as
    an ordinary Flower train message, the returned model replaces the copy and d_i grows by the
    device's num-examples. After the cycle's last round the global model becomes
    Σ d_i·m_i / Σ d_i and is evaluated. Every λ·K rounds the connected nodes are redrawn into K
    groups of (nearly) equal size. Per round K models go down and K come up, like FedAvg with
    K clients. A run whose last round falls inside a cycle returns the average of the copies so
    far as its final model (the copies themselves are left as they are).

    Each round's record (metrics.json) holds ``k``, ``offset``, ``selected`` (L_dev),
    ``copy_to_device`` (entry i: the node copy i went to), ``data_sizes`` (d_i after the round)
    and, when they were redrawn, ``groups``.

    Only ``"arrays"`` are sent (with the run's training config plus ``"server-round"``) and only
    ``"arrays"`` and ``metrics["num-examples"]`` are read back, so any Flower ClientApp works.

    Faults: a copy whose device gives no usable reply (missing, an error, or invalid: wrong
    keys/shapes/dtypes, NaN/Inf, num-examples ≤ 0, rejected with a logged reason by
    `common.collect`) goes on, in a second hop of the same round, to a replacement device: a
    connected member of the lost device's group not selected this round (any connected node not
    selected, with `selection="random"`), chosen by the same count rule and counted in M
    (recorded under ``replacements``). A copy whose replacement fails too, or that finds none,
    keeps its model and its d_i for the next round. An outsized reply is bounded (`update_clip`, `weight_clip`; recorded
    under ``guard``): it moves its copy and adds to d_i only as much as the bounds allow. Nodes missing from `grid.get_node_ids()` leave their groups; the groups
    are redrawn at the next grouping point, or at once when a group became empty. A node that
    joins after the start, or comes back after leaving its group, joins the smallest group at
    once (`place`; before the first grouping every connected node is drawn from): its counts
    are zero, so the selection soon picks it. When fewer
    than K nodes remain, K shrinks to the nodes available (logged): the open cycle's copies are
    averaged into the global model first, so no training is lost, and a new cycle with new
    groups and a fresh count table starts (offsets of a different cycle length are not
    comparable). K never grows back.

    Parameters
    ----------
    k : int (default: 0)
        Devices per round K (= copies = rounds per cycle). 0 picks round(fraction_train · N),
        at least 2, from the N nodes connected at the first round. A K above
        `core.fedcat.LEVEL_K` is warned about at the first round (`core.fedcat.long_cycle`).
    fraction_train : float (default: 0.1)
        Only used when `k` is 0. The paper selects 10 % of the devices per round; 1.0 would make
        K = N: groups of one device and a cycle as long as the number of nodes.
    group_cycles : int (default: 2)
        λ: groups are redrawn every λ cycles (λ·K rounds). The paper gives no value. A group
        supplies one device per round, so a grouping lasting λ·K rounds can rotate through all
        N/K members of each group only if λ·K ≥ N/K, i.e. N ≤ λ·K². λ = 2 is the smallest value
        meeting this at K = 0.2·N for N ≥ 13 (e.g. 20 nodes, K = 4: 8 rounds per grouping for
        groups of 5, where λ = 1 gives only 4) and at K = 0.1·N for N ≥ 50; larger λ only
        slows the mixing of which devices can meet in one copy's chain.
    epsilon : float (default: 0.5)
        ε: probability of taking a group's device with the fewest selections at the current
        offset (largest MBIE-EB weight 1/√count) instead of drawing one with probability
        proportional to that weight. Both branches prefer never-selected devices; ε only sets
        how greedily the least-used device is preferred afterwards. The paper gives no value;
        0.5 weighs the two equally.
    selection : str (default: "grouped-count")
        "grouped-count" (the paper's grouping + count-based selection) or "random" (K distinct
        nodes drawn uniformly each round, no groups and no counts: the "FedCat w/ DC" ablation).
    concat : bool (default: True)
        False averages the copies after every round instead of every K rounds (the
        "FedCat w/ GC" ablation); with `selection="random"` this is FedAvg with K clients.
    feddyn : FedDynServer | None (default: None)
        FedCat + FedDyn: the devices run FedDyn's objective (regularized toward the copy they
        received) and whenever the copies are averaged into a new global model (cycle end, or
        K shrinking) the server applies FedDyn's step with the K copies as its m clients, θ_prev
        the model the cycle started from and the d_i-weighted average as the mean. The average
        reported for a last round inside a cycle is not corrected (h is left for a resumed run).
    hop_step, hop_clip, check_parts (default: 0.5, 1.5, True)
        The server's damped (η; "auto": adapted from the hops' lengths, an option: docs/strategies.md) and bounded (c) hops and
        its divergence check: see `ChainGuard` and docs/strategies.md. `hop_step=1,
        hop_clip=0` (with `update_clip=0`) is the paper's algorithm exactly.
    fraction_evaluate, round_timeout, seed, update_clip, weight_clip, history_check
        See `RelayStrategy`.
    """

    # pylint: disable=too-many-arguments, too-many-instance-attributes
    def __init__(
        self,
        k: int = 0,
        fraction_train: float = PAPER_FRACTION,
        group_cycles: int = 2,
        epsilon: float = 0.5,
        selection: str = "grouped-count",
        concat: bool = True,
        feddyn: FedDynServer | None = None,
        hop_step: float | str = FEDCAT_HOP_STEP,
        hop_clip: float = DEFAULT_HOP_CLIP,
        check_parts: bool = True,
        fraction_evaluate: float = 0.0,
        round_timeout: float | None = None,
        seed: int = 0,
        update_clip: float = DEFAULT_UPDATE_CLIP,
        weight_clip: float = DEFAULT_WEIGHT_CLIP,
        history_check: bool = True,
    ) -> None:
        super().__init__(fraction_evaluate, round_timeout, seed, update_clip, weight_clip, history_check)
        if k < 0 or k == 1:
            raise ValueError(f"k must be 0 (auto) or >= 2, got {k}")
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        if group_cycles < 1:
            raise ValueError(f"group_cycles (λ) must be a positive integer, got {group_cycles}")
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        self.k = k
        self.fraction_train = fraction_train
        self.group_cycles = group_cycles
        self.epsilon = epsilon
        self.selection = selection
        self.concat = concat
        self.feddyn = feddyn
        keys = ("fedcat-hop-step", "fedcat-hop-clip")
        if hop_step == SIZED:
            raise ValueError(
                "hop_step 'sized' is FedSeq's rule, not measured for FedCat: use a number, 'even', 'mean' or 'auto'"
            )
        self.chain = ChainGuard("FedCat", self.guard, hop_step, hop_clip, keys, check_parts)
        self._witness = FirstHopWitness("FedCat", update_clip, "Its copies are averaged once per cycle of K rounds, where "
                                        "FedAvg(fraction_train=K/N) averages every round: that, or FedSeq, should do better.",
                                        self.chain.budget)
        # The algorithm's state (all saved by `state_dict`); K is fixed at the first round.
        self._k: int | None = None
        self._round_index = 0  # r, counted from when the current K took effect
        self._groups: list[list[int]] = []
        self._counts = CountTable(0)
        self._copies: list[dict[str, np.ndarray]] = []  # as numpy: encoded only when sent
        self._data_sizes = np.zeros(0, dtype=np.int64)
        self._selected: list[int] = []
        self._cycle_start: ArrayRecord | None = None  # θ_prev of FedDyn's step
        # Transient within a round: the global model folded from the copies when K shrank, the
        # nodes connected at its start, its settings, the copies to replace and the replies so far.
        self._folded: ArrayRecord | None = None
        self._live: set[int] = set()
        self._settings: dict[str, Any] = {}
        self._replacing = False  # hop 0's misses were handled (the round's second hop, if any)
        self._replacements: list[Request] = []
        self._round_replies: list[RecordDict] = []

    # ------------------------------------------------------------------ membership
    def place(self, grid: Grid, nodes: list[int], why: str, server_round: int) -> dict[int, Any]:
        """Before the first grouping every connected node is in the pool the groups are drawn
        from; after it, a node that joins, or comes back without a group, joins the smallest."""
        if not self._groups:
            return {node: "pool" for node in nodes}
        placed: dict[int, Any] = {}
        for node in nodes:
            current = [index for index, group in enumerate(self._groups) if node in group]
            if not current:
                current = [min(range(len(self._groups)), key=lambda i: (len(self._groups[i]), i))]
                self._groups[current[0]].append(node)
            placed[node] = {"group": current[0]}
        if why != RETURNED and placed:
            self.record("groups", [list(group) for group in self._groups])
        return placed

    # ------------------------------------------------------------------ rounds
    def train_requests(
        self, server_round: int, hop: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Request]:
        """Hop 0: copy i to L_dev[(offset + i) % K]; hop 1: the copies whose device gave no
        usable reply, to replacement devices."""
        if hop == 1:
            requests, self._replacements = self._replacements, []
            return requests
        if hop > 1:
            return []
        self._replacing, self._round_replies = False, []
        nodes = live_node_ids(grid)
        self._live = set(nodes)
        if not nodes:
            log(WARNING, "FedCat: no connected nodes; round %s trains nothing", server_round)
            return []
        global_arrays = self._follow_nodes(server_round, nodes, arrays)
        k = self._require_k()
        offset = cycle_offset(self._round_index, k)
        if self.selection == "grouped-count":
            self._update_groups(nodes, k)
            awake_groups = [self.awake(group) for group in self._groups]
            self._selected = select_grouped(awake_groups, self._counts, offset, self.epsilon, self.rng)
        else:
            awake = self.awake(nodes)
            self._selected = select_random(awake if len(awake) >= k else nodes, k, self.rng)
        if offset == 0 or not self.concat:
            start = to_numpy(global_arrays)
            self._copies = [start] * k
            self._data_sizes = np.zeros(k, dtype=np.int64)
            self._cycle_start = global_arrays
            self._witness.begin(start)
        plan = dispatch(self._selected, offset)
        self.record("k", k)
        self.record("offset", offset)
        self.record("selected", list(self._selected))
        self.record("copy_to_device", plan)
        self._settings = {**dict(config), "server-round": server_round}
        if self.feddyn is not None:
            self._settings.update(self.feddyn.settings())
        return [Request(node, train_content(to_record(self._copies[i]), self._settings), tag=i) for i, node in enumerate(plan)]

    def _replacement_requests(self, misses: list[Miss]) -> list[Request]:
        """Each copy lost in hop 0 to a replacement device (`core.fedcat.select_replacement`),
        recorded under ``replacements``."""
        k = self._require_k()
        offset = cycle_offset(self._round_index, k)
        taken = set(self._selected)
        requests, record = [], []
        for copy_index, lost in sorted((miss.request.tag, miss.request.node_id) for miss in misses):
            if self.selection == "grouped-count":
                pool = self._groups[(offset + copy_index) % k]
            else:
                pool = sorted(self._live)
            candidates = self.awake((node for node in pool if node in self._live and node not in taken), never_empty=False)
            node = select_replacement(candidates, self._counts, offset, self.epsilon, self.rng)
            record.append({"copy": copy_index, "lost": lost, "replacement": node})
            if node is not None:
                taken.add(node)
                requests.append(Request(node, train_content(to_record(self._copies[copy_index]), self._settings), tag=copy_index))
        self.record("replacements", record)
        return requests

    def aggregate_hop(
        self, server_round: int, hop: HopResult
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Valid replies replace their copy and add to its d_i; after hop 0 the lost copies go
        to replacement devices (a second hop); once the round's hops are done the copies are
        averaged if the cycle ends (every round without concatenation, and at the run's last
        round)."""
        # A copy that has not trained in this cycle still holds the averaged model: its hop is a first hop.
        firsts = [reply for reply in hop.replies if self._data_sizes[reply.request.tag] == 0]
        laters = [reply for reply in hop.replies if self._data_sizes[reply.request.tag] > 0]
        held = [float(self._data_sizes[reply.request.tag]) for reply in laters]
        # A copy visits K devices a cycle; their sizes are not known ahead: each counts as this hop's.
        k = self._require_k()
        planned = lambda replies: [float(k * r.num_examples) for r in replies]  # noqa: E731
        folded = self.chain.fold(firsts, first_hop=True, planned=planned(firsts))
        self._witness.note(firsts, folded)
        folded += self.chain.fold(laters, first_hop=False, held=held, planned=planned(laters))
        for reply in folded:
            self._copies[reply.request.tag] = reply.numpy()
            self._data_sizes[reply.request.tag] += reply.num_examples
        self._round_replies += [reply.content for reply in hop.replies]
        if not self._replacing and hop.misses:
            self._replacing = True
            self._replacements = self._replacement_requests(hop.misses)
            if self._replacements:
                return None, None
        self.record("data_sizes", [int(d) for d in self._data_sizes])
        k = self._require_k()
        cycle_ends = cycle_offset(self._round_index, k) == k - 1 or not self.concat
        self._round_index += 1
        new_global, self._folded = self._folded, None
        if cycle_ends or server_round == self.last_round:
            if not cycle_ends:
                log(INFO, "FedCat: last round inside a cycle; returning the average of the copies so far")
            averaged = self._average_copies(server_round, close_cycle=cycle_ends)
            new_global = new_global if averaged is None else averaged
        metrics = aggregate_metricrecords(self._round_replies, NUM_EXAMPLES_KEY) if self._round_replies else None
        return new_global, metrics

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Base state plus K, r, groups, count table, last L_dev, copies (numpy) and d_i."""
        state = super().state_dict()
        state["fedcat"] = {
            "k": self._k,
            "round_index": self._round_index,
            "groups": [list(group) for group in self._groups],
            "counts": self._counts.state_dict(),
            "selected": list(self._selected),
            "copies": [dict(copy) for copy in self._copies],
            "data_sizes": self._data_sizes.copy(),
            "cycle_start": None if self._cycle_start is None else to_numpy(self._cycle_start),
            "chain": self.chain.state_dict(),
            "witness": self._witness.state_dict(),
        }
        if self.feddyn is not None:
            state["feddyn"] = self.feddyn.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        super().load_state_dict(state)
        saved = state["fedcat"]
        self._k = saved["k"]
        self._round_index = int(saved["round_index"])
        self._groups = [[int(node) for node in group] for group in saved["groups"]]
        self._counts = CountTable.from_state(saved["counts"])
        self._selected = [int(node) for node in saved["selected"]]
        self._copies = [{key: np.asarray(value) for key, value in copy.items()} for copy in saved["copies"]]
        self._data_sizes = np.array(saved["data_sizes"], dtype=np.int64)
        start = saved.get("cycle_start")
        self._cycle_start = None if start is None else to_record(start)
        self.chain.load_state_dict(saved["chain"])
        self._witness.load_state_dict(saved["witness"])
        if self.feddyn is not None:
            self.feddyn.load_state_dict(state["feddyn"])

    # ------------------------------------------------------------------ helpers
    def _require_k(self) -> int:
        if self._k is None:
            raise RuntimeError("FedCat's K is set at the first round; no round has started yet")
        return self._k

    def _follow_nodes(self, server_round: int, nodes: list[int], arrays: ArrayRecord) -> ArrayRecord:
        """Fix K at the first round, drop vanished nodes from the groups, and shrink K when fewer
        than K nodes remain. Returns the global model the next copies start from."""
        if self._k is None:
            wanted = devices_per_round(self.k, self.fraction_train, len(nodes))
            self._k = min(wanted, len(nodes))
            if self._k < wanted:
                log(WARNING, "FedCat: K=%s but only %s nodes are connected; K=%s", wanted, len(nodes), self._k)
            share = self._k / len(nodes)
            log(INFO, "FedCat: K = %s of %s nodes train per round (%.0f %%): compare it with FedAvg(fraction_train=%.2g), "
                "not FedAvg(), which trains all %s (k= or fraction_train= sets K)", self._k, len(nodes), 100 * share,
                share, len(nodes))
            for reason in (long_cycle(self._k), judged_late(self._k, self.last_round) if self.last_round else None):
                if reason:
                    log(WARNING, "FedCat: %s", reason)
            self._counts = CountTable(self._k)
            return arrays
        alive = set(nodes)
        gone = sorted({node for group in self._groups for node in group} - alive)
        if gone:
            log(WARNING, "FedCat: nodes %s disconnected and leave their groups", gone)
            self._groups = [[node for node in group if node in alive] for group in self._groups]
        if len(nodes) >= self._k:
            return arrays
        log(WARNING, "FedCat: only %s nodes remain for K=%s; K shrinks to %s", len(nodes), self._k, len(nodes))
        # The open cycle is closed early so the copies' training reaches the global model.
        cycle_open = self.concat and self._round_index % self._k != 0
        self._folded = self._average_copies(server_round, close_cycle=True) if cycle_open else None
        self._k = len(nodes)
        self._round_index = 0
        self._counts = CountTable(self._k)
        self._groups = []
        return arrays if self._folded is None else self._folded

    def _update_groups(self, nodes: list[int], k: int) -> None:
        """Redraw the groups at a grouping point, or at once when a group has no node left."""
        if is_grouping_round(self._round_index, k, self.group_cycles):
            reason = "grouping point"
        elif any(not group for group in self._groups):
            reason = "a group lost all its nodes"
        else:
            return
        self._groups = make_groups(nodes, k, self.rng)
        log(INFO, "FedCat: new groups (%s): %s", reason, self._groups)
        self.record("groups", [list(group) for group in self._groups])

    def _average_copies(self, server_round: int, close_cycle: bool) -> ArrayRecord | None:
        """Σ d_i·m_i / Σ d_i, or None when no copy has trained yet. A model that closes the
        cycle (`close_cycle`) gets FedDyn's server step over the trained copies (with FedDyn)
        and the divergence check (recorded as ``divergence``)."""
        if self._data_sizes.sum() <= 0:
            return None
        averaged = weighted_average(self._copies, [float(d) for d in self._data_sizes])
        assert self._cycle_start is not None
        if not close_cycle:
            self.chain.check_last(self._cycle_start, averaged, self.evaluate_on_server(server_round))
            return averaged
        trained = [(copy, float(size)) for copy, size in zip(self._copies, self._data_sizes) if size > 0]
        if self.feddyn is not None:
            averaged = self.feddyn.step(self._cycle_start, [copy for copy, _ in trained], averaged, len(self._copies))
            self.record("feddyn_h_norm", self.feddyn.h_norm)
        last = server_round == self.last_round
        self.record(
            "divergence",
            self.chain.check(
                self._cycle_start,
                [copy for copy, _ in trained],
                [size for _, size in trained],
                averaged,
                self.evaluate_on_server(server_round),
                last=last,
                first_hops_accuracy=self._witness.first_hops_accuracy,
            ),
        )
        if self.feddyn is None:  # FedDyn's corrected average is no plain average to compare
            if compared := self._witness.compare(server_round, averaged, self.evaluate_on_server(server_round), last):
                self.record("witness", compared)
        return averaged


def _fraction(config: RunConfig) -> float:
    """The share of devices per round: fraction-train, except its default 1.0 (every node, so
    K = N), which FedCat replaces by the paper's 10 % when fedcat-k does not set K."""
    if config.fedcat_k == 0 and config.fraction_train == 1.0:
        log(INFO, "FedCat: fraction-train=1.0 would make K = N; K is %s of the nodes (the paper's)", PAPER_FRACTION)
        return PAPER_FRACTION
    return config.fraction_train


def build(config: RunConfig, env: ServerEnv) -> FedCat:
    """FedCat (or one of its ablations) from the run config."""
    return FedCat(
        k=config.fedcat_k,
        fraction_train=_fraction(config),
        group_cycles=config.fedcat_lambda,
        epsilon=config.fedcat_epsilon,
        selection=config.fedcat_selection,
        concat=config.fedcat_concat,
        feddyn=feddyn_from_config(config, env),
        hop_step=parse_hop_step(config.fedcat_hop_step),
        hop_clip=config.fedcat_hop_clip,
        fraction_evaluate=config.fraction_evaluate,
        round_timeout=config.timeout,
        seed=config.seed,
        update_clip=config.update_clip,
        weight_clip=config.weight_clip,
        history_check=config.checks_update_history,
    )

