"""FedSeq / FedSeqInter against a FakeGrid: stage 1, chain order, weights, slots, faults, state."""

from __future__ import annotations

import inspect
import json
import logging
import math
import pickle
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from concatfl.config import RunConfig
from concatfl.core.sequential import STALL_AGGREGATIONS
from concatfl.core import superclients as sc
from concatfl.runtime import ServerEnv
from concatfl.strategies.common import message_bytes
from concatfl.strategies.fedseq import FedSeq, FedSeqInter, build
from tests.fakes import BIG_IDS, FakeGrid, reply_with

NUM_CLASSES = 4
PRETRAIN_EPOCHS = 3
POOL = (torch.rand(40, 1, 2, 2, generator=torch.Generator().manual_seed(0)), torch.arange(40) % NUM_CLASSES)

State = dict[str, np.ndarray]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(4, NUM_CLASSES))


def initial_arrays() -> ArrayRecord:
    torch.manual_seed(0)
    return ArrayRecord(make_model().state_dict())


def as_state(arrays: ArrayRecord) -> State:
    return {key: array.numpy().copy() for key, array in arrays.items()}


def as_arrays(state: State) -> ArrayRecord:
    return ArrayRecord({key: Array(np.ascontiguousarray(value)) for key, value in state.items()})


def same(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


class Client:
    """A fake node holding one class.

    Pre-training (server-round 0) returns a model that predicts the node's class for every
    input; training adds the node id to every weight, so each hop's effect is known exactly.
    `failure(message)` may name how a stage-2 reply goes wrong: `silent` (none), `nan` (NaN
    weights), `shape` (a wrong shape) or `reversed` (the update sign-flipped); `returned` then
    holds None for that visit.
    """

    def __init__(self, node: int, label: int, num_examples: int = 10) -> None:
        self.node, self.label, self.num_examples = node, label, num_examples
        self.failure: Callable[[Message], str | None] = lambda message: None
        self.received: list[tuple[int, State]] = []
        self.returned: dict[int, list[State | None]] = defaultdict(list)
        self.configs: list[dict] = []

    def __call__(self, message: Message) -> Message | None:
        if message.metadata.message_type == "query":
            counts = [0] * NUM_CLASSES
            counts[self.label] = self.num_examples
            return reply_with(message, RecordDict({"metrics": MetricRecord({"label-counts": counts})}))
        config = dict(message.content.config_records["config"])
        state = as_state(message.content.array_records["arrays"])
        server_round = int(config["server-round"])
        self.configs.append(config)
        if server_round == 0:
            state["1.weight"][:] = 0.0
            state["1.bias"][:] = 0.0
            state["1.bias"][self.label] = 20.0
        else:
            self.received.append((server_round, state))
            state = {key: value + self.node for key, value in state.items()}
            failure = self.failure(message)
            self.returned[server_round].append(None if failure else state)
            if failure == "silent":
                return None
            if failure == "nan":
                state["1.bias"][0] = np.nan
            if failure == "shape":
                state["1.bias"] = np.zeros(NUM_CLASSES + 1, dtype=np.float32)
            if failure == "reversed":  # well-formed, of ordinary length, the other way
                state = {key: value - 2 * self.node for key, value in state.items()}
        metrics = MetricRecord({"num-examples": self.num_examples, "train-loss": 1.0})
        return reply_with(message, RecordDict({"arrays": as_arrays(state), "metrics": metrics}))


def clients_for(num: int = 8, sizes: list[int] | None = None) -> dict[int, Client]:
    """Nodes 1..num, node k holds class (k-1) mod 4."""
    return {k: Client(k, (k - 1) % NUM_CLASSES, sizes[k - 1] if sizes else 10) for k in range(1, num + 1)}


def strategy(cls: type[FedSeq] = FedSeq, **kwargs) -> FedSeq:
    # The paper's algorithm (every reply taken as it is, no reply bounds), whose chains these tests
    # follow exactly; the divergence check's extra evaluations are tested on their own.
    settings = {
        "exemplar_pool": POOL,
        "min_samples": 40,
        "pretrain_epochs": PRETRAIN_EPOCHS,
        "hop_step": 1.0,
        "hop_clip": 0.0,
        "update_clip": 0.0,
        "weight_clip": 0.0,
        "check_parts": False,
        "witness": False,
        "seed": 0,
        "round_timeout": 0.5,  # stage 1 waits this long for a silent node's reply
    }
    return cls(make_model, NUM_CLASSES, **{**settings, **kwargs})


def run(fedseq: FedSeq, clients: dict[int, Client], rounds: int, grid: FakeGrid | None = None,
        start: ArrayRecord | None = None):
    """Run `rounds` rounds; returns the grid and the global model after each round (0 = start)."""
    grid = grid or FakeGrid(clients)
    models: dict[int, State] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord):
        models[server_round] = as_state(arrays)
        return MetricRecord({"accuracy": 0.0})

    result = fedseq.start(grid, start or initial_arrays(), num_rounds=rounds,
                          train_config=ConfigRecord({"lr": 0.1}), evaluate_fn=evaluate_fn)
    return grid, models, result


