"""Pluggable local objectives, and SCAFFOLD's client side: what one train message optimizes.

The run-config key ``local-objective`` (or the message's ``config["local-objective"]``) picks one:

``sgd``      cross-entropy (plus FedProx's term when ``proximal-mu`` > 0, as before this key existed)
``fedprox``  Li et al. 2020: CE + μ/2·‖θ − θ_received‖² (μ = ``proximal-mu`` > 0)
``feddyn``   Acar et al. 2021: CE − ⟨g_k, θ⟩ + α/2·‖θ − θ_received‖², then
             g_k ← g_k − α·(θ_k − θ_received) (α = ``feddyn-alpha``; g_k over the model's
             parameters, kept in ``context.state``; the server's half is
             `concatfl.strategies.feddyn`)
``moon``     Li, He & Song 2021: CE + μ·ℓ_con with ℓ_con = −log(e^{sim(z, z_glob)/τ} /
             (e^{sim(z, z_glob)/τ} + e^{sim(z, z_prev)/τ})), sim = cosine, z the ``encoder``
             output of the model being trained, z_glob of the received model and z_prev of the
             client's previous local model (kept in ``context.state``). concatfl's models have no
             projection head: the projection is the encoder output. Without a previous model
             (first participation, or state lost) the contrastive term is 0, as in MOON's code
             with an empty model pool. (μ = ``moon-mu``, τ = ``moon-tau``)
``fedrs``    Li & Zhan 2021: the logits of classes absent from the local training data are
             multiplied by α before the softmax (α = ``fedrs-alpha``)
``fedlc``    Zhang et al. 2022: logit_c − τ·n_c^(−1/4) before the softmax, n_c the local count of
             class c; an absent class counts as n_c = 1e-8 (offset 100·τ, which all but removes
             it from the softmax; FL-bench's convention) (τ = ``fedlc-tau``)

SCAFFOLD (Karimireddy et al. 2020) is a strategy, not a local objective: a train message that
carries a ``"control"`` ArrayRecord (the server's c) is a SCAFFOLD round. The client adds
⟨c − c_i, θ⟩ to the loss (so every step's gradient is corrected by c − c_i), computes option
II, c_i⁺ = c_i − c + (x − y_i)/(K·η) with K local steps of learning rate η, and replies with
the model delta y_i − x under ``"arrays"`` and Δc_i = c_i⁺ − c_i under ``"control"``. The
server's c = mean of the c_i holds only if a client's c_i moves exactly when the server adds
its Δc_i: so the client keeps Δc_i *pending* and commits it when the server's next message to
it says the reply was taken (``config["scaffold-taken-round"]`` = that reply's round, with
``"scaffold-taken-share"``, the share of Δc_i the server's bound let in); a reply that was
lost, late or rejected leaves c_i as it was.

All client state lives in ``context.state`` (keys below), so it works the same in simulation
and in deployment. State that is missing (a client's first training in the run, or a restarted
SuperNode that lost it) or that does not fit the model starts from zero, with a logged note.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.supercore import log
from torch import nn
from torch.nn import functional as F

from .training import LossFn, Regularizer, proximal_regularizer

OBJECTIVES = ("sgd", "fedprox", "feddyn", "moon", "fedrs", "fedlc")
CONTROL_KEY = "control"
# Where each method keeps its client state in context.state.
FEDDYN_STATE = "feddyn-gradient"
MOON_STATE = "moon-previous"
SCAFFOLD_STATE = "scaffold-control"
SCAFFOLD_PENDING = "scaffold-pending"  # Δc_i of the last reply, until the server says it was taken
SCAFFOLD_PENDING_ROUND = "scaffold-pending-round"  # a ConfigRecord: {"round": that reply's round}
# What a SCAFFOLD message tells the client about its last reply (0: none taken yet).
SCAFFOLD_TAKEN_ROUND = "scaffold-taken-round"
SCAFFOLD_TAKEN_SHARE = "scaffold-taken-share"
# FedLC: the count an absent class is given (n^(-1/4) = 100).
FEDLC_MIN_COUNT = 1e-8

Tensors = dict[str, torch.Tensor]


# ---------------------------------------------------------------------- pure maths
def fedrs_logits(logits: torch.Tensor, present: torch.Tensor, alpha: float) -> torch.Tensor:
    """FedRS's restricted softmax input: logits of absent classes (``present`` False) times α.

    `logits` is (B, C), `present` a (C,) bool mask of the classes in the local data.
    """
    scale = torch.where(present, torch.ones_like(logits[0]), torch.full_like(logits[0], alpha))
    return logits * scale


def fedlc_logits(logits: torch.Tensor, counts: torch.Tensor, tau: float) -> torch.Tensor:
    """FedLC's calibrated logits: logit_c − τ·n_c^(−1/4), with n_c floored at `FEDLC_MIN_COUNT`.

    `counts` is the (C,) local label count of each class.
    """
    return logits - tau * counts.to(logits.dtype).clamp(min=FEDLC_MIN_COUNT).pow(-0.25)


def moon_contrastive(
    z: torch.Tensor, z_global: torch.Tensor, z_previous: torch.Tensor | None, tau: float
) -> torch.Tensor:
    """MOON's ℓ_con averaged over the batch (0 without a previous model, which gives no negative).

    `z`, `z_global`, `z_previous` are (B, d) representations of the same inputs under the model
    being trained, the received global model and the client's previous local model.
    """
    positive = F.cosine_similarity(z, z_global, dim=1) / tau
    if z_previous is None:
        return torch.zeros((), dtype=z.dtype, device=z.device)
    negative = F.cosine_similarity(z, z_previous, dim=1) / tau
    logits = torch.stack([positive, negative], dim=1)
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def linear_term(model: nn.Module, vectors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """⟨v, θ⟩ summed over the model's parameters named in `vectors` (its gradient is v)."""
    terms = [torch.sum(param * vectors[name]) for name, param in model.named_parameters() if name in vectors]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def feddyn_gradient_update(
    gradient: Mapping[str, np.ndarray],
    trained: Mapping[str, np.ndarray],
    received: Mapping[str, np.ndarray],
    alpha: float,
) -> dict[str, np.ndarray]:
    """FedDyn's client state after training: g_k − α·(θ_k − θ_received), key by key."""
    return {key: gradient[key] - alpha * (trained[key] - received[key]) for key in gradient}


