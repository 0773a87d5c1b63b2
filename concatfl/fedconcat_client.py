"""FedConcat's client side: the three message handlers beyond ordinary training.

The messages, their keys and the replies are specified in `concatfl.protocol`; the server side
is `concatfl.strategies.fedconcat.FedConcat`. Each handler takes the message, the node's
Context and the node's training split as a `concatfl.runtime.ClientData`:

* `handle_label_query` (``"query.fedconcat_labels"``, stage 1-A of FedConcat): the label
  distribution of the training split, with Laplace noise when ε > 0.
* `handle_features` (``"train.fedconcat_features"``, stage 3): builds K models of the run's
  architecture, splits each into encoder and head at the layer the server names (FedConcat's
  `head`; `concatfl.core.concat.split_model`), loads the received encoders and caches the
  concatenated features of the training split in ``context.state``.
* `handle_head_training` (``"train.fedconcat_head"``, stage 3): a few SGD steps of the received
  linear head on the cached features.

What a user's own ClientApp adds to support FedConcat (FedConcat-ID needs only the last two;
its other rounds, like FedConcat's encoder rounds, are the ClientApp's ordinary ``train``)::

    from concatfl.protocol import FEATURES_ACTION, HEAD_ACTION, LABELS_ACTION
    from concatfl.runtime import ClientData

    def my_client_data(ctx):  # the node's training split as tensors, inputs as the model takes them
        x, y = load_my_train_split(ctx)
        return ClientData.from_train_split(x, y, num_classes=10)

    @app.query(LABELS_ACTION)
    def query(msg, ctx): return handle_label_query(msg, ctx, my_client_data(ctx))
    @app.train(FEATURES_ACTION)
    def features(msg, ctx): return handle_features(msg, ctx, my_client_data(ctx), make_model=Net)
    @app.train(HEAD_ACTION)
    def head(msg, ctx): return handle_head_training(msg, ctx, my_client_data(ctx))

where ``Net`` builds the run's model (the architecture of the ServerApp's `initial_arrays`); it
may be omitted for concatfl's own architectures. The model's forward must end with its head,
``return self.<head>(features)``: `handle_features` checks this on the first training inputs
and fails with a message naming the head otherwise. The head's input is what the encoders
contribute to the concatenation.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from torch import nn

from .config import RunConfig
from .core.clustering import label_distribution, laplace_noise
from .core.concat import (
    CLASSIFIER_BIAS,
    CLASSIFIER_WEIGHT,
    DEFAULT_HEAD,
    ENCODERS_PREFIX,
    ConcatModel,
    train_classifier,
)
from .models import build_model
from .protocol import (
    CACHE_MISS,
    CLASSIFIER_STEPS,
    DP_EPSILON,
    ENCODERS_ID,
    ENCODERS_KEY,
    FEATURE_DIM,
    HEAD_NAME,
    LABEL_DISTRIBUTION,
    MODEL_NAME,
    NUM_ENCODERS,
)
from .training import pick_device

if TYPE_CHECKING:
    from .runtime import ClientData

# Where the features live in context.state (features + labels, and the encoders they came from).
STATE_FEATURES = "fedconcat-features"
STATE_CACHE = "fedconcat-cache"

FEATURE_BATCH_SIZE = 512
# Inputs on which the split of the run's model into encoder and head is checked.
SPLIT_CHECK_SIZE = 4


def handle_label_query(message: Message, context: Context, data: ClientData) -> Message:
    """Reply with this client's label distribution, with Laplace noise when ε > 0."""
    distribution = label_distribution(data.label_counts())
    epsilon = float(_settings(message, context)[DP_EPSILON])
    if epsilon > 0:
        distribution = laplace_noise(distribution, epsilon, np.random.default_rng())
    metrics = MetricRecord({LABEL_DISTRIBUTION: [float(p) for p in distribution]})
    return Message(RecordDict({"metrics": metrics}), reply_to=message)