def walk_chain(order: list[int], start: State, clients: dict[int, Client], server_round: int,
               seen: Counter) -> State:
    """Follow one superclient's chain: each client got exactly the model its predecessor returned."""
    model = start
    for node in order:
        visit = seen[(node, server_round)]
        seen[(node, server_round)] += 1
        received = [s for r, s in clients[node].received if r == server_round]
        assert same(received[visit], model), f"node {node} did not get its predecessor's model"
        returned = clients[node].returned[server_round][visit]
        if returned is not None:
            model = returned
    return model


def expected_average(models: list[State], weights: list[float]) -> State:
    total = sum(weights)
    return {k: sum(w * m[k].astype(np.float64) for m, w in zip(models, weights)) / total for k in models[0]}


def close(a: State, b: State) -> bool:
    return all(np.allclose(a[k], b[k], atol=1e-4) for k in a)


# ---------------------------------------------------------------------- stage 1
def test_setup_pretrains_every_node_and_builds_full_class_superclients():
    clients = clients_for(8)
    fedseq = strategy()
    grid, _, _ = run(fedseq, clients, 1)
    pretraining = grid.hops[0]
    assert sorted(m.metadata.dst_node_id for m in pretraining) == list(range(1, 9))
    for message in pretraining:
        config = message.content.config_records["config"]
        assert config["local-epochs"] == PRETRAIN_EPOCHS and config["proximal-mu"] == 0.0
        assert config["lr"] == 0.1
    record = fedseq.setup_record
    assert record["num_superclients"] == 2 and record["exemplars"] == 40
    for entry in record["superclients"]:
        labels = sorted(clients[n].label for n in entry["nodes"])
        assert labels == [0, 1, 2, 3]  # greedy + KL on confidence vectors: one client per class
        assert entry["samples"] == 40 and entry["estimated"]["covered_classes"] == 4
        assert entry["estimated"]["balance_ratio"] > 0.99
    assert record["mean_balance_ratio_estimated"] > 0.99


def test_stage1_describes_each_pretrained_model_as_it_arrives_and_keeps_none():
    # 10,000 clients' models at once would not fit in memory: the pre-training hop keeps only
    # its replies' metrics, and the grouping is the one of the test above.
    clients = clients_for(8)
    fedseq = strategy()
    fedseq.setup(FakeGrid(clients), initial_arrays(), ConfigRecord({"lr": 0.1}))
    pretraining = fedseq._round_hops[0]
    assert [reply.node_id for reply in pretraining.replies] == list(range(1, 9))
    assert all(not reply.content.array_records and not reply.decoded for reply in pretraining.replies)
    assert [reply.metrics["num-examples"] for reply in pretraining.replies] == [10] * 8
    assert [sorted(clients[n].label for n in members) for members in fedseq.plan.values()] == [[0, 1, 2, 3]] * 2


def test_true_label_counts_are_queried_only_when_asked():
    clients = clients_for(8)
    fedseq = strategy(report_label_counts=True)
    grid, _, _ = run(fedseq, clients, 1)
    assert all(m.metadata.message_type == "query" for m in grid.hops[1])
    for entry in fedseq.setup_record["superclients"]:
        assert entry["true"] == {"balance_ratio": 1.0, "covered_classes": 4, "classes": [0, 1, 2, 3]}
    assert fedseq.setup_record["label_counts_missing"] == []
    assert fedseq.setup_record["mean_balance_ratio_true"] == 1.0
    query_bytes = sum(message_bytes(m) for m in grid.hops[1])
    assert fedseq.setup_record["bytes_sent"] == fedseq.setup_record["pretraining"]["bytes_sent"] + query_bytes
    silent = clients_for(8)
    quiet = {k: (lambda m, c=c: None if m.metadata.message_type == "query" else c(m)) for k, c in silent.items()}
    unanswered = strategy(report_label_counts=True)
    run(unanswered, silent, 1, grid=FakeGrid(quiet))
    assert unanswered.setup_record["label_counts_missing"] == list(range(1, 9))
    assert "true" not in unanswered.setup_record["superclients"][0]
    plain = strategy()
    grid, _, _ = run(plain, clients_for(8), 1)
    assert all(m.metadata.message_type == "train" for hop in grid.hops for m in hop)


def test_a_node_missing_at_pretraining_is_asked_again_then_joins_the_smallest_superclient():
    clients = clients_for(9)
    grid = FakeGrid({**clients, 3: lambda message: None})
    fedseq = strategy()
    fedseq.setup(grid, initial_arrays(), ConfigRecord())
    assert fedseq.setup_record["left_out"] == [3] and 3 not in fedseq.membership.places
    fedseq._place_start(grid)
    assert [m.metadata.dst_node_id for m in grid.hops[-1]] == [3]  # stage 1 asks it once more
    # Silent again, its data still trains: it joins the superclient that held the fewest samples, counted as a median client.
    (placed,) = fedseq.setup_record["placements"]
    assert placed["node"] == 3 and placed["why"] == "no usable stage-1 reply, asked again"
    sid = placed["where"]["superclient"]
    samples = {s: sum(clients[n].num_examples for n in members if n != 3) for s, members in fedseq.plan.items()}
    assert samples[sid] == min(samples.values()) and 3 in fedseq.plan[sid]
    assert fedseq.client_samples[3] == 10
    assert sorted(n for nodes in fedseq.plan.values() for n in nodes) == list(range(1, 10))


