"""FedConcat / FedConcat-ID with FakeGrid: stages, who receives what, bytes, faults, state, saving.

Six nodes: 0-2 hold only classes {0, 1}, 3-5 only classes {2, 3}. Each node runs a real Flower
ClientApp with FedConcat's handlers and an ordinary train handler (like concatfl's own).
"""

from __future__ import annotations

import math
import pickle
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from concatfl import fedconcat_client, protocol
from concatfl.config import RunConfig
from concatfl.core.concat import load_concat_model
from concatfl.data.datasets import load_dataset
from concatfl.fedconcat_client import handle_features, handle_head_training, handle_label_query
from concatfl.protocol import (
    CACHE_MISS,
    FEATURES_ACTION,
    FEATURES_MESSAGE_TYPE,
    HEAD_ACTION,
    HEAD_MESSAGE_TYPE,
    HEAD_NAME,
    LABEL_DISTRIBUTION,
    LABELS_ACTION,
    LABELS_MESSAGE_TYPE,
)
from concatfl.models import build_model
from concatfl.runtime import ClientData, ServerEnv
from concatfl.strategies import FedConcat, build_strategy
from concatfl.strategies.common import weighted_average
from concatfl.strategies.feddyn import FedDynServer, feddyn_server_update
from concatfl.training import Normalization, evaluate, train
from tests.fakes import FakeGrid, reply_with

from .e2e import run_in_process


SHAPE = (1, 4, 4)
NUM_CLASSES = 4
NORMALIZATION = Normalization((0.5,), (0.25,))
GROUPS = {0: (0, 1), 1: (0, 1), 2: (0, 1), 3: (2, 3), 4: (2, 3), 5: (2, 3)}
TRAIN_CONFIG = ConfigRecord(
    {"lr": 0.1, "local-epochs": 1, "batch-size": 16, "momentum": 0.0, "weight-decay": 0.0}
)


def make_model():
    return build_model("mlp", SHAPE, NUM_CLASSES)


def node_data(node_id: int, classes: tuple[int, int] | None = None) -> ClientData:
    """Half of each of the node's two classes (GROUPS', so a group shares one distribution); class
    c lights up pixel c, so the classes are learnable; sizes differ per node."""
    generator = torch.Generator().manual_seed(node_id)
    count = 30 + 4 * node_id
    y = torch.tensor(classes or GROUPS[node_id])[torch.arange(count) % 2]
    x = 0.3 * torch.rand(count, *SHAPE, generator=generator)
    x.view(count, -1)[torch.arange(count), y] += 0.7
    return ClientData(x, y, x[:5], y[:5], NUM_CLASSES, NORMALIZATION, None)


def ordinary_train(message: Message, context: Context, data: ClientData) -> Message:
    """What concatfl's train handler does: train the received model, return it with num-examples."""
    settings = dict(message.content["config"])
    model = make_model()
    model.load_state_dict(message.content["arrays"].to_torch_state_dict())
    loss = train(
        model,
        data.x_train,
        data.y_train,
        epochs=int(settings["local-epochs"]),
        batch_size=int(settings["batch-size"]),
        lr=float(settings["lr"]),
        normalization=data.normalization,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(int(settings["server-round"]) * 1000 + context.node_id),
    )
    metrics = MetricRecord({"num-examples": len(data.y_train), "train-loss": loss})
    return Message(
        RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=message
    )


Fault = Callable[[Message, Message], "Message | None"]


class Federation:
    """Six in-process nodes, each a ClientApp with its own persistent Context; faults injectable.

    `faults[(node, message_type)]` rewrites (or drops, returning None) that node's replies;
    a fault can look at the message's ``server-round`` to act in one round only.
    """

    def __init__(self, first_id: int = 0) -> None:
        # Node i of GROUPS gets id first_id + i (real node ids are random uint64s).
        data = {first_id + index: node_data(index) for index in GROUPS}
        self.data = data
        self.contexts = {node: self.fresh_context(node) for node in data}
        self.faults: dict[tuple[int, str], Fault] = {}
        self.feature_computations: Counter[int] = Counter()
        self.app = ClientApp()

        @self.app.query(LABELS_ACTION)
        def query(message, context):
            return handle_label_query(message, context, data[context.node_id])

        @self.app.train()
        def train_(message, context):
            return ordinary_train(message, context, data[context.node_id])

        @self.app.train(FEATURES_ACTION)
        def features(message, context):
            self.feature_computations[context.node_id] += 1
            return handle_features(message, context, data[context.node_id])

        @self.app.train(HEAD_ACTION)
        def head(message, context):
            return handle_head_training(message, context, data[context.node_id])

    @staticmethod
    def fresh_context(node: int) -> Context:
        return Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})

    def handler(self, node: int):
        def handle(message: Message):
            reply = self.app(message, self.contexts[node])
            fault = self.faults.get((node, message.metadata.message_type))
            return fault(message, reply) if fault is not None else reply

        return handle

    def grid(self, arrivals: dict[int, tuple[int, tuple[int, int]]] | None = None) -> FakeGrid:
        """The nodes as a grid; `arrivals[node] = (after_round, classes)`: a node holding those two
        classes that connects once round `after_round` has started."""
        for node, (_, classes) in (arrivals or {}).items():
            self.data[node] = node_data(node, classes)
            self.contexts[node] = self.fresh_context(node)
        late = {node: (after, self.handler(node)) for node, (after, _) in (arrivals or {}).items()}
        return FakeGrid({node: self.handler(node) for node in self.contexts if node not in late}, late)