def handle_features(
    message: Message,
    context: Context,
    data: ClientData,
    make_model: Callable[[], nn.Module] | None = None,
) -> Message:
    """Compute the concatenated features of the training split once and cache them in state.

    `make_model` builds one model of the run's architecture, whose layer named by the server
    (``"fedconcat-head"``, default ``classifier``) is the head and the rest the encoder; by
    default the config's ``"model"`` name is built with `concatfl.models.build_model`. Raises
    ValueError when there is neither, or when the model's output is not its head applied to
    the head's input (checked on the first training inputs).
    """
    settings = _settings(message, context)
    factory = make_model or _concatfl_model(str(settings[MODEL_NAME]), data)
    sample = data.normalization(data.x_train[:SPLIT_CHECK_SIZE])
    head = str(settings.get(HEAD_NAME, DEFAULT_HEAD))
    model = ConcatModel.from_factory(factory, int(settings[NUM_ENCODERS]), head, sample)
    encoder_state = message.content.array_records[ENCODERS_KEY].to_torch_state_dict()
    model.encoders.load_state_dict(
        {key[len(ENCODERS_PREFIX) :]: value for key, value in encoder_state.items()}
    )
    device = pick_device(str(settings["device"]))
    model.to(device)
    inputs = data.x_train
    features = torch.cat(
        [
            model.features(data.normalization(inputs[start : start + FEATURE_BATCH_SIZE]).to(device)).cpu()
            for start in range(0, len(inputs), FEATURE_BATCH_SIZE)
        ]
    )
    context.state[STATE_FEATURES] = ArrayRecord(
        {"features": Array(features.numpy()), "labels": Array(data.y_train.numpy())}
    )
    context.state[STATE_CACHE] = ConfigRecord({ENCODERS_ID: str(settings[ENCODERS_ID])})
    metrics = MetricRecord({"num-examples": len(data.y_train), FEATURE_DIM: int(features.shape[1])})
    return Message(RecordDict({"metrics": metrics}), reply_to=message)


def handle_head_training(message: Message, context: Context, data: ClientData) -> Message:
    """Train the received classifier on the cached features, or report a cache miss."""
    settings = _settings(message, context)
    received = message.content.array_records["arrays"]
    cached = cached_features(context, str(settings.get(ENCODERS_ID, "")))
    if cached is None:
        metrics = MetricRecord({"num-examples": len(data.y_train), CACHE_MISS: 1})
        return Message(RecordDict({"arrays": received, "metrics": metrics}), reply_to=message)
    features, labels = cached
    state = received.to_torch_state_dict()
    weight, bias = state[CLASSIFIER_WEIGHT], state[CLASSIFIER_BIAS]
    classifier = nn.Linear(weight.shape[1], weight.shape[0])
    classifier.load_state_dict({"weight": weight, "bias": bias})
    # The partition id (when the node has one) keeps the draw the same for a node across runs.
    node = int(context.node_config.get("partition-id", context.node_id))
    seed = int(settings["seed"]) * 1_000_003 + int(settings.get("server-round", 0)) * 100_003 + node
    loss = train_classifier(
        classifier,
        features,
        labels,
        steps=int(settings[CLASSIFIER_STEPS]),
        batch_size=int(settings["batch-size"]),
        lr=float(settings["lr"]),
        momentum=float(settings["momentum"]),
        weight_decay=float(settings["weight-decay"]),
        generator=torch.Generator().manual_seed(seed % 2**63),
    )
    arrays = ArrayRecord(
        {CLASSIFIER_WEIGHT: classifier.weight.detach(), CLASSIFIER_BIAS: classifier.bias.detach()}
    )
    metrics = MetricRecord({"num-examples": len(labels), "train-loss": loss})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=message)


def cached_features(context: Context, encoders_id: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(features, labels) cached in `context.state` for these encoders, or None (cache miss)."""
    cache = context.state.config_records.get(STATE_CACHE)
    if cache is None or cache.get(ENCODERS_ID) != encoders_id or STATE_FEATURES not in context.state:
        return None
    record = context.state.array_records[STATE_FEATURES]
    return torch.from_numpy(record["features"].numpy()), torch.from_numpy(record["labels"].numpy())


def _concatfl_model(name: str, data: ClientData) -> Callable[[], nn.Module]:
    """A factory of the concatfl architecture `name` for this data's inputs and classes."""
    if not name:
        raise ValueError(
            "handle_features needs make_model: the server names no concatfl architecture (config "
            f"'{MODEL_NAME}' is empty), so pass make_model=<a function building the run's model>"
        )
    return partial(build_model, name, tuple(int(d) for d in data.x_train.shape[1:]), data.num_classes)


def _settings(message: Message, context: Context) -> dict[str, Any]:
    """The message's config over the run config over concatfl's defaults.

    The run config is not validated here (the server did that, and a user's own app may carry
    keys concatfl does not know); a key the server omits keeps its run-config value.
    """
    sent = message.content.config_records.get("config", ConfigRecord())
    return {**RunConfig().as_dict(), **context.run_config, **dict(sent)}