def test_a_node_whose_pretraining_reply_was_lost_once_joins_the_superclient_its_second_one_fits():
    clients = {**clients_for(8), 9: Client(9, 0, 25)}
    lost = [True]  # its first pre-training reply is lost on the way

    def lossy(message: Message):
        return None if lost and lost.pop() else clients[9](message)

    grid = FakeGrid({**clients, 9: lossy})
    fedseq = strategy()
    fedseq.setup(grid, initial_arrays(), ConfigRecord())
    fedseq._place_start(grid)
    (placed,) = fedseq.setup_record["placements"]
    assert placed["why"] == "no usable stage-1 reply, asked again"
    # Its second reply was taken: it counts with its own 25 samples (a node placed without a
    # pre-trained model counts as the median client, 10) and its approximation joined the estimate.
    sid = placed["where"]["superclient"]
    assert 9 in fedseq.plan[sid] and fedseq.client_samples[9] == 25
    np.testing.assert_allclose(fedseq.estimates[sid].sum(), 40 + 25, rtol=1e-6)


def test_clf_approximator_reduces_the_fc_weights_with_pca():
    fedseq = strategy(approximator="clf", metric="cosine", clf_layers="last")
    run(fedseq, clients_for(8), 1)
    record = fedseq.setup_record
    assert record["clf_layers"] == ["1"]
    assert record["pca_explained_variance"] >= 0.9 and 1 <= record["pca_components"] <= 7
    assert "estimated" not in record["superclients"][0]
    assert sorted(n for e in record["superclients"] for n in e["nodes"]) == list(range(1, 9))


def test_without_server_data_the_default_approximator_reads_the_classifier_weights():
    fedseq = FedSeq(make_model, NUM_CLASSES, min_samples=40, pretrain_epochs=PRETRAIN_EPOCHS)
    assert (fedseq.approximator, fedseq.metric) == ("clf", "cosine")
    run(fedseq, clients_for(8), 1)
    record = fedseq.setup_record
    assert record["approximator"] == "clf" and "exemplars" not in record
    assert sorted(n for e in record["superclients"] for n in e["nodes"]) == list(range(1, 9))
    assert (strategy().approximator, strategy().metric) == ("conf", "kl")  # with a pool: the paper's best


class EpochCountingClient(Client):
    """A client that reports the epochs it trained: its own count (`own_epochs`) or, when None,
    the ``config["local-epochs"]`` it was sent."""

    def __init__(self, node: int, label: int, own_epochs: int | None) -> None:
        super().__init__(node, label)
        self.own_epochs = own_epochs

    def __call__(self, message: Message) -> Message | None:
        reply = super().__call__(message)
        epochs = self.own_epochs if self.own_epochs is not None else self.configs[-1]["local-epochs"]
        reply.content.metric_records["metrics"]["local-epochs"] = epochs
        return reply


def test_pretraining_records_the_reported_epochs_and_warns_when_they_differ(caplog):
    clients = {k: EpochCountingClient(k, (k - 1) % NUM_CLASSES, 1 if k in (2, 5) else None) for k in range(1, 8)}
    clients[8] = Client(8, 3)  # reports nothing
    fedseq = strategy()
    with caplog.at_level("WARNING"):
        fedseq.setup(FakeGrid(clients), initial_arrays(), ConfigRecord({"local-epochs": 1}))
    record = fedseq.setup_record
    assert record["pretrain_epochs"] == PRETRAIN_EPOCHS
    assert record["pretrain_epochs_reported"] == {k: 1 if k in (2, 5) else PRETRAIN_EPOCHS for k in range(1, 8)}
    assert record["pretrain_epochs_differ"] == [2, 5]
    assert "nodes [2, 5] report [1, 1]" in caplog.text
    assert json.loads(json.dumps(record, default=str))["pretrain_epochs_differ"] == [2, 5]


def test_bad_combinations_are_rejected_before_training():
    with pytest.raises(ValueError, match="needs approximator 'conf'"):
        strategy(approximator="clf", metric="kl")
    strategy(approximator="clf", metric="kl", grouping="kmeans")  # kmeans uses no metric
    with pytest.raises(ValueError, match="exemplar_pool"):
        FedSeq(make_model, NUM_CLASSES, approximator="conf")
    with pytest.raises(ValueError, match="grouping"):
        strategy(grouping="spectral")


