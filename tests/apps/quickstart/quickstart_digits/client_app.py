"""The ClientApp: ordinary training of `Net`, plus the three FedConcat handlers from concatfl."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from concatfl.fedconcat_client import handle_features, handle_head_training, handle_label_query
from concatfl.fuzz import fuzz_mod
from concatfl.local_dp import local_dp_mod
from concatfl.protocol import FEATURES_ACTION, HEAD_ACTION, LABELS_ACTION
from concatfl.runtime import ClientData

from .task import NUM_CLASSES, load_data, load_image_data, model_of
from .task import train as train_fn

# Both off by default: fuzz_mod replaces replies (fuzz-share > 0) for the server's tests;
# local_dp_mod is Flower's LocalDpMod with the run config's local-dp-epsilon, -delta and -clip.
app = ClientApp(mods=[fuzz_mod, local_dp_mod])


def local_data(context: Context):
    """This node's training split, located by its node config."""
    partition, partitions = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    if context.run_config["dataset"] == "digits":
        return load_data(partition, partitions)
    return load_image_data(context.run_config, partition, partitions)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model on the local data: every FedCat and FedSeq message, FedConcat's
    encoder rounds and FedConcat-ID's first round are such ordinary train messages."""
    model = model_of(context.run_config)[0]()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = local_data(context)
    config = msg.content["config"]
    seed = int(config.get("server-round", 0)) * 1000 + int(context.node_config["partition-id"])
    loss = train_fn(
        model,
        x,
        y,
        int(context.run_config["local-epochs"]),
        float(config["lr"]),
        seed,
        momentum=float(context.run_config["momentum"]),
        batch_size=int(context.run_config["batch-size"]),
        optimizer_name=str(context.run_config["optimizer"]),
    )
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(y)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


def fedconcat_data(context: Context) -> ClientData:
    """The training split as FedConcat's handlers read it (inputs already as `Net` takes them)."""
    x, y = local_data(context)
    return ClientData.from_train_split(x, y, NUM_CLASSES)


@app.query(LABELS_ACTION)
def label_query(msg: Message, context: Context) -> Message:
    return handle_label_query(msg, context, fedconcat_data(context))


@app.train(FEATURES_ACTION)
def features(msg: Message, context: Context) -> Message:
    return handle_features(msg, context, fedconcat_data(context), make_model=model_of(context.run_config)[0])


@app.train(HEAD_ACTION)
def head(msg: Message, context: Context) -> Message:
    return handle_head_training(msg, context, fedconcat_data(context))