def strategy(**kwargs) -> FedConcat:
    """The paper's FedConcat (no label check) unless told otherwise: these tests follow its stages."""
    settings = dict(
        label_check=False,
        num_clusters=2,
        encoder_rounds=2,
        classifier_rounds=2,
        model_name="mlp",
        input_shape=SHAPE,
        normalization=NORMALIZATION,
        make_model=make_model,
        seed=0,
        round_timeout=0.5,  # stage 1 waits this long for a silent node's reply
    )
    settings.update(kwargs)
    return FedConcat(**settings)


def run(fed_strategy: FedConcat, grid: FakeGrid, **kwargs):
    torch.manual_seed(0)
    return fed_strategy.start(
        grid, ArrayRecord(make_model().state_dict()), num_rounds=99, train_config=TRAIN_CONFIG, **kwargs
    )


def in_round(server_round: int, fault: Fault) -> Fault:
    """Apply `fault` only to messages of `server_round`."""
    return lambda message, reply: (
        fault(message, reply) if message.content["config"].get("server-round") == server_round else reply
    )


def drop(message, reply):
    return None


def nan_arrays(message, reply):
    arrays = reply.content["arrays"]
    poisoned = {
        key: Array(np.full(arr.shape, np.nan, dtype=arr.numpy().dtype)) for key, arr in arrays.items()
    }
    return reply_with(
        message, RecordDict({"arrays": ArrayRecord(poisoned), "metrics": reply.content["metrics"]})
    )


def wrong_shape(message, reply):
    arrays = {key: Array(arr.numpy()) for key, arr in reply.content["arrays"].items()}
    first = next(iter(arrays))
    arrays[first] = Array(np.zeros((3, 3), dtype=np.float32))
    return reply_with(
        message, RecordDict({"arrays": ArrayRecord(arrays), "metrics": reply.content["metrics"]})
    )


def hops_of(grid: FakeGrid, message_type: str) -> list[list[Message]]:
    return [hop for hop in grid.hops if hop[0].metadata.message_type == message_type]


def numpy_of(arrays: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: value.numpy().copy() for key, value in arrays.items()}


def groups(fed_strategy: FedConcat) -> set[frozenset[int]]:
    return {frozenset(fed_strategy.members(c)) for c in range(len(fed_strategy.cluster_models))}


# ---------------------------------------------------------------------- stage 1
def test_stage1_clusters_nodes_by_reported_label_distribution():
    federation = Federation()
    fed = strategy(dp_epsilon=0.0)
    grid = federation.grid()
    fed.setup(grid, ArrayRecord(make_model().state_dict()), TRAIN_CONFIG)
    query_hop = grid.hops[0]
    assert {m.metadata.message_type for m in query_hop} == {LABELS_MESSAGE_TYPE}
    assert all("arrays" not in m.content for m in query_hop)  # no model, no data leaves anything
    assert groups(fed) == {frozenset({0, 1, 2}), frozenset({3, 4, 5})}
    record = fed.setup_record
    assert record["k"] == 2 and record["variant"] == "fedconcat" and record["unreported_nodes"] == []
    for cluster in record["clusters"]:
        assert cluster["size"] == 3 and len(cluster["centre"]) == NUM_CLASSES
        first_two = sum(cluster["centre"][:2])
        assert first_two == pytest.approx(1.0) or first_two == pytest.approx(0.0)
    assert record["bytes_sent"] > 0 and record["bytes_received"] > 0


def test_stage1_missing_or_bad_distribution_twice_joins_the_cluster_nearest_the_mean():
    federation = Federation()
    federation.faults[(5, LABELS_MESSAGE_TYPE)] = drop
    bad = {"label-distribution": [float("nan")] * NUM_CLASSES}
    federation.faults[(4, LABELS_MESSAGE_TYPE)] = lambda m, r: reply_with(
        m, RecordDict({"metrics": MetricRecord(bad)})
    )
    fed = strategy()
    grid = federation.grid()
    fed.setup(grid, ArrayRecord(make_model().state_dict()), TRAIN_CONFIG)
    assert fed.setup_record["unreported_nodes"] == [4, 5] and 4 not in fed.assignment and 5 not in fed.assignment
    fed._place_start(grid)
    assert sorted(m.metadata.dst_node_id for m in grid.hops[-1]) == [4, 5]  # stage 1 asks them once more
    # Reported: 0-2 on {0,1}, 3 on {2,3}; the mean (weight 3:1) is nearest to the {0,1} cluster.
    assert groups(fed) == {frozenset({0, 1, 2, 4, 5}), frozenset({3})}
    assert set(fed.setup_record["distributions"]) == {"0", "1", "2", "3"}
    assert [(p["node"], p["where"]["by"], p["why"]) for p in fed.setup_record["placements"]] == [
        (4, "nearest to the mean", "no usable stage-1 reply, asked again"),
        (5, "nearest to the mean", "no usable stage-1 reply, asked again"),
    ]


def test_stage1_asks_a_node_whose_distribution_was_lost_once_more_and_places_it_by_its_answer():
    federation = Federation()
    lost = [True]
    federation.faults[(5, LABELS_MESSAGE_TYPE)] = lambda m, reply: None if lost and lost.pop() else reply
    fed = strategy()
    grid = federation.grid()
    fed.setup(grid, ArrayRecord(make_model().state_dict()), TRAIN_CONFIG)
    fed._place_start(grid)
    # Node 5 trains on {2, 3}: its second answer puts it with 3 and 4, not nearest the mean.
    assert groups(fed) == {frozenset({0, 1, 2}), frozenset({3, 4, 5})}
    (placed,) = fed.setup_record["placements"]
    assert placed == {"node": 5, "where": {"cluster": fed.assignment[3], "by": "reported, unchecked"},
                      "why": "no usable stage-1 reply, asked again"}