def test_exemplars_are_excluded_from_the_evaluation_set():
    config = RunConfig.from_mapping({"strategy": "fedseq", "dataset": "digits", "fedseq-exemplars-per-class": 7})
    env = ServerEnv.from_config(config)
    full = len(env.data.y_test)
    fedseq = build(config, env)
    exemplars = fedseq.state_dict()["exemplars"]
    assert np.bincount(env.data.y_test[exemplars].numpy()).tolist() == [7] * 10
    keep = np.setdiff1d(np.arange(full), exemplars)
    assert len(env.eval_y) == full - 70
    assert torch.equal(env.eval_x, env.data.x_test[keep]) and torch.equal(env.eval_y, env.data.y_test[keep])
    # A resumed run on a fresh environment removes the same exemplars again.
    fresh = ServerEnv.from_config(config)
    resumed = build(RunConfig.from_mapping({"strategy": "fedseq", "dataset": "digits", "seed": 5}), fresh)
    resumed.load_state_dict(fedseq.state_dict())
    assert torch.equal(fresh.eval_y, env.eval_y)


# ---------------------------------------------------------------------- stage 2
@pytest.mark.parametrize("superclient_epochs", [1, 2])
def test_each_client_receives_its_predecessors_model_and_the_average_is_weighted(superclient_epochs):
    sizes = [10, 20, 30, 40, 15, 25, 35, 45]
    clients = clients_for(8, sizes)
    fedseq = strategy(superclient_epochs=superclient_epochs, min_samples=60)
    _, models, _ = run(fedseq, clients, 2)
    for record in fedseq.history:
        server_round, seen = record["round"], Counter()
        ends, weights = [], []
        for entry in record["superclients"]:
            chain = entry["order"] * superclient_epochs
            ends.append(walk_chain(chain, models[server_round - 1], clients, server_round, seen))
            weights.append(sum(sizes[n - 1] for n in entry["order"]))
            assert entry["samples"] == weights[-1]
        # Every member of every superclient trained, each exactly E_S times.
        visited = sorted(n for e in record["superclients"] for n in e["order"])
        assert visited == list(range(1, 9))
        assert all(seen[(n, server_round)] == superclient_epochs for n in visited)
        assert len(record["hops"]) == superclient_epochs * max(len(e["order"]) for e in record["superclients"])
        assert close(models[server_round], expected_average(ends, weights))
    for client in clients.values():  # each visit says which pass of the chain it is
        passes = [int(c["chain-pass"]) for c in client.configs if int(c["server-round"]) == 1]
        assert passes == list(range(superclient_epochs))


def test_hops_record_bytes_seconds_and_superclient_orders():
    fedseq = strategy(min_samples=30)  # 3 + 3 + 2 clients: the 20-sample leftover is absorbed
    run(fedseq, clients_for(8), 1)
    record = fedseq.history[0]
    orders = [e["order"] for e in record["superclients"]]
    assert sorted(len(o) for o in orders) == [4, 4]
    for position, hop in enumerate(record["hops"]):
        assert hop["sent"] == sum(1 for o in orders if position < len(o))
        assert hop["bytes_sent"] > 0 and hop["bytes_received"] > 0 and hop["seconds"] >= 0
    assert record["bytes_sent"] == sum(h["bytes_sent"] for h in record["hops"])


def test_fraction_train_samples_superclients_and_proximal_mu_reaches_every_client():
    clients = clients_for(8)
    fedseq = strategy(min_samples=20, fraction_train=0.5, proximal_mu=0.3)  # 4 superclients, 2 per round
    run(fedseq, clients, 3)
    for record in fedseq.history:
        assert len(record["superclients"]) == 2
    stage2 = [c for client in clients.values() for c in client.configs if c["server-round"] > 0]
    assert stage2 and all(c["proximal-mu"] == 0.3 and "local-epochs" not in c for c in stage2)


@pytest.mark.parametrize("mode", ["silent", "nan", "shape"])
def test_a_failing_middle_client_is_skipped_without_losing_the_model_and_one_that_answered_gets_a_last_turn(mode):
    clients = clients_for(8)
    grid = FakeGrid(clients)
    fedseq = strategy()
    # Hops so far: pre-training, then hops 0, 1, … of round 1. The member of superclient 0
    # served at hop 1 (the second of its four) fails.
    for client in clients.values():
        client.failure = lambda message, node=client.node: (
            mode if len(grid.hops) == 3 and node in fedseq.superclients[0] else None
        )
    _, models, _ = run(fedseq, clients, 1, grid=grid)
    record = fedseq.history[0]
    entry = next(e for e in record["superclients"] if e["id"] == 0)
    failing = entry["order"][1]
    misses = [m for hop in record["hops"] for m in hop["misses"]]
    assert [m["node"] for m in misses] == [failing]
    # The next client got exactly the model the failing one was given.
    assert same(clients[entry["order"][2]].received[0][1], clients[failing].received[0][1])
    # A reply that came but was rejected: the client gets one more turn after the chain's last
    # (which it uses); a silent one does not (a second wait for a node that is gone).
    answered = mode != "silent"
    assert entry["missed"] == [failing] and entry["retried"] == ([failing] if answered else [])
    assert entry["trained_hops"] == (4 if answered else 3) and len(record["hops"]) == (5 if answered else 4)
    ends = [walk_chain(e["order"] + e["retried"], models[0], clients, 1, Counter()) for e in record["superclients"]]
    assert close(models[1], expected_average(ends, [e["samples"] for e in record["superclients"]]))
    assert all(np.isfinite(v).all() for v in models[1].values())


