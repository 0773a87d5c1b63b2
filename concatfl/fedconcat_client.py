"""FedConcat's client side: the three message handlers beyond ordinary training, and the protocol.

FedConcat-ID's stage 1 and both variants' stage 2 are ordinary ``"train"`` messages. The rest
of the protocol (all keys are constants below; the server side is
`concatfl.strategies.fedconcat.FedConcat`):

``"query.fedconcat_labels"`` — stage 1-A, the label distribution (`handle_label_query`)
    in:  ``"config"``: {``"fedconcat-dp-epsilon"``: ε (0 = no noise)}
    out: ``"metrics"``: {``"label-distribution"``: [P(y=0), …, P(y=m-1)]} and nothing else (not
    even N, which with P would give the label counts). With ε > 0 each entry gets Laplace(0, 1/ε)
    noise drawn from the OS's entropy, never from a seed the server knows (the server could
    otherwise subtract the noise).

``"train.fedconcat_features"`` — stage 3, the one broadcast of the frozen encoders (`handle_features`)
    in:  ``"encoders"``: ArrayRecord with the ConcatModel's ``encoders.<k>.*`` weights (under a
         key other than ``"arrays"`` because the reply returns no model);
         ``"config"``: {``"model"``: architecture name, ``"num-encoders"``: K,
         ``"encoders-id"``: a fingerprint of the weights}.
    The client computes the concatenated features of its whole training split once (encoders in
    eval mode, no augmentation), keeps features, labels and the fingerprint in ``context.state``
    and answers ``"metrics"``: {``"num-examples"``: N, ``"feature-dim"``: K·d}.

``"train.fedconcat_head"`` — stage 3, one classifier round (`handle_head_training`)
    in:  ``"arrays"``: the classifier (``classifier.weight``, ``classifier.bias``);
         ``"config"``: {``"encoders-id"``, ``"fedconcat-classifier-steps"``, ``"lr"``,
         ``"batch-size"``, ``"momentum"``, ``"weight-decay"``, ``"server-round"``}; a missing
         hyperparameter falls back to the run config (then concatfl's default), as for
         ordinary training.
    out: ``"arrays"``: the classifier after that many SGD steps on the cached features,
         ``"metrics"``: {``"num-examples"``: N, ``"train-loss"``}.
    Cache miss (state lost on a restart, or cached for other encoders): the reply carries the
    classifier unchanged and ``"metrics"``: {``"num-examples"``: N, ``"fedconcat-cache-miss"``: 1};
    the server then sends the encoders again. The echo keeps the reply valid for the shared
    reply validation (which requires the model that was sent) and costs one classifier upload.

What a user's own ClientApp adds to support FedConcat (FedConcat-ID needs only the last two)::

    @app.query(LABELS_ACTION)
    def query(msg, ctx): return handle_label_query(msg, ctx, my_client_data(ctx))
    @app.train(FEATURES_ACTION)
    def features(msg, ctx): return handle_features(msg, ctx, my_client_data(ctx), make_model=my_model)
    @app.train(HEAD_ACTION)
    def head(msg, ctx): return handle_head_training(msg, ctx, my_client_data(ctx))

where ``my_client_data`` returns a `concatfl.runtime.ClientData` and ``my_model`` builds the run's
model (a `concatfl.models.SplitModel`; it may be omitted for concatfl's own architectures).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from torch import nn

from .config import RunConfig
from .core.clustering import label_distribution, laplace_noise
from .core.concat import CLASSIFIER_BIAS, CLASSIFIER_WEIGHT, ENCODERS_PREFIX, ConcatModel, train_classifier
from .models import build_model
from .training import pick_device

if TYPE_CHECKING:
    from .runtime import ClientData

# Message types: Flower routes "<category>.<action>" to @app.<category>("<action>"); named actions
# leave a ClientApp's default query/train handlers free for other uses.
LABELS_ACTION = "fedconcat_labels"
FEATURES_ACTION = "fedconcat_features"
HEAD_ACTION = "fedconcat_head"
LABELS_MESSAGE_TYPE = f"{MessageType.QUERY}.{LABELS_ACTION}"
FEATURES_MESSAGE_TYPE = f"{MessageType.TRAIN}.{FEATURES_ACTION}"
HEAD_MESSAGE_TYPE = f"{MessageType.TRAIN}.{HEAD_ACTION}"

# Record and config keys.
ENCODERS_KEY = "encoders"
LABEL_DISTRIBUTION = "label-distribution"
DP_EPSILON = "fedconcat-dp-epsilon"
MODEL_NAME = "model"
NUM_ENCODERS = "num-encoders"
ENCODERS_ID = "encoders-id"
CLASSIFIER_STEPS = "fedconcat-classifier-steps"
FEATURE_DIM = "feature-dim"
CACHE_MISS = "fedconcat-cache-miss"
# Where the features live in context.state (features + labels, and the encoders they came from).
STATE_FEATURES = "fedconcat-features"
STATE_CACHE = "fedconcat-cache"

FEATURE_BATCH_SIZE = 512


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

    `make_model` builds one model of the run's architecture (its ``encoder`` is used); by
    default the config's ``"model"`` name is built with `concatfl.models.build_model`.
    """
    settings = _settings(message, context)
    channels, height, width = (int(d) for d in data.x_train.shape[1:])
    shape = (channels, height, width)
    factory = make_model or partial(build_model, str(settings[MODEL_NAME]), shape, data.num_classes)
    model = ConcatModel.from_factory(factory, int(settings[NUM_ENCODERS]))
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


def _settings(message: Message, context: Context) -> dict[str, Any]:
    """The message's config over the run config over concatfl's defaults.

    The run config is not validated here (the server did that, and a user's own app may carry
    keys concatfl does not know); a key the server omits keeps its run-config value.
    """
    sent = message.content.config_records.get("config", ConfigRecord())
    return {**RunConfig().as_dict(), **context.run_config, **dict(sent)}