def test_empty_clusters_are_dropped():
    fed = strategy(num_clusters=5)
    fed.setup(Federation().grid(), ArrayRecord(make_model().state_dict()), TRAIN_CONFIG)
    assert fed.setup_record["k_requested"] == 5 and fed.setup_record["k"] == 2
    assert len(fed.cluster_models) == 2


def test_fedconcat_id_infers_distributions_from_one_round_of_training():
    federation = Federation()
    fed = strategy(label_inference=True, id_samples=500)
    grid = federation.grid()
    train_config = ConfigRecord({**dict(TRAIN_CONFIG), "local-epochs": 5})
    fed.setup(grid, ArrayRecord(make_model().state_dict()), train_config)
    assert [m.metadata.message_type for m in grid.hops[0]] == ["train"] * 6  # ordinary training only
    assert all(m.content["config"]["local-epochs"] == 5 for m in grid.hops[0])
    assert groups(fed) == {frozenset({0, 1, 2}), frozenset({3, 4, 5})}
    # Each model is read as it arrives and let go: the hop keeps its replies' metrics only.
    assert all(not reply.content.array_records and not reply.decoded for reply in fed._round_hops[0].replies)
    for node, distribution in fed.setup_record["distributions"].items():
        own = GROUPS[int(node)]
        assert sum(distribution) == pytest.approx(1.0, abs=1e-5)
        assert distribution[own[0]] + distribution[own[1]] > 0.5


def lie(classes: tuple[int, int]) -> Fault:
    """A well-formed label report of two other classes, half each."""
    distribution = [0.5 if c in classes else 0.0 for c in range(NUM_CLASSES)]
    return lambda message, reply: reply_with(message, RecordDict({"metrics": MetricRecord({LABEL_DISTRIBUTION: distribution})}))


def test_label_check_places_a_node_whose_report_its_own_model_contradicts_by_the_model():
    federation = Federation()
    federation.faults[(0, LABELS_MESSAGE_TYPE)] = lie((2, 3))  # node 0 trains on {0, 1}
    unchecked = strategy()
    unchecked.setup(federation.grid(), ArrayRecord(make_model().state_dict()), TRAIN_CONFIG)
    assert groups(unchecked) == {frozenset({1, 2}), frozenset({0, 3, 4, 5})}  # the lie worked
    checked = strategy(label_check=True, id_samples=500)
    grid = federation.grid()
    checked.setup(grid, ArrayRecord(make_model().state_dict()), TRAIN_CONFIG)
    # Stage 1 asked for the reports, then trained every node once from the initial model.
    assert [hop[0].metadata.message_type for hop in grid.hops] == [LABELS_MESSAGE_TYPE, "train"]
    assert groups(checked) == {frozenset({0, 1, 2}), frozenset({3, 4, 5})}
    check = checked.setup_record["label_check"]
    assert check["disagreeing"] == [0] and check["unchecked"] == []
    assert check["agreement"]["0"] < check["bound"] <= min(v for k, v in check["agreement"].items() if k != "0")
    (placed,) = checked.setup_record["placements"]
    assert placed["node"] == 0 and placed["where"]["by"] == "inferred"
    assert placed["why"] == "its reported label distribution disagrees with its model"


def test_a_node_that_joins_during_the_encoder_rounds_is_clustered_alone_and_trains():
    federation = Federation()
    grid = federation.grid(arrivals={6: (1, (2, 3)), 7: (1, (0, 1))})
    federation.faults[(7, LABELS_MESSAGE_TYPE)] = lie((2, 3))
    fed = strategy(label_check=True, id_samples=500, encoder_rounds=3, classifier_rounds=1)
    run(fed, grid)
    record = fed.history[1]
    assert record["membership"]["joined"] == [6, 7]
    placed = {entry["node"]: entry["where"] for entry in record["placements"]}
    assert placed[6] == {"cluster": fed.assignment[3], "by": "reported"}
    assert placed[7] == {"cluster": fed.assignment[0], "by": "inferred"}  # its lie was not believed
    assert record["selected"] == {str(fed.assignment[0]): [0, 1, 2, 7], str(fed.assignment[3]): [3, 4, 5, 6]}


def test_a_node_that_joins_during_the_classifier_rounds_trains_the_head():
    federation = Federation()
    grid = federation.grid(arrivals={6: (2, (2, 3))})
    fed = strategy(encoder_rounds=2, classifier_rounds=2)
    run(fed, grid)
    record = fed.history[2]
    assert record["placements"] == [{"node": 6, "where": {"head": True}, "why": "joined after the start"}]
    assert 6 not in fed.assignment and 6 in record["selected"]
    assert federation.feature_computations[6] == 1  # the encoders went to it once


# ---------------------------------------------------------------------- stage 2
def test_encoder_rounds_send_each_node_its_cluster_model_and_average_inside_clusters():
    federation = Federation()
    grid = federation.grid()
    fed = strategy(encoder_rounds=2, classifier_rounds=1)
    replies: list[Message] = []
    original = grid.send_and_receive

    def recording(messages, *, timeout=None):
        answered = original(messages, timeout=timeout)
        replies.append(list(answered))
        return answered

    grid.send_and_receive = recording
    run(fed, grid)
    train_hops = hops_of(grid, "train")
    assert len(train_hops) == 2 and all(len(hop) == 6 for hop in train_hops)
    round2 = {m.metadata.dst_node_id: numpy_of(m.content["arrays"]) for m in train_hops[1]}
    round1_replies = replies[1]  # hop 0 is the query
    for members in ({0, 1, 2}, {3, 4, 5}):
        cluster_replies = [r for r in round1_replies if r.metadata.src_node_id in members]
        expected = weighted_average(
            [numpy_of(r.content["arrays"]) for r in cluster_replies],
            [r.content["metrics"]["num-examples"] for r in cluster_replies],
        )
        for node in members:
            for key, value in expected.items():
                np.testing.assert_array_equal(round2[node][key], value.numpy())
    assert not np.array_equal(round2[0]["classifier.weight"], round2[3]["classifier.weight"])
    assert fed.history[0]["stage"] == "encoders" and fed.history[0]["selected"] == {
        "0": [0, 1, 2],
        "1": [3, 4, 5],
    }