def test_a_reversed_hop_is_rejected_by_the_history_check_and_skipped_then_retried_like_a_rejected_one():
    clients = clients_for(8)
    grid = FakeGrid(clients)
    fedseq = strategy(update_clip=100.0)  # the bounds on (so is the history check), too wide to clip a hop
    # Hops: pre-training, round 1's four (every node's first update: its witness), then round 2's.
    # The member of superclient 0 served at round 2's hop 1 sends its update reversed.
    for client in clients.values():
        client.failure = lambda message, node=client.node: (
            "reversed" if len(grid.hops) == 7 and node in fedseq.superclients[0] else None
        )
    _, models, _ = run(fedseq, clients, 2, grid=grid)
    record = fedseq.history[1]
    entry = next(e for e in record["superclients"] if e["id"] == 0)
    failing = entry["order"][1]
    assert entry["missed"] == [failing] and entry["retried"] == [failing] and entry["trained_hops"] == 4
    (miss,) = [m for hop in record["hops"] for m in hop["misses"]]
    assert miss["node"] == failing and "update reversed against its node's own earlier ones" in miss["reason"]
    assert "cosine -1.00 with its last update taken" in miss["reason"]
    # The next client got exactly the model the reversed one was given, and the round's model is
    # the average of the chains without that hop, the reversed client's last turn (honest) at the end.
    assert same(clients[entry["order"][2]].received[1][1], clients[failing].received[1][1])
    ends = [walk_chain(e["order"] + e["retried"], models[1], clients, 2, Counter()) for e in record["superclients"]]
    assert close(models[2], expected_average(ends, [e["samples"] for e in record["superclients"]]))
    assert fedseq.history[0]["hops"] and not [m for hop in fedseq.history[0]["hops"] for m in hop["misses"]]


def test_a_superclient_without_any_successful_hop_contributes_nothing():
    clients = clients_for(8)
    fedseq = strategy()
    for client in clients.values():
        client.failure = lambda message, node=client.node: "silent" if node in fedseq.superclients[0] else None
    _, models, _ = run(fedseq, clients, 1)
    entries = {e["id"]: e for e in fedseq.history[0]["superclients"]}
    assert entries[0]["trained_hops"] == 0 and len(entries[0]["missed"]) == 4
    only = walk_chain(entries[1]["order"], models[0], clients, 1, Counter())
    assert close(models[1], only)


def test_a_node_that_lets_its_hops_time_out_rests_while_its_superclient_trains_on():
    clients = clients_for(8)
    hung = 3
    clients[hung].failure = lambda message: "silent"
    fedseq = strategy()
    run(fedseq, clients, 5)
    # Silent in rounds 1 and 2: it rests in round 3; silent in 4: it rests in 5 (and 6).
    assert [server_round for server_round, _ in clients[hung].received] == [1, 2, 4]
    sid = next(sid for sid, members in fedseq.plan.items() if hung in members)
    for record in fedseq.history:
        entry = next(e for e in record["superclients"] if e["id"] == sid)
        assert entry["trained_hops"] == 3  # its other members train every round
        assert (hung in entry["order"]) == (record["round"] in (1, 2, 4))
    assert [record["membership"].get("resting") for record in fedseq.history] == [None, None, [hung], None, [hung]]


def test_vanished_nodes_are_dropped_and_rejoin_their_superclient_when_back():
    clients = clients_for(8)
    grid = FakeGrid(clients)
    fedseq = strategy()
    run(fedseq, clients, 1, grid=grid)
    plan = {sid: list(members) for sid, members in fedseq.superclients.items()}
    gone_one = plan[0][0]
    del grid.handlers[gone_one]
    for node in plan[1]:
        del grid.handlers[node]
    sent_before = len(grid.sent)
    run(fedseq, clients, 2, grid=grid)
    assert list(fedseq.superclients) == [0] and fedseq.superclients[0] == plan[0][1:]
    assert {m.metadata.dst_node_id for m in grid.sent[sent_before:]} == set(fedseq.superclients[0])
    assert fedseq.history[1]["superclients"][0]["samples"] == 30
    grid.handlers.update(clients)  # all of them reconnect
    sent_before = len(grid.sent)
    run(fedseq, clients, 3, grid=grid)
    assert fedseq.superclients == plan
    assert {m.metadata.dst_node_id for m in grid.sent[sent_before:]} == set(clients)
    assert fedseq.history[2]["superclients"][0]["samples"] == 40


