"""Flower's `LocalDpMod` on concatfl's own ClientApp, switched on by the run config.

``local-dp-epsilon``  ε > 0 turns it on (default 0: off)
``local-dp-delta``    δ (default 1e-5)
``local-dp-clip``     C, the clipping norm, also taken as the sensitivity (default 1.0)

Every reply that carries a model (ordinary training: every FedAvg, FedProx, FedCat and FedSeq
message, FedConcat's encoder rounds and FedConcat-ID's label-inference round; and FedConcat's head
training) goes through Flower's ``LocalDpMod(clipping_norm=C, sensitivity=C, epsilon=ε,
delta=δ)``: its update is clipped to length C around the model the client received and every
number gets Gaussian noise of standard deviation C·√(2·ln(1.25/δ))/ε before the reply leaves the
client. Queries, FedConcat's feature broadcast and evaluations pass untouched: their replies carry
no model (FedConcat's label distributions have their own ε, ``fedconcat-dp-epsilon``). SCAFFOLD's
messages carry two ArrayRecords, which LocalDpMod refuses; the run config refuses the combination
(`concatfl.config`). docs/privacy.md says what this protects in each strategy.

A user's own ClientApp gets the same with Flower's mod on its train handlers:
``@app.train(mods=[LocalDpMod(...)])`` (and ``@app.train(HEAD_ACTION, mods=[...])`` for FedConcat).
"""

from __future__ import annotations

from flwr.app import Context, Message, MessageType
from flwr.clientapp.mod import LocalDpMod
from flwr.clientapp.typing import ClientAppCallable

from .protocol import HEAD_MESSAGE_TYPE

EPSILON_KEY, DELTA_KEY, CLIP_KEY = "local-dp-epsilon", "local-dp-delta", "local-dp-clip"
DEFAULT_DELTA = 1e-5
DEFAULT_CLIP = 1.0
MODEL_REPLIES = (MessageType.TRAIN, HEAD_MESSAGE_TYPE)  # the messages whose replies carry a model


def local_dp_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's LocalDpMod with the run config's ε, δ and C on the messages whose replies carry a
    model; every message as it is while ``local-dp-epsilon`` is 0."""
    config = context.run_config
    epsilon = float(config.get(EPSILON_KEY, 0.0))
    if epsilon <= 0 or message.metadata.message_type not in MODEL_REPLIES:
        return call_next(message, context)
    clip = float(config.get(CLIP_KEY, DEFAULT_CLIP))
    delta = float(config.get(DELTA_KEY, DEFAULT_DELTA))
    return LocalDpMod(clipping_norm=clip, sensitivity=clip, epsilon=epsilon, delta=delta)(message, context, call_next)