def test_fraction_train_applies_inside_each_cluster():
    fed = strategy(fraction_train=0.5, encoder_rounds=3, classifier_rounds=1)
    grid = Federation().grid()
    run(fed, grid)
    for record in fed.history[:3]:
        assert {k: len(v) for k, v in record["selected"].items()} == {"0": 2, "1": 2}  # round(0.5 * 3) = 2
        assert set(record["selected"]["0"]) <= {0, 1, 2} and set(record["selected"]["1"]) <= {3, 4, 5}
    assert len(fed.history[3]["selected"]) == 3  # classifier rounds sample among all nodes


@pytest.mark.parametrize("fault", [drop, nan_arrays, wrong_shape])
def test_bad_encoder_replies_are_left_out(fault):
    federation = Federation()
    federation.faults[(0, "train")] = in_round(1, fault)
    fed = strategy(encoder_rounds=1, classifier_rounds=1)
    grid = federation.grid()
    run(fed, grid)
    assert fed.history[0]["hops"][0]["replies"] == 5 and len(fed.history[0]["hops"][0]["misses"]) == 1
    reference = Federation()
    replies = [
        reference.handler(node)(m)
        for m in hops_of(grid, "train")[0]
        if (node := m.metadata.dst_node_id) in (1, 2)
    ]
    expected = weighted_average(
        [numpy_of(r.content["arrays"]) for r in replies], [r.content["metrics"]["num-examples"] for r in replies]
    )
    for key, value in expected.items():
        np.testing.assert_allclose(fed.cluster_models[0][key].numpy(), value.numpy())


def test_feddyn_corrects_each_cluster_model_with_its_own_h():
    alpha = 0.1
    fed = strategy(encoder_rounds=1, classifier_rounds=1, feddyn=FedDynServer(alpha))
    grid = Federation().grid()
    run(fed, grid)
    encoder_hop = hops_of(grid, "train")[0]
    assert {(m.content["config"]["local-objective"], m.content["config"]["feddyn-alpha"]) for m in encoder_hop} == {
        ("feddyn", alpha)
    }
    reference = Federation()
    for cluster in range(2):
        members = fed.members(cluster)
        sent = [m for m in encoder_hop if m.metadata.dst_node_id in members]
        replies = [reference.handler(m.metadata.dst_node_id)(m) for m in sent]
        average = weighted_average(
            [numpy_of(r.content["arrays"]) for r in replies], [r.content["metrics"]["num-examples"] for r in replies]
        )
        previous = numpy_of(sent[0].content["arrays"])
        h = {key: np.zeros_like(value) for key, value in previous.items()}  # h starts at 0
        expected, _ = feddyn_server_update(
            previous, [numpy_of(r.content["arrays"]) for r in replies], numpy_of(average), h, alpha, len(members)
        )
        for key, value in expected.items():
            np.testing.assert_allclose(fed.cluster_models[cluster][key].numpy(), value, rtol=1e-6, atol=1e-7)
    assert len(fed.history[0]["feddyn_h_norm"]) == 2 and min(fed.history[0]["feddyn_h_norm"]) > 0
    restored = strategy(encoder_rounds=1, classifier_rounds=1, feddyn=FedDynServer(alpha))
    restored.load_state_dict(fed.state_dict())
    assert [s.h_norm for s in restored.cluster_feddyn] == [s.h_norm for s in fed.cluster_feddyn]


def test_fedconcat_id_infers_labels_with_plain_sgd_under_feddyn():
    fed = strategy(label_inference=True, id_samples=50, encoder_rounds=1, classifier_rounds=1, feddyn=FedDynServer(0.1))
    grid = Federation().grid()
    run(fed, grid)
    inference, encoder = hops_of(grid, "train")[:2]
    assert {m.content["config"]["local-objective"] for m in inference} == {"sgd"}
    assert {m.content["config"]["local-objective"] for m in encoder} == {"feddyn"}


def test_a_cluster_that_never_trained_is_left_out_of_the_concatenation():
    federation = Federation()
    for node in (0, 1, 2):  # every member of cluster 0
        federation.faults[(node, "train")] = drop
    fed = strategy(encoder_rounds=1, classifier_rounds=1)
    torch.manual_seed(0)
    initial = numpy_of(ArrayRecord(make_model().state_dict()))
    result = run(fed, federation.grid())
    assert fed.history[1]["untrained_clusters"] == [0]
    assert len(fed.cluster_models) == 1 and fed.cluster_updates == [1]
    assert not np.array_equal(fed.cluster_models[0]["classifier.weight"].numpy(), initial["classifier.weight"])
    encoders = {key.split(".")[1] for key in result.arrays.keys() if key.startswith("encoders.")}
    assert encoders == {"0"}  # one encoder: cluster 1's


def test_cluster_models_are_evaluated_at_the_end_of_the_encoder_stage():
    test_x = torch.cat([node_data(n).x_test for n in GROUPS])
    test_y = torch.cat([node_data(n).y_test for n in GROUPS])

    def evaluate_model(model):
        return evaluate(model, test_x, test_y, normalization=NORMALIZATION, device=torch.device("cpu"))

    fed = strategy(evaluate_model=evaluate_model, encoder_rounds=2, classifier_rounds=1)
    run(fed, Federation().grid())
    assert "cluster_evaluation" not in fed.history[0]
    assert [entry["cluster"] for entry in fed.history[1]["cluster_evaluation"]] == [0, 1]