def test_a_node_that_joins_later_pretrains_the_initial_model_and_trains_in_the_superclient_it_fits():
    clients = clients_for(8)
    late = Client(9, 3)
    grid = FakeGrid(clients, arrivals={9: (1, late)})
    fedseq = strategy()
    run(fedseq, clients, 1, grid=grid)
    before = {sid: estimate.copy() for sid, estimate in fedseq.estimates.items()}
    members = {sid: len(nodes) for sid, nodes in fedseq.plan.items()}
    samples = {sid: 10 * len(nodes) for sid, nodes in fedseq.plan.items()}
    run(fedseq, clients, 2, grid=grid)
    record = fedseq.history[1]
    assert record["membership"]["joined"] == [9] and record["membership"]["connected"] == 9
    (placed,) = record["placements"]
    # Pre-trained exactly as stage 1 had every node do: the initial model, server-round 0, its epochs.
    (pretrain,) = [m for m in grid.sent if m.metadata.dst_node_id == 9 and m.content["config"]["server-round"] == 0]
    assert same(as_state(pretrain.content["arrays"]), as_state(initial_arrays()))
    assert pretrain.content["config"]["local-epochs"] == PRETRAIN_EPOCHS
    # It joins the superclient the placement rule picks for its approximation (its class, 3).
    vector = np.eye(NUM_CLASSES)[3]
    expected = sc.fitting_superclient(vector, before, samples, members, fedseq.metric, fedseq.max_clients)
    assert placed == {"node": 9, "where": {"superclient": expected}, "why": "joined after the start"}
    assert 9 in fedseq.plan[expected] and fedseq.client_samples[9] == 10
    # ... and trains in the round it joined: its superclient's chain went through it.
    (entry,) = [e for e in record["superclients"] if e["id"] == expected]
    assert 9 in entry["order"] and late.received and late.received[-1][0] == 2
    assert record["membership"]["trained"] == 9  # the pre-training hop is not counted as training


def test_a_joining_node_whose_pretraining_fails_still_joins_the_smallest_superclient():
    clients = clients_for(8)
    grid = FakeGrid(clients, arrivals={9: (1, lambda message: None)})
    fedseq = strategy()
    run(fedseq, clients, 2, grid=grid)
    (placed,) = fedseq.history[1]["placements"]
    assert placed["node"] == 9 and 9 in fedseq.plan[placed["where"]["superclient"]]
    assert fedseq.client_samples[9] == 10  # the median client's count


# ---------------------------------------------------------------------- FedSeqInter
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_fedseq_inter_averages_the_slots_every_n_s_rounds(fraction):
    sizes = [10, 20, 30, 40, 15, 25, 35, 45]
    clients = clients_for(8, sizes)
    fedseq = strategy(FedSeqInter, fraction_train=fraction, min_samples=100)
    _, models, _ = run(fedseq, clients, 4)
    n_s = fedseq.setup_record["num_superclients"]
    assert n_s == 2 and fedseq.setup_record["slots"] == (2 if fraction == 1.0 else 1)
    slots = [models[0]] * fedseq.setup_record["slots"]
    counters = [0.0] * len(slots)
    for record in fedseq.history:
        server_round, seen = record["round"], Counter()
        for entry in record["superclients"]:
            slot = entry["slot"]
            slots[slot] = walk_chain(entry["order"], slots[slot], clients, server_round, seen)
            counters[slot] += entry["samples"]
        assert record["slots"]["samples"] == counters
        filled = [i for i, c in enumerate(counters) if c > 0]
        average = expected_average([slots[i] for i in filled], [counters[i] for i in filled])
        assert close(models[server_round], average)
        aggregated = server_round % n_s == 0
        assert record["slots"]["aggregated"] == aggregated
        if aggregated:
            slots, counters = [models[server_round]] * len(slots), [0.0] * len(slots)
    assert [r["slots"]["aggregated"] for r in fedseq.history] == [False, True, False, True]



@pytest.mark.parametrize("rounds, warned", [(8, True), (16, False)])
def test_fedseq_inter_warns_before_round_1_where_its_slots_are_averaged_too_rarely(caplog, rounds, warned):
    fedseq = strategy(FedSeqInter, min_samples=20)  # 8 clients of 10 samples: 4 superclients
    with caplog.at_level(logging.WARNING):
        run(fedseq, clients_for(8), rounds)
    told = [r.getMessage() for r in caplog.records if "the slots (one per superclient) are averaged" in r.getMessage()]
    assert told == (["FedSeqInter: " + sc.slots_judged_late(4, rounds)] if warned else [])
    assert len(fedseq.superclients) == 4


@pytest.mark.parametrize("min_samples, warned", [(10, True), (100, False)])
def test_fedseq_inter_warns_before_round_1_where_its_superclients_are_single_clients(caplog, min_samples, warned):
    fedseq = strategy(FedSeqInter, min_samples=min_samples)  # every client holds 10 samples
    with caplog.at_level(logging.WARNING):
        run(fedseq, clients_for(8), 1)
    told = [r.getMessage() for r in caplog.records if "superclients are single clients" in r.getMessage()]
    assert told == (["FedSeqInter: " + sc.single_client_relay([[k] for k in range(8)], 10)] if warned else [])