def local_steps(num_examples: int, batch_size: int, epochs: int) -> int:
    """K, the number of SGD steps `training.train` takes (the last batch of an epoch may be short)."""
    return epochs * math.ceil(num_examples / batch_size)


def momentum_step_sum(steps: int, momentum: float) -> float:
    """How many gradients' worth of learning rate K heavy-ball steps move the parameters by
    under a constant gradient: Σ_{t=1..K} (1 − β^t)/(1 − β), which is K when β = 0.

    PyTorch's SGD starts its momentum buffer at the first gradient, so step t moves by
    η·g·(1 − β^t)/(1 − β).
    """
    if momentum == 0:
        return float(steps)
    return (steps - momentum * (1 - momentum**steps) / (1 - momentum)) / (1 - momentum)


def scaffold_control_update(
    client_control: Mapping[str, np.ndarray],
    server_control: Mapping[str, np.ndarray],
    sent: Mapping[str, np.ndarray],
    trained: Mapping[str, np.ndarray],
    steps: int,
    lr: float,
    momentum: float = 0.0,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """SCAFFOLD option II: (c_i⁺, Δc_i) with c_i⁺ = c_i − c + (x − y_i)/(K·η) and Δc_i = c_i⁺ − c_i.

    `sent` is the model x the client received, `trained` its model y_i after K = `steps` local
    steps of learning rate η = `lr`; the dicts hold the control keys (the model's parameters).
    With SGD momentum β the K of (x − y_i)/(K·η) becomes `momentum_step_sum(K, β)`, so that
    c_i⁺ stays the client's mean gradient: the paper's K counts plain SGD steps, and with
    β = 0.9 dividing by it makes c_i about ten times the gradient and the corrected local
    training diverge.
    """
    scale = momentum_step_sum(steps, momentum) * lr
    updated = {
        key: client_control[key] - server_control[key] + (sent[key] - trained[key]) / scale for key in server_control
    }
    return updated, {key: updated[key] - client_control[key] for key in server_control}


# ---------------------------------------------------------------------- objectives
def _no_state(model: nn.Module) -> dict[str, ArrayRecord]:
    return {}


@dataclass
class LocalObjective:
    """One train message's objective for `training.train`, and its state update afterwards.

    `loss(model, inputs, targets)` is the batch loss (None: cross-entropy) and
    `regularizer(model)` is added to it;
    `finish(trained_model)` updates ``context.state`` and returns records that go into the reply
    (SCAFFOLD's ``"arrays"`` delta and ``"control"``; nothing for the others).
    """

    name: str
    loss: LossFn | None = None
    regularizer: Regularizer | None = None
    finish: Callable[[nn.Module], dict[str, ArrayRecord]] = field(default=_no_state)


def build_objective(
    settings: Mapping[str, Any],
    state: RecordDict,
    received: Callable[[], nn.Module],
    make_model: Callable[[], nn.Module],
    label_counts: np.ndarray,
    num_examples: int,
    device: torch.device,
    control: ArrayRecord | None = None,
) -> LocalObjective:
    """The objective a train message asks for.

    Parameters
    ----------
    settings : Mapping[str, Any]
        The message's config over the run config: ``local-objective``, ``proximal-mu``,
        ``feddyn-alpha``, ``moon-mu``, ``moon-tau``, ``fedrs-alpha``, ``fedlc-tau``, and for
        SCAFFOLD ``lr``, ``momentum``, ``batch-size``, ``local-epochs``.
    state : RecordDict
        The client's ``context.state``; read now and written by `finish`.
    received : Callable[[], nn.Module]
        Builds a copy of the model the message carried (θ_received / x). Called only by the
        objectives that keep one (FedProx's term, FedDyn, MOON, SCAFFOLD), which freeze it and
        move it to `device`; plain SGD, FedRS and FedLC never build it.
    make_model : Callable[[], nn.Module]
        A fresh model of the run's architecture (MOON rebuilds the previous local model in it).
    label_counts : np.ndarray
        The local training split's count of each class (FedRS, FedLC).
    num_examples : int
        Size of the local training split (SCAFFOLD's K).
    device : torch.device
        Where training runs.
    control : ArrayRecord | None
        The server's control variate c: present only in SCAFFOLD rounds.
    """
    name = str(settings["local-objective"])
    if name not in OBJECTIVES:
        raise ValueError(f"unknown local-objective {name!r}; allowed: {', '.join(OBJECTIVES)}")
    mu = float(settings["proximal-mu"])

    def frozen_received() -> nn.Module:
        return received().to(device).eval().requires_grad_(False)

    if control is not None:
        if name != "sgd" or mu > 0:
            raise ValueError("a SCAFFOLD round corrects the gradients itself: use local-objective='sgd', proximal-mu=0")
        steps = local_steps(num_examples, int(settings["batch-size"]), int(settings["local-epochs"]))
        lr, momentum = float(settings["lr"]), float(settings["momentum"])
        commit_scaffold_control(
            state, int(settings.get(SCAFFOLD_TAKEN_ROUND, 0)), float(settings.get(SCAFFOLD_TAKEN_SHARE, 1.0))
        )
        return _scaffold(state, frozen_received(), control, steps, lr, momentum, device, int(settings.get("server-round", 0)))
    if mu > 0 and name not in ("sgd", "fedprox"):
        raise ValueError(f"proximal-mu > 0 is FedProx's weight; it does not combine with local-objective={name!r}")
    if name == "fedprox" and mu <= 0:
        raise ValueError("local-objective='fedprox' needs proximal-mu > 0")
    if name in ("sgd", "fedprox"):
        return LocalObjective(name, regularizer=proximal_regularizer(frozen_received(), mu) if mu > 0 else None)
    if name == "feddyn":
        return _feddyn(state, frozen_received(), float(settings["feddyn-alpha"]), device)
    if name == "moon":
        mu_moon, tau = float(settings["moon-mu"]), float(settings["moon-tau"])
        return _moon(state, frozen_received(), make_model, mu_moon, tau, device)
    if name == "fedrs":
        present = torch.as_tensor(label_counts > 0, device=device)
        alpha = float(settings["fedrs-alpha"])
        return LocalObjective(
            name, loss=lambda model, x, y: F.cross_entropy(fedrs_logits(model(x), present, alpha), y)
        )
    counts = torch.as_tensor(label_counts, dtype=torch.float32, device=device)
    tau = float(settings["fedlc-tau"])
    return LocalObjective(name, loss=lambda model, x, y: F.cross_entropy(fedlc_logits(model(x), counts, tau), y))


def _feddyn(state: RecordDict, received: nn.Module, alpha: float, device: torch.device) -> LocalObjective:
    anchors = _parameters(received)
    gradient = _load_vectors(state, FEDDYN_STATE, anchors, "FedDyn g_k", device)
    negated = {key: -value for key, value in gradient.items()}
    proximal = proximal_regularizer(received, alpha)

    def regularizer(model: nn.Module) -> torch.Tensor:
        return linear_term(model, negated) + proximal(model)

    def finish(model: nn.Module) -> dict[str, ArrayRecord]:
        updated = feddyn_gradient_update(_numpy(gradient), _numpy(_parameters(model)), _numpy(anchors), alpha)
        state[FEDDYN_STATE] = _record(updated)
        return {}

    return LocalObjective("feddyn", regularizer=regularizer, finish=finish)


def _moon(
    state: RecordDict,
    received: nn.Module,
    make_model: Callable[[], nn.Module],
    mu: float,
    tau: float,
    device: torch.device,
) -> LocalObjective:
    previous: nn.Module | None = None
    saved = state.array_records.get(MOON_STATE)
    if saved is None:
        _note_missing("MOON's previous local model", "the contrastive term is 0 this time")
    else:
        previous = make_model()
        previous.load_state_dict(saved.to_torch_state_dict())
        previous.to(device).eval().requires_grad_(False)

    def loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        z = model.encoder(inputs)
        with torch.no_grad():
            z_global = received.encoder(inputs)
            z_previous = previous.encoder(inputs) if previous is not None else None
        return F.cross_entropy(model.classifier(z), targets) + mu * moon_contrastive(z, z_global, z_previous, tau)

    def finish(model: nn.Module) -> dict[str, ArrayRecord]:
        state[MOON_STATE] = _record({key: value.detach() for key, value in model.state_dict().items()})
        return {}

    return LocalObjective("moon", loss=loss, finish=finish)


def commit_scaffold_control(state: RecordDict, taken_round: int, share: float) -> bool:
    """Settle the pending Δc_i of the client's last SCAFFOLD reply: c_i ← c_i + share·Δc_i when
    the server took that reply (`taken_round` is its round), else drop it (the reply was lost,
    late or rejected: the server's c never saw it). Returns whether c_i moved."""
    pending = state.array_records.get(SCAFFOLD_PENDING)
    marker = state.config_records.get(SCAFFOLD_PENDING_ROUND)
    if pending is None or marker is None:
        return False
    del state[SCAFFOLD_PENDING], state[SCAFFOLD_PENDING_ROUND]
    if int(marker["round"]) != taken_round:
        log(INFO, "SCAFFOLD: the server did not take this client's reply of round %s; c_i stays", marker["round"])
        return False
    delta = {key: array.numpy() for key, array in pending.items()}
    committed = state.array_records.get(SCAFFOLD_STATE)
    base = {key: committed[key].numpy() for key in delta} if committed is not None else {k: np.zeros_like(v) for k, v in delta.items()}
    state[SCAFFOLD_STATE] = _record({key: base[key] + share * delta[key] for key in delta})
    return True


# pylint: disable=too-many-arguments
def _scaffold(
    state: RecordDict,
    received: nn.Module,
    control: ArrayRecord,
    steps: int,
    lr: float,
    momentum: float,
    device: torch.device,
    server_round: int,
) -> LocalObjective:
    server = {key: torch.from_numpy(array.numpy().copy()).to(device) for key, array in control.items()}
    mine = _load_vectors(state, SCAFFOLD_STATE, server, "SCAFFOLD's control variate c_i", device)
    correction = {key: server[key] - mine[key] for key in server}
    sent = _numpy(received.state_dict())

    def finish(model: nn.Module) -> dict[str, ArrayRecord]:
        trained = _numpy(model.state_dict())
        _, delta = scaffold_control_update(_numpy(mine), _numpy(server), sent, trained, steps, lr, momentum)
        state[SCAFFOLD_PENDING] = _record(delta)
        state[SCAFFOLD_PENDING_ROUND] = ConfigRecord({"round": server_round})
        model_delta = {key: trained[key] - sent[key] for key in sent}
        return {"arrays": _record(model_delta), CONTROL_KEY: _record(delta)}

    return LocalObjective("scaffold", regularizer=lambda model: linear_term(model, correction), finish=finish)


# ---------------------------------------------------------------------- state helpers
def _parameters(model: nn.Module) -> Tensors:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _load_vectors(state: RecordDict, key: str, like: Tensors, what: str, device: torch.device) -> Tensors:
    """The tensors saved under `key`, or zeros shaped like `like` (with a logged note)."""
    saved = state.array_records.get(key)
    if saved is None:
        _note_missing(what, "starting from zero")
    elif set(saved.keys()) != set(like) or any(tuple(saved[k].shape) != tuple(like[k].shape) for k in like):
        log(WARNING, "%s in context.state does not fit the model; starting from zero", what)
    else:
        return {k: torch.from_numpy(saved[k].numpy().copy()).to(device=device, dtype=like[k].dtype) for k in like}
    return {k: torch.zeros_like(value, device=device) for k, value in like.items()}


def _note_missing(what: str, consequence: str) -> None:
    log(INFO, "No %s in context.state (first training of this client, or lost in a restart): %s", what, consequence)


def _numpy(tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """CPU copies (not views: the module keeps training in place)."""
    return {key: value.detach().cpu().numpy().copy() for key, value in tensors.items()}


def _record(values: Mapping[str, torch.Tensor | np.ndarray]) -> ArrayRecord:
    arrays = {
        key: np.ascontiguousarray(value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value)
        for key, value in values.items()
    }
    return ArrayRecord({key: Array(value) for key, value in arrays.items()})