# ---------------------------------------------------------------------- stage 3
def test_classifier_rounds_send_encoders_once_then_only_the_classifier():
    federation = Federation()
    grid = federation.grid()
    fed = strategy(encoder_rounds=2, classifier_rounds=3)
    result = run(fed, grid)
    feature_hops = hops_of(grid, FEATURES_MESSAGE_TYPE)
    head_hops = hops_of(grid, HEAD_MESSAGE_TYPE)
    assert len(feature_hops) == 1 and len(feature_hops[0]) == 6
    assert len(head_hops) == 3 and all(len(hop) == 6 for hop in head_hops)
    assert federation.feature_computations == Counter({node: 1 for node in GROUPS})
    for message in head_hops[0]:
        assert list(message.content["arrays"].keys()) == ["classifier.weight", "classifier.bias"]
    # Round layout: the first classifier round has the broadcast hop then the classifier hop.
    assert [len(record["hops"]) for record in fed.history] == [1, 1, 2, 1, 1]
    assert [record["stage"] for record in fed.history] == ["encoders"] * 2 + ["classifier"] * 3
    # Encoders are frozen: the final model's encoders are exactly the cluster encoders after stage 2.
    final = numpy_of(result.arrays)
    broadcast = numpy_of(feature_hops[0][0].content["encoders"])
    for cluster, model in enumerate(fed.cluster_models):
        for key, value in model.items():
            if key.startswith("encoder."):
                name = f"encoders.{cluster}.{key[len('encoder.') :]}"
                np.testing.assert_array_equal(final[name], value.numpy())
                np.testing.assert_array_equal(broadcast[name], value.numpy())
    assert final["classifier.weight"].shape == (NUM_CLASSES, 2 * 200)


def recorded_replies(grid: FakeGrid) -> list[Message]:
    """The replies the strategy receives from `grid` from now on (the list fills as it runs)."""
    replies: list[Message] = []
    original = grid.send_and_receive

    def recording(messages, *, timeout=None):
        answered = original(messages, timeout=timeout)
        replies.extend(answered)
        return answered

    grid.send_and_receive = recording
    return replies