# ---------------------------------------------------------------------- state
@pytest.mark.parametrize("cls", [FedSeq, FedSeqInter])
def test_state_save_and_restore_continues_the_run_exactly(cls):
    sizes = [10, 20, 30, 40, 15, 25, 35, 45]
    straight = strategy(cls, min_samples=60, fraction_train=0.5)
    _, straight_models, _ = run(straight, clients_for(8, sizes), 4)

    first = strategy(cls, min_samples=60, fraction_train=0.5)
    _, _, half = run(first, clients_for(8, sizes), 2)
    saved = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = strategy(cls, min_samples=60, fraction_train=0.5, seed=99)
    resumed.load_state_dict(saved)
    _, resumed_models, _ = run(resumed, clients_for(8, sizes), 4, start=half.arrays)
    assert resumed.superclients == straight.superclients
    assert resumed.setup_record["superclients"] == straight.setup_record["superclients"]
    for server_round in (3, 4):
        assert same(resumed_models[server_round], straight_models[server_round])
    assert [r["superclients"] for r in resumed.history] == [r["superclients"] for r in straight.history]


# ---------------------------------------------------------------------- any ClientApp
def test_fedseq_runs_against_a_plain_clientapp():
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        state = as_state(message.content.array_records["arrays"])
        label = context.node_id % NUM_CLASSES
        state["1.bias"][label] += 1.0  # "learning" its own class
        metrics = MetricRecord({"num-examples": 10, "train-loss": 0.5})
        return Message(RecordDict({"arrays": as_arrays(state), "metrics": metrics}), reply_to=message)

    def node(node_id: int):
        context = Context(run_id=1, node_id=node_id, node_config={}, state=RecordDict(), run_config={})
        return lambda message: app(message, context)

    grid = FakeGrid({node_id: node(node_id) for node_id in range(1, 9)})
    fedseq = strategy()
    result = fedseq.start(grid, initial_arrays(), num_rounds=2)
    assert fedseq.setup_record["num_superclients"] == 2
    assert all(r["aggregated"] and not any(h["misses"] for h in r["hops"]) for r in fedseq.history)
    bias = result.arrays["1.bias"].numpy() - initial_arrays()["1.bias"].numpy()
    assert np.allclose(bias, 2.0, atol=1e-5)  # each round every class's bias grows by 1 in each chain


# ---------------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_end_to_end_on_digits(tmp_path: Path):
    from tests.e2e import run_in_process

    metrics = run_in_process(
        tmp_path,
        {
            "strategy": "fedseq",
            "dataset": "digits",
            "partition": "dirichlet",
            "alpha": 0.0,
            "num-server-rounds": 2,
            "fedseq-pretrain-epochs": 1,
            "fedseq-min-samples": 45,
            "report-label-counts": False,
        },
        num_supernodes=6,
    )
    setup = metrics["setup"]
    assert setup["num_superclients"] >= 2 and setup["bytes_sent"] > 0
    assert sum(e["clients"] for e in setup["superclients"]) == 6
    assert len(metrics["rounds"]) == 2 and all(r["hops"] for r in metrics["rounds"])
    assert 0.0 <= metrics["final_accuracy"] <= 1.0


def test_chains_reach_nodes_with_64_bit_ids():
    """Flower's node ids exceed 2**63; shuffling a chain through numpy would turn them into floats."""
    clients = {node: Client(index + 1, index % NUM_CLASSES) for index, node in enumerate(BIG_IDS[:8])}
    fedseq = strategy()
    grid, _, _ = run(fedseq, clients, rounds=2)
    assert {message.metadata.dst_node_id for message in grid.sent} == set(clients)
    assert all(not hop["misses"] for record in fedseq.history for hop in record["hops"])


def test_a_superclient_of_one_client_is_a_fedavg_client_its_hop_taken_whole():
    clients = clients_for(4, [10, 20, 30, 40])
    fedseq = strategy(min_samples=1, hop_step=0.25)  # every client a superclient of its own
    _, models, _ = run(fedseq, clients, 1)
    start = as_state(initial_arrays())
    expected = {key: sum((n / 100) * (start[key] + node) for node, n in zip(range(1, 5), [10, 20, 30, 40])) for key in start}
    assert close(models[1], expected)


def test_a_hop_of_a_short_chain_counts_at_least_its_clients_share_of_the_superclients_data():
    clients = clients_for(2, [10, 30])
    fedseq = strategy(min_samples=40, hop_step=0.25)  # one superclient of both: 10 + 30 examples
    _, models, _ = run(fedseq, clients, 1)
    start = as_state(initial_arrays())
    # Node 1 (10 of 40) moves the chain by η = 0.25 of its +1, node 2 (30 of 40) by 0.75 of its +2.
    assert close(models[1], {key: start[key] + 0.25 * 1 + 0.75 * 2 for key in start})


