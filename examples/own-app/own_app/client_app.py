"""The ClientApp: Flower's quickstart pattern. It knows nothing about concatfl: it trains the
model it receives and sends it back with its number of examples."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from own_app.task import Net, load_partition, train

app = ClientApp()


@app.train()
def train_handler(msg: Message, context: Context) -> Message:
    """Train the received model on the local partition."""
    torch.set_num_threads(1)
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loader = load_partition(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    # As in Flower's quickstart, the epochs come from the app's run config, the learning rate
    # from the server's message.
    epochs = int(context.run_config["local-epochs"])
    loss = train(net, loader, epochs, float(msg.content["config"]["lr"]))
    metrics = MetricRecord(
        {"train_loss": loss, "num-examples": len(loader.dataset), "local-epochs": epochs}  # local-epochs: optional
    )
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)