@pytest.mark.parametrize("head_memory", [False, True])
def test_classifier_is_the_num_examples_weighted_average_of_the_heads(head_memory):
    federation = Federation()
    grid = federation.grid()
    fed = strategy(encoder_rounds=1, classifier_rounds=1, init_classifier=True, head_memory=head_memory)
    replies = recorded_replies(grid)
    result = run(fed, grid)
    heads = [r for r in replies if r.metadata.message_type == HEAD_MESSAGE_TYPE]
    assert len(heads) == 6
    expected = weighted_average(
        [numpy_of(r.content["arrays"]) for r in heads], [r.content["metrics"]["num-examples"] for r in heads]
    )
    # With the memory it is start + the weighted mean of the updates: equal up to float32 rounding.
    for key in ("classifier.weight", "classifier.bias"):
        np.testing.assert_allclose(result.arrays[key].numpy(), expected[key].numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("head_memory", [False, True])
def test_a_lost_head_reply_counts_with_its_nodes_last_update_under_the_head_memory(head_memory):
    """Rounds 2 and 3 train the head; node 2's round-3 reply is lost. With the memory, round 3's
    classifier is the weighted mean of the five fresh heads and of round 3's start moved by node
    2's round-2 update; without it, the mean of the five heads."""
    federation = Federation()
    federation.faults[(2, HEAD_MESSAGE_TYPE)] = in_round(3, drop)
    grid = federation.grid()
    fed = strategy(encoder_rounds=1, classifier_rounds=2, head_memory=head_memory)
    replies = recorded_replies(grid)
    result = run(fed, grid)
    sent = {(m.metadata.dst_node_id, m.content["config"]["server-round"]): numpy_of(m.content["arrays"])
            for hop in hops_of(grid, HEAD_MESSAGE_TYPE) for m in hop}
    round3 = [r for r in replies if r.metadata.message_type == HEAD_MESSAGE_TYPE][6:]
    assert sorted(r.metadata.src_node_id for r in round3) == [0, 1, 3, 4, 5]
    models = [numpy_of(r.content["arrays"]) for r in round3]
    weights = [r.content["metrics"]["num-examples"] for r in round3]
    if head_memory:
        node2_round2 = next(r for r in replies[::-1] if r.metadata.message_type == HEAD_MESSAGE_TYPE and r.metadata.src_node_id == 2)
        update = {key: node2_round2.content["arrays"][key].numpy() - sent[(2, 2)][key] for key in sent[(2, 2)]}
        models.append({key: sent[(0, 3)][key] + update[key] for key in update})
        weights.append(node2_round2.content["metrics"]["num-examples"])
        assert fed.history[2]["head_memory"] == {"fresh": 5, "replayed": [2], "oldest_round": 2}
    else:
        assert "head_memory" not in fed.history[2]
    expected = weighted_average(models, weights)
    for key in ("classifier.weight", "classifier.bias"):
        np.testing.assert_allclose(result.arrays[key].numpy(), expected[key].numpy(), rtol=1e-5, atol=1e-7)


def reversed_head(message, reply):
    """The head update reversed: what was sent minus the node's update (the fuzzing mod's sign-flip)."""
    sent = message.content["arrays"]
    flipped = {key: Array(2 * sent[key].numpy() - value.numpy()) for key, value in reply.content["arrays"].items()}
    return reply_with(message, RecordDict({"arrays": ArrayRecord(flipped), "metrics": reply.content["metrics"]}))


@pytest.mark.parametrize("head_check", [False, True])
def test_a_reversed_head_update_is_rejected_by_the_head_check_as_if_it_were_lost(head_check):
    """Node 2's round-3 head update comes back reversed: it moves the bias against both its
    reported classes and its round-2 update, so the check rejects it and the run ends with the
    classifier of a run that lost that reply; unchecked, it is averaged in."""
    results = {}
    for name, fault in (("reversed", reversed_head), ("lost", drop)):
        federation = Federation()
        federation.faults[(2, HEAD_MESSAGE_TYPE)] = in_round(3, fault)
        fed = strategy(encoder_rounds=1, classifier_rounds=2, head_check=head_check)
        results[name] = (fed, run(fed, federation.grid()))
    fed, result = results["reversed"]
    lost = results["lost"][1]
    same = all(np.array_equal(result.arrays[key].numpy(), lost.arrays[key].numpy()) for key in ("classifier.weight", "classifier.bias"))
    if not head_check:
        assert "head_check" not in fed.history[2] and not same
        return
    check = fed.history[2]["head_check"]
    assert check["rejected"] == [2] and max(check["agreement"]["2"].values()) < 0
    assert all(min(agreements.values()) > 0 for node, agreements in check["agreement"].items() if node != "2")
    (miss,) = [miss for hop in fed.history[2]["hops"] for miss in hop["misses"]]
    assert miss["node"] == 2 and "moves the bias against the label distribution it was placed by" in miss["reason"]
    assert same


def test_a_node_placed_by_a_misleading_distribution_is_believed_from_its_second_head_update():
    federation = Federation()
    federation.faults[(0, LABELS_MESSAGE_TYPE)] = lie((2, 3))  # unchecked: node 0 is placed by its lie
    fed = strategy(encoder_rounds=1, classifier_rounds=3)
    run(fed, federation.grid())
    first, second, third = (fed.history[r]["head_check"] for r in (1, 2, 3))
    # Its first head update moves the bias towards its real classes, against the lie: rejected.
    assert first["rejected"] == [0] and set(first["agreement"]["0"]) == {"distribution"}
    # From then on its previous update vouches for it.
    assert second["rejected"] == third["rejected"] == []
    assert second["agreement"]["0"]["distribution"] < 0 < second["agreement"]["0"]["previous"]


def test_classifier_init_from_cluster_heads_or_random():
    grid = Federation().grid()
    seeded = strategy(encoder_rounds=1, classifier_rounds=1, init_classifier=True)
    run(seeded, grid)
    start = hops_of(grid, HEAD_MESSAGE_TYPE)[0][0].content["arrays"]
    heads = [m["classifier.weight"].numpy() for m in seeded.cluster_models]
    np.testing.assert_array_equal(start["classifier.weight"].numpy(), np.concatenate(heads, axis=1))
    biases = sum(m["classifier.bias"].numpy() for m in seeded.cluster_models)
    np.testing.assert_allclose(start["classifier.bias"].numpy(), biases, rtol=1e-6)
    grid = Federation().grid()
    run(strategy(encoder_rounds=1, classifier_rounds=1, init_classifier=False), grid)
    random_start = hops_of(grid, HEAD_MESSAGE_TYPE)[0][0].content["arrays"]["classifier.weight"].numpy()
    assert np.abs(random_start).max() <= 1 / math.sqrt(400)
    assert not np.allclose(random_start, np.concatenate(heads, axis=1))


# Flower ships every array as its own content-addressed object: measured ~610 B of header and
# references per array, ~0.4 KB for message metadata plus config or metrics. Bound, per message:
def overhead(num_arrays: int) -> int:
    return 1024 + 700 * num_arrays


MODEL_PARAMS = 16 * 200 + 200 + 200 * 200 + 200 + 200 * NUM_CLASSES + NUM_CLASSES
HEAD_PARAMS = NUM_CLASSES * 2 * 200 + NUM_CLASSES  # the K = 2 concatenated classifier


def test_classifier_round_bytes_are_the_classifier_size_far_below_an_encoder_round():
    fed = strategy(encoder_rounds=2, classifier_rounds=3)
    run(fed, Federation().grid())
    assert MODEL_PARAMS == sum(p.numel() for p in make_model().parameters())
    for record in fed.history[3:]:  # classifier rounds after the broadcast
        assert set(record["stage_bytes"]) == {"classifier"}
        for direction in ("bytes_sent", "bytes_received"):
            assert 0 <= record[direction] - 6 * 4 * HEAD_PARAMS <= 6 * overhead(2)
    encoder_round = fed.history[0]["bytes_sent"]
    assert 0 <= encoder_round - 6 * 4 * MODEL_PARAMS <= 6 * overhead(6)
    assert fed.history[3]["bytes_sent"] < encoder_round / 20


def test_measured_bytes_match_the_papers_formula():
    """2wN(T_e + K/2 + cKT_c), w = model bytes, N = 6, K = 2, c = one classifier / model size.

    Differences, both bounded exactly: the formula has no message overhead (`overhead` per
    message), and it counts the broadcast as K whole models while only the K encoders are sent
    (c·K·w·N less). Measured: within 3 % of the formula even for this tiny model.
    """
    t_e, t_c, n, k = 2, 3, 6, 2
    fed = strategy(encoder_rounds=t_e, classifier_rounds=t_c)
    run(fed, Federation().grid())
    w = 4 * MODEL_PARAMS
    c = (NUM_CLASSES * 200 + NUM_CLASSES) / MODEL_PARAMS
    formula = 2 * w * n * (t_e + k / 2 + c * k * t_c)
    stages = {name: s["sent"] + s["received"] for name, s in fed.bytes_by_stage.items()}
    measured = sum(stages.values())
    assert measured == sum(r["bytes_sent"] + r["bytes_received"] for r in fed.history)
    bounds = {
        "encoder-training": (2 * w * n * t_e, 2 * n * t_e * overhead(6)),
        "encoder-broadcast": ((1 - c) * k * w * n, n * (overhead(4 * k) + overhead(0))),
        "classifier": (2 * c * k * w * n * t_c, 2 * n * t_c * overhead(2)),
    }
    for name, (payload, extra) in bounds.items():
        assert 0 <= stages[name] - payload <= extra, (name, stages[name], payload)
    assert -c * k * w * n <= measured - formula <= sum(extra for _, extra in bounds.values())
    assert abs(measured - formula) <= 0.03 * formula, (measured, formula)


@pytest.mark.parametrize("fault", [drop, nan_arrays, wrong_shape])
def test_bad_classifier_replies_are_left_out(fault):
    federation = Federation()
    federation.faults[(2, HEAD_MESSAGE_TYPE)] = fault
    fed = strategy(encoder_rounds=1, classifier_rounds=2)
    run(fed, federation.grid())
    for record in fed.history[1:]:
        head_hop = record["hops"][-1]
        assert head_hop["replies"] == 5 and [m["node"] for m in head_hop["misses"]] == [2]
        assert record["aggregated"]


def test_no_valid_classifier_reply_keeps_the_classifier():
    federation = Federation()
    for node in GROUPS:
        federation.faults[(node, HEAD_MESSAGE_TYPE)] = in_round(3, drop)
    fed = strategy(encoder_rounds=1, classifier_rounds=2)
    grid = federation.grid()
    result = run(fed, grid)
    after_round2 = hops_of(grid, HEAD_MESSAGE_TYPE)[1][0].content["arrays"]  # what round 3 sent
    assert not fed.history[2]["aggregated"]
    np.testing.assert_array_equal(
        result.arrays["classifier.weight"].numpy(), after_round2["classifier.weight"].numpy()
    )
    np.testing.assert_array_equal(
        fed.classifier["classifier.weight"].numpy(), after_round2["classifier.weight"].numpy()
    )


def test_cache_miss_makes_the_server_send_the_encoders_again():
    federation = Federation()
    grid = federation.grid()
    fed = strategy(encoder_rounds=1, classifier_rounds=3)
    original = federation.handler(4)

    def restart_before_round3(message):
        if (
            message.metadata.message_type == HEAD_MESSAGE_TYPE
            and message.content["config"]["server-round"] == 3
            and fed.history[-1]["round"] == 2
            and not federation.contexts[4].state.get("restarted")
        ):
            federation.contexts[4] = Federation.fresh_context(4)  # the node restarted: its state is gone
            federation.contexts[4].state["restarted"] = ConfigRecord({"yes": True})
        return original(message)

    grid.handlers[4] = restart_before_round3
    run(fed, grid)
    round3 = fed.history[2]
    assert round3["cache_misses"] == [4]
    kinds = [
        (hop[0].metadata.message_type, sorted(m.metadata.dst_node_id for m in hop))
        for hop in grid.hops[-4:-1]
    ]
    assert kinds == [
        (HEAD_MESSAGE_TYPE, [0, 1, 2, 3, 4, 5]),
        (FEATURES_MESSAGE_TYPE, [4]),
        (HEAD_MESSAGE_TYPE, [4]),
    ]
    assert federation.feature_computations[4] == 2 and federation.feature_computations[0] == 1
    # The recovered node trained from the same classifier as everybody else that round.
    heads = [hop for hop in hops_of(grid, HEAD_MESSAGE_TYPE)]
    np.testing.assert_array_equal(
        heads[1][0].content["arrays"]["classifier.weight"].numpy(),
        heads[2][0].content["arrays"]["classifier.weight"].numpy(),
    )
    assert round3["aggregated"] and "cache_misses" not in fed.history[3]
    assert len(fed.history[3]["hops"]) == 1  # back to classifier-only rounds


def test_missing_feature_reply_is_retried_next_round():
    federation = Federation()
    federation.faults[(1, FEATURES_MESSAGE_TYPE)] = in_round(2, drop)
    fed = strategy(encoder_rounds=1, classifier_rounds=2)
    grid = federation.grid()
    run(fed, grid)
    head_hops = hops_of(grid, HEAD_MESSAGE_TYPE)
    assert 1 not in {m.metadata.dst_node_id for m in head_hops[0]}
    assert [sorted(m.metadata.dst_node_id for m in hop) for hop in hops_of(grid, FEATURES_MESSAGE_TYPE)] == [
        [0, 1, 2, 3, 4, 5],
        [1],
    ]
    assert 1 in {m.metadata.dst_node_id for m in head_hops[1]}


def test_node_ids_beyond_2_63_are_kept_exact():
    """Real node ids are uint64; a numpy array of ids straddling 2**63 turns into float64."""
    first = 2**63 - 3
    fed = strategy(encoder_rounds=1, classifier_rounds=1, fraction_train=0.7)
    run(fed, Federation(first_id=first).grid())
    assert groups(fed) == {frozenset(first + i for i in (0, 1, 2)), frozenset(first + i for i in (3, 4, 5))}
    for record in fed.history:
        assert all(hop["misses"] == [] for hop in record["hops"])
        assert record["aggregated"]


# ---------------------------------------------------------------------- the model, state, entry point
def test_global_module_and_saved_model(tmp_path):
    path = tmp_path / "out" / "fedconcat_model.pt"
    fed = strategy(encoder_rounds=1, classifier_rounds=2, output_path=path)
    evaluated = {}

    def evaluate_fn(server_round, arrays):
        module = fed.global_module(arrays, make_model)
        loss, accuracy = evaluate(
            module,
            node_data(0).x_train,
            node_data(0).y_train,
            normalization=NORMALIZATION,
            device=torch.device("cpu"),
        )
        evaluated[server_round] = type(module).__name__
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    result = run(fed, Federation().grid(), evaluate_fn=evaluate_fn)
    assert evaluated == {0: "SplitModel", 1: "ConcatModel", 2: "ConcatModel", 3: "ConcatModel"}
    assert "accuracy" in fed.history[0]  # the cluster ensemble is evaluated during stage 2
    loaded, meta = load_concat_model(path)
    assert meta["num_encoders"] == 2 and meta["mean"] == [0.5] and meta["std"] == [0.25]
    x = NORMALIZATION(torch.rand(7, *SHAPE))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), fed.global_module(result.arrays, make_model)(x))


