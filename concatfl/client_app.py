"""concatfl's ClientApp: ordinary Flower train/evaluate handlers on the client's partition.

The partition comes from `context.node_config` (`partition-id`, `num-partitions`), so the same
app runs in simulation and in deployment. Training hyperparameters arrive in the message's
``"config"`` record; any key missing there falls back to the run config. The local objective
(``local-objective``: sgd, fedprox, feddyn, moon, fedrs, fedlc) and SCAFFOLD rounds (a train
message carrying a ``"control"`` ArrayRecord) are described in `concatfl.objectives`; their
client state lives in ``context.state``.
"""

from __future__ import annotations

import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .config import RunConfig
from .fuzz import fuzz_mod
from .local_dp import local_dp_mod
from .fedconcat_client import handle_features, handle_head_training, handle_label_query
from .objectives import CONTROL_KEY, build_objective
from .protocol import FEATURES_ACTION, HEAD_ACTION, IDENTITY_QUERY, LABELS_ACTION, PARTITION_ID_KEY
from .runtime import ClientData, load_client_data, load_data, make_model
from .training import evaluate, pick_device, train

# The fuzzing mod does nothing unless `fuzz-share` > 0 (run or node config): concatfl.fuzz. The
# local DP mod does nothing unless `local-dp-epsilon` > 0: concatfl.local_dp.
app = ClientApp(mods=[fuzz_mod, local_dp_mod])


def client_config(context: Context) -> RunConfig:
    """The validated run config as the client sees it."""
    return RunConfig.from_mapping(context.run_config)


def client_data(context: Context, config: RunConfig) -> ClientData:
    """This node's data, located by its node config."""
    try:
        partition_id = int(context.node_config["partition-id"])
        num_partitions = int(context.node_config["num-partitions"])
    except KeyError as missing:
        raise KeyError(
            f"node config lacks {missing}; start the SuperNode with "
            "--node-config \"partition-id=<i> num-partitions=<N>\""
        ) from None
    return load_client_data(config, partition_id, num_partitions)


def received_model(message: Message, config: RunConfig) -> torch.nn.Module:
    """The run's model with the weights the message carries."""
    model = make_model(config, load_data(config))
    model.load_state_dict(message.content["arrays"].to_torch_state_dict())
    return model


@app.train()
def train_handler(message: Message, context: Context) -> Message:
    """Train the received model with the local objective on the local train split and send it back."""
    config = client_config(context)
    data = client_data(context, config)
    settings = {**config.as_dict(), **dict(message.content.config_records.get("config", {}))}
    device = pick_device(config.device)
    model = received_model(message, config)
    objective = build_objective(
        settings,
        context.state,
        received=lambda: received_model(message, config),
        make_model=lambda: make_model(config, load_data(config)),
        label_counts=data.label_counts(),
        num_examples=len(data.y_train),
        device=device,
        control=message.content.array_records.get(CONTROL_KEY),
    )
    seed = (
        int(settings.get("server-round", 0)) * 100_003
        + int(settings.get("chain-pass", 0)) * 10_000_019
        + int(context.node_config["partition-id"])
    )
    epochs = int(settings["local-epochs"])
    started = time.perf_counter()
    loss = train(
        model,
        data.x_train,
        data.y_train,
        epochs=epochs,
        batch_size=int(settings["batch-size"]),
        lr=float(settings["lr"]),
        momentum=float(settings["momentum"]),
        optimizer=str(settings["optimizer"]),
        weight_decay=float(settings["weight-decay"]),
        normalization=data.normalization,
        device=device,
        generator=torch.Generator().manual_seed(config.seed * 1_000_003 + seed),
        augmentation=data.augmentation,
        regularizer=objective.regularizer,
        loss_fn=objective.loss,
    )
    metrics = MetricRecord(
        {
            "num-examples": len(data.y_train),
            "train-loss": loss,
            "train-seconds": time.perf_counter() - started,
            "local-epochs": epochs,  # lets a strategy check that it got the epochs it asked for
        }
    )
    # SCAFFOLD's finish replaces "arrays" by the model delta and adds "control".
    extra = objective.finish(model)
    records = {"arrays": ArrayRecord(model.cpu().state_dict()), **extra, "metrics": metrics}
    return Message(RecordDict(records), reply_to=message)


@app.evaluate()
def evaluate_handler(message: Message, context: Context) -> Message:
    """Evaluate the received model on the local test split."""
    config = client_config(context)
    data = client_data(context, config)
    loss, accuracy = evaluate(
        received_model(message, config),
        data.x_test,
        data.y_test,
        normalization=data.normalization,
        device=pick_device(config.device),
    )
    metrics = MetricRecord({"num-examples": len(data.y_test), "loss": loss, "accuracy": accuracy})
    return Message(RecordDict({"metrics": metrics}), reply_to=message)


@app.query()
def query_handler(message: Message, context: Context) -> Message:
    """Answer `config["query"]`:

    - `identity` → this node's `partition-id` (the ServerApp's stable id for the node, see
      `concatfl.deployment.grid`);
    - `label-counts` → this client's training label counts: a diagnostic for simulations
      (FedSeq's `report-label-counts`); a deployment that must not reveal label counts simply
      does not enable it on the server.
    """
    asked = message.content.config_records.get("config", {}).get("query")
    if asked == IDENTITY_QUERY:
        partition_id = int(context.node_config[PARTITION_ID_KEY])
        return Message(RecordDict({"metrics": MetricRecord({PARTITION_ID_KEY: partition_id})}), reply_to=message)
    if asked != "label-counts":
        raise ValueError(f"unknown query {asked!r}; this ClientApp answers '{IDENTITY_QUERY}' and 'label-counts'")
    counts = client_data(context, client_config(context)).label_counts()
    return Message(RecordDict({"metrics": MetricRecord({"label-counts": counts.tolist()})}), reply_to=message)


@app.query(LABELS_ACTION)
def fedconcat_label_query(message: Message, context: Context) -> Message:
    """FedConcat stage 1-A: this client's label distribution (Laplace noise when ε is given)."""
    return handle_label_query(message, context, client_data(context, client_config(context)))


@app.train(FEATURES_ACTION)
def fedconcat_features(message: Message, context: Context) -> Message:
    """FedConcat stage 3: cache the features of the received frozen encoders, train the head."""
    config = client_config(context)
    data = client_data(context, config)
    return handle_features(message, context, data, make_model=lambda: make_model(config, load_data(config)))


@app.train(HEAD_ACTION)
def fedconcat_head(message: Message, context: Context) -> Message:
    """FedConcat stage 3: a few SGD steps of the global head on the cached features."""
    return handle_head_training(message, context, client_data(context, client_config(context)))