def test_fedseqs_default_step_is_sized_at_the_first_aggregation_from_its_hops():
    clients = clients_for(2, [10, 30])
    default = inspect.signature(FedSeq).parameters["hop_step"].default
    assert default == "sized"
    fedseq = strategy(min_samples=40, hop_step=default)
    _, models, _ = run(fedseq, clients, 2)
    start = as_state(initial_arrays())
    size = sum(value.size for value in start.values())
    norm = float(np.sqrt(sum(np.sum(value.astype(np.float64) ** 2) for value in start.values())))
    # Hops of length 1·√size and 2·√size (every weight + node): far longer than 0.15 of the model.
    rule = fedseq.history[0]["divergence"]["hop_rule"]
    assert rule == {"step": 0.25, "next_step": 0.25, "relative_hop": round(1.5 * np.sqrt(size) / norm, 4)}
    assert close(models[2], {key: models[1][key] + 0.25 * 1 + 0.75 * 2 for key in start})  # still damped
    assert "hop_rule" not in fedseq.history[1]["divergence"]


def witness_run(caplog, rounds: int, scores: list[float]):
    """Superclients of two clients and the damped default step; the server's evaluation answers
    `scores` in turn (the start model's first)."""
    clients = clients_for(4, [10, 20, 30, 40])
    fedseq = strategy(min_samples=25, hop_step=0.25, hop_clip=1.5, witness=True)
    answers = iter(scores)

    def evaluate_fn(server_round: int, arrays: ArrayRecord):
        return MetricRecord({"accuracy": next(answers)})

    with caplog.at_level("WARNING"):
        result = fedseq.start(FakeGrid(clients), initial_arrays(), num_rounds=rounds,
                              train_config=ConfigRecord({"lr": 0.1}), evaluate_fn=evaluate_fn)
    warnings = [r.getMessage() for r in caplog.records if "first hops" in r.getMessage()]
    return fedseq, result, warnings


def test_chains_that_lose_to_their_first_hops_fedavg_round_twice_in_a_row_are_warned_about(caplog):
    # Per round: the chains' average (which is also the round's evaluation), then the first hops'.
    fedseq, result, warnings = witness_run(caplog, 2, [0.1, 0.30, 0.40, 0.35, 0.45])
    assert [record["witness"] for record in fedseq.history] == [
        {"chains_accuracy": 0.3, "first_hops_accuracy": 0.4},
        {"chains_accuracy": 0.35, "first_hops_accuracy": 0.45},
    ]
    assert result.evaluate_metrics_serverapp[2]["accuracy"] == 0.35  # the global model stays the chains'
    assert len(warnings) == 1 and "round 2" in warnings[0] and "2 comparisons in a row" in warnings[0]
    # The comparison cannot tell an over-damped chain from a diverging one: the advice names both.
    assert "a larger one where the clients' local steps are small" in warnings[0]
    assert "a smaller one where" in warnings[0]


def test_a_loss_within_the_margin_or_not_in_a_row_is_no_warning(caplog):
    _, _, warnings = witness_run(caplog, 3, [0.1, 0.30, 0.40, 0.35, 0.36, 0.40, 0.41])
    assert warnings == []


def test_a_run_that_ends_on_a_lost_comparison_is_warned_about(caplog):
    _, _, warnings = witness_run(caplog, 3, [0.1, 0.30, 0.40, 0.35, 0.36, 0.40, 0.45])
    assert len(warnings) == 1 and "round 3" in warnings[0] and "at the run's last aggregation" in warnings[0]


def test_between_comparisons_nothing_more_is_evaluated(caplog):
    fedseq, _, _ = witness_run(caplog, 6, [0.1] + [0.2] * 11)  # 1 + 2 × 5 compared rounds + 1
    assert ["witness" in record for record in fedseq.history] == [True, True, True, False, True, True]


def test_superclients_of_one_client_are_neither_scored_one_by_one_nor_compared_with_their_first_hops():
    fedseq = strategy(min_samples=1, check_parts=True, witness=True)
    _, _, _ = run(fedseq, clients_for(4), 2)
    assert all("part_accuracy" not in r["divergence"] and "witness" not in r for r in fedseq.history)


@pytest.mark.parametrize(("min_samples", "warned"), [(1, False), (40, True)])
def test_a_run_at_chance_is_the_chains_doing_only_when_there_are_chains(caplog, min_samples, warned):
    # Superclients of one client are FedAvg's clients: a run of them that stays at chance is no
    # divergence of sequential training. Chains of several clients at chance are.
    fedseq = strategy(min_samples=min_samples, check_parts=True)
    at_chance = MetricRecord({"accuracy": 0.1, "loss": math.log(10.0)})
    with caplog.at_level(logging.WARNING):
        fedseq.start(FakeGrid(clients_for(4)), initial_arrays(), num_rounds=STALL_AGGREGATIONS,
                     train_config=ConfigRecord({"lr": 0.1}), evaluate_fn=lambda _, arrays: at_chance)
    assert [r["divergence"]["diverged"] for r in fedseq.history] == [False] * (STALL_AGGREGATIONS - 1) + [warned]
    assert any("diverge" in r.getMessage() for r in caplog.records) == warned
    # Its advice says that a smaller hop_step does not damp a hop below its client's share.
    assert any("at least its client's share of its chain" in r.getMessage() for r in caplog.records) == warned