def test_state_dict_resumes_to_the_same_result():
    straight = strategy(encoder_rounds=2, classifier_rounds=2)
    straight_result = run(straight, Federation().grid())

    federation = Federation()
    first = strategy(encoder_rounds=2, classifier_rounds=1)
    run(first, federation.grid())
    saved = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = strategy(encoder_rounds=2, classifier_rounds=2)
    resumed.load_state_dict(saved)
    assert resumed.setup_record == first.setup_record and groups(resumed) == groups(first)
    grid = federation.grid()
    resumed_result = run(resumed, grid)
    assert len(grid.hops) == 1  # only round 4 ran: no stage 1 again, no broadcast (caches kept)
    assert [r["round"] for r in resumed.history] == [1, 2, 3, 4]
    for key, value in straight_result.arrays.items():
        np.testing.assert_array_equal(resumed_result.arrays[key].numpy(), value.numpy())
    assert resumed.bytes_by_stage == straight.bytes_by_stage


def test_run_uses_its_own_round_count_and_build_reads_the_run_config(tmp_path):

    config = RunConfig.from_mapping(
        {
            "strategy": "fedconcat-id",
            "fedconcat-clusters": "auto",
            "fedconcat-encoder-rounds": 3,
            "fedconcat-classifier-rounds": 4,
            "fedconcat-balanced": True,
            "output-dir": str(tmp_path),
            "fraction-train": 0.5,
            "device": "cpu",
        }
    )
    built = build_strategy(config, ServerEnv.from_config(config))
    assert isinstance(built, FedConcat)
    assert built.label_inference and built.num_clusters is None and built.balanced
    assert built.num_rounds == 7 and built.fraction_train == 0.5
    assert built.output_path == tmp_path / "fedconcat_model.pt" and built.model_name == "mlp"
    plain = build_strategy(
        RunConfig.from_mapping({"strategy": "fedconcat"}), ServerEnv.from_config(RunConfig())
    )
    assert not plain.label_inference and plain.num_clusters == 5


