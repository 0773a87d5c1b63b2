"""FedConcat's client handlers, called with real Messages and a real Context (and through a ClientApp)."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from torch import nn

from concatfl.core.concat import ConcatModel, classifier_from_heads, concat_state_dict, concatenate
from concatfl.fedconcat_client import STATE_FEATURES, handle_features, handle_head_training, handle_label_query
from concatfl.protocol import (
    CACHE_MISS,
    CLASSIFIER_STEPS,
    DP_EPSILON,
    ENCODERS_ID,
    ENCODERS_KEY,
    FEATURE_DIM,
    FEATURES_ACTION,
    FEATURES_MESSAGE_TYPE,
    HEAD_ACTION,
    HEAD_NAME,
    HEAD_MESSAGE_TYPE,
    LABEL_DISTRIBUTION,
    LABELS_ACTION,
    LABELS_MESSAGE_TYPE,
    MODEL_NAME,
    NUM_ENCODERS,
)
from concatfl.models import build_model
from concatfl.runtime import ClientData
from concatfl.training import Normalization


SHAPE = (1, 4, 4)
NUM_CLASSES = 4


def client_data(labels=(0, 0, 0, 1, 1, 3, 3, 3), seed=0) -> ClientData:
    generator = torch.Generator().manual_seed(seed)
    y = torch.tensor(labels)
    x = torch.rand(len(y), *SHAPE, generator=generator)
    return ClientData(x, y, x[:2], y[:2], NUM_CLASSES, Normalization((0.5,), (0.25,)), None)


def context(node_id=7) -> Context:
    return Context(run_id=1, node_id=node_id, node_config={}, state=RecordDict(), run_config={})


def make_model():
    return build_model("mlp", SHAPE, NUM_CLASSES)


def concat_parts(num=2):
    torch.manual_seed(0)
    states = [make_model().state_dict() for _ in range(num)]
    state = concat_state_dict(states, classifier_from_heads(states))
    encoders = ArrayRecord({k: v for k, v in state.items() if k.startswith("encoders.")})
    head = ArrayRecord({k: state[k] for k in ("classifier.weight", "classifier.bias")})
    return state, encoders, head


def features_message(encoders, num=2, encoders_id="abc", node_id=7) -> Message:
    config = ConfigRecord({MODEL_NAME: "mlp", NUM_ENCODERS: num, ENCODERS_ID: encoders_id, "server-round": 3})
    return Message(
        RecordDict({ENCODERS_KEY: encoders, "config": config}),
        dst_node_id=node_id,
        message_type=FEATURES_MESSAGE_TYPE,
    )


def head_message(head, encoders_id="abc", node_id=7, steps=3) -> Message:
    config = ConfigRecord(
        {ENCODERS_ID: encoders_id, CLASSIFIER_STEPS: steps, "lr": 0.1, "batch-size": 4, "server-round": 4}
    )
    return Message(
        RecordDict({"arrays": head, "config": config}), dst_node_id=node_id, message_type=HEAD_MESSAGE_TYPE
    )


def test_label_query_reports_the_distribution():
    message = Message(
        RecordDict({"config": ConfigRecord({DP_EPSILON: 0.0})}),
        dst_node_id=7,
        message_type=LABELS_MESSAGE_TYPE,
    )
    reply = handle_label_query(message, context(), client_data())
    metrics = reply.content["metrics"]
    np.testing.assert_allclose(metrics[LABEL_DISTRIBUTION], [3 / 8, 2 / 8, 0.0, 3 / 8])
    assert list(metrics.keys()) == [LABEL_DISTRIBUTION]  # not even the number of samples
    assert reply.metadata.src_node_id == 7  # a reply from the node the query went to


def test_label_query_with_epsilon_adds_unseeded_laplace_noise():
    message = Message(
        RecordDict({"config": ConfigRecord({DP_EPSILON: 1.0})}),
        dst_node_id=7,
        message_type=LABELS_MESSAGE_TYPE,
    )
    noisy = [
        np.asarray(
            handle_label_query(message, context(), client_data()).content["metrics"][LABEL_DISTRIBUTION]
        )
        for _ in range(200)
    ]
    exact = np.array([3 / 8, 2 / 8, 0.0, 3 / 8])
    deviations = np.stack(noisy) - exact
    assert not np.allclose(noisy[0], noisy[1])  # fresh noise every time, no server-known seed
    assert np.abs(deviations).mean() == pytest.approx(1.0, rel=0.15)  # E|Laplace(0, 1/ε)| = 1/ε


def test_features_are_computed_once_and_cached_in_state():
    state, encoders, _ = concat_parts()
    ctx, data = context(), client_data()
    reply = handle_features(features_message(encoders), ctx, data)
    assert reply.content["metrics"]["num-examples"] == 8
    assert reply.content["metrics"][FEATURE_DIM] == 400
    assert "arrays" not in reply.content  # nothing model-sized goes back
    model = ConcatModel.from_factory(make_model, 2)
    model.load_state_dict(state)
    cached = ctx.state.array_records[STATE_FEATURES]
    np.testing.assert_allclose(
        cached["features"].numpy(), model.features(data.normalization(data.x_train)).numpy(), atol=1e-6
    )
    np.testing.assert_array_equal(cached["labels"].numpy(), data.y_train.numpy())


class UserNet(nn.Module):
    """A user's model on flat inputs, its head named fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 6)
        self.fc2 = nn.Linear(6, NUM_CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def users_features_message(encoders, model_name=""):
    config = ConfigRecord({MODEL_NAME: model_name, NUM_ENCODERS: 2, ENCODERS_ID: "abc", HEAD_NAME: "fc2"})
    return Message(
        RecordDict({ENCODERS_KEY: ArrayRecord(encoders), "config": config}),
        dst_node_id=7,
        message_type=FEATURES_MESSAGE_TYPE,
    )


def test_features_of_a_users_model_are_its_inputs_to_the_named_head():
    torch.manual_seed(0)
    models = [UserNet() for _ in range(2)]
    encoders, _ = concatenate([model.state_dict() for model in models], "fc2")
    x, y = torch.rand(8, 16), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    ctx = context()
    reply = handle_features(
        users_features_message(encoders), ctx, ClientData.from_train_split(x, y, NUM_CLASSES), make_model=UserNet
    )
    assert reply.content["metrics"][FEATURE_DIM] == 12
    with torch.no_grad():
        expected = torch.cat([torch.relu(model.fc1(x)) for model in models], dim=1)
    cached = ctx.state.array_records[STATE_FEATURES]["features"].numpy()
    np.testing.assert_allclose(cached, expected.numpy(), atol=1e-6)


def test_features_of_a_users_model_need_its_make_model():
    encoders, _ = concatenate([UserNet().state_dict() for _ in range(2)], "fc2")
    data = ClientData.from_train_split(torch.rand(4, 16), torch.tensor([0, 1, 2, 3]), NUM_CLASSES)
    with pytest.raises(ValueError, match="handle_features needs make_model: the server names no concatfl"):
        handle_features(users_features_message(encoders), context(), data)


def test_head_training_uses_the_cache_and_returns_only_the_classifier(monkeypatch):
    _, encoders, head = concat_parts()
    ctx, data = context(), client_data()
    handle_features(features_message(encoders), ctx, data)
    # From now on the encoders must never run again on this client.
    monkeypatch.setattr(ConcatModel, "features", lambda *a: pytest.fail("features recomputed"))
    for _ in range(2):
        reply = handle_head_training(head_message(head), ctx, data)
        arrays = reply.content["arrays"]
        assert list(arrays.keys()) == ["classifier.weight", "classifier.bias"]
        assert arrays["classifier.weight"].shape == (NUM_CLASSES, 400)
        assert not np.allclose(arrays["classifier.weight"].numpy(), head["classifier.weight"].numpy())
        assert reply.content["metrics"]["num-examples"] == 8
        assert CACHE_MISS not in reply.content["metrics"]


def test_missing_hyperparameters_fall_back_to_the_run_config_even_a_foreign_one():
    """A user's own app may have run-config keys concatfl does not know: they must not break."""
    _, encoders, head = concat_parts()
    ctx = Context(
        run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={"my-app-key": 3, "lr": 0.0}
    )
    data = client_data()
    handle_features(features_message(encoders), ctx, data)
    message = head_message(head)
    del message.content["config"]["lr"]
    reply = handle_head_training(message, ctx, data)  # lr = 0 from the run config: no change
    weight = reply.content["arrays"]["classifier.weight"].numpy()
    np.testing.assert_array_equal(weight, head["classifier.weight"].numpy())


def test_head_training_is_deterministic_per_round_and_node():
    _, encoders, head = concat_parts()
    replies = []
    for _ in range(2):
        ctx, data = context(), client_data()
        handle_features(features_message(encoders), ctx, data)
        replies.append(handle_head_training(head_message(head), ctx, data).content["arrays"])
    np.testing.assert_array_equal(
        replies[0]["classifier.weight"].numpy(), replies[1]["classifier.weight"].numpy()
    )


@pytest.mark.parametrize("cause", ["restart", "other encoders"])
def test_cache_miss_reply(cause):
    _, encoders, head = concat_parts()
    ctx, data = context(), client_data()
    if cause == "other encoders":
        handle_features(features_message(encoders, encoders_id="old"), ctx, data)
    reply = handle_head_training(head_message(head, encoders_id="new"), ctx, data)
    metrics = reply.content["metrics"]
    assert metrics[CACHE_MISS] == 1 and metrics["num-examples"] == 8
    # The classifier comes back untouched (so the reply passes the shared validation).
    np.testing.assert_array_equal(
        reply.content["arrays"]["classifier.weight"].numpy(), head["classifier.weight"].numpy()
    )


def test_handlers_are_routed_by_a_client_app():
    data = client_data()
    app = ClientApp()

    @app.query(LABELS_ACTION)
    def query(message, ctx):
        return handle_label_query(message, ctx, data)

    @app.train(FEATURES_ACTION)
    def features(message, ctx):
        return handle_features(message, ctx, data)

    @app.train(HEAD_ACTION)
    def head_training(message, ctx):
        return handle_head_training(message, ctx, data)

    _, encoders, head = concat_parts()
    ctx = context()
    label_reply = app(
        Message(
            RecordDict({"config": ConfigRecord({DP_EPSILON: 0.0})}),
            dst_node_id=7,
            message_type=LABELS_MESSAGE_TYPE,
        ),
        ctx,
    )
    assert len(label_reply.content["metrics"][LABEL_DISTRIBUTION]) == NUM_CLASSES
    assert CACHE_MISS in app(head_message(head), ctx).content["metrics"]
    assert app(features_message(encoders), ctx).content["metrics"][FEATURE_DIM] == 400
    assert CACHE_MISS not in app(head_message(head), ctx).content["metrics"]