def test_a_user_needs_only_the_documented_handlers():
    """The protocol's docstring names the messages and keys the strategy sends; the client
    module's shows how a ClientApp registers each handler."""
    for message_type in (
        LABELS_MESSAGE_TYPE,
        FEATURES_MESSAGE_TYPE,
        HEAD_MESSAGE_TYPE,
        LABEL_DISTRIBUTION,
        HEAD_NAME,
        CACHE_MISS,
    ):
        assert message_type in protocol.__doc__
    for name in ("LABELS_ACTION", "FEATURES_ACTION", "HEAD_ACTION", "from_train_split"):
        assert name in fedconcat_client.__doc__
    for handler in ("handle_label_query", "handle_features", "handle_head_training"):
        assert f"return {handler}(msg, ctx" in fedconcat_client.__doc__


# ---------------------------------------------------------------------- end to end
@pytest.mark.e2e
@pytest.mark.parametrize("variant", ["fedconcat", "fedconcat-id"])
def test_end_to_end_on_digits(tmp_path, variant):
    """A whole run on digits (in process), 6 clients with 2 classes each: all three stages, bytes,
    saved model. (tests/test_fedconcat_user_app.py runs FedConcat through `flwr run`.)"""

    config = {
        "strategy": variant,
        "partition": "classes",
        "classes-per-client": 2,
        "fedconcat-clusters": "3",
        "fedconcat-encoder-rounds": 2,
        "fedconcat-classifier-rounds": 2,
        "fedconcat-id-samples": 2000,
        "fedconcat-init-classifier": True,
        "lr": 0.1,
    }
    metrics = run_in_process(tmp_path, config, num_supernodes=6)
    rounds = metrics["rounds"]
    assert [r["stage"] for r in rounds] == ["encoders"] * 2 + ["classifier"] * 2  # not num-server-rounds
    setup = metrics["setup"]
    assert setup["variant"] == variant and sum(c["size"] for c in setup["clusters"]) == 6
    assert set(rounds[2]["stage_bytes"]) == {"encoder-broadcast", "classifier"}
    assert set(rounds[3]["stage_bytes"]) == {"classifier"} and rounds[3]["hops"][0]["replies"] == 6
    assert rounds[3]["bytes_sent"] < rounds[0]["bytes_sent"] / 5
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"] + 0.1
    # The saved model is the evaluated one, and runs without Flower's machinery.
    model, meta = load_concat_model(tmp_path / "output" / "fedconcat_model.pt")
    assert meta["num_encoders"] == setup["k"]
    data = load_dataset("digits")
    _, accuracy = evaluate(
        model,
        data.x_test,
        data.y_test,
        normalization=Normalization(meta["mean"], meta["std"]),
        device=torch.device("cpu"),
    )
    assert accuracy == pytest.approx(metrics["final_accuracy"], abs=1e-9)
