"""FedDyn's server half (Acar et al. 2021), shared by FedAvg, FedCat, FedSeq/FedSeqInter and FedConcat.

The clients' half (the linear and proximal terms, g_k) is `concatfl.objectives`. The server
keeps h (initially 0) and, whenever a strategy forms a new global model from the models P
trained since the previous one θ_prev:

    h ← h − (α/m)·Σ_{k∈P}(θ_k − θ_prev)        θ = mean_{k∈P}(θ_k) − h/α

with m the number of FedDyn "clients" the strategy has: the connected nodes for FedAvg, the K
copies for FedCat, the superclients for FedSeq, the slots for FedSeqInter and, in FedConcat's
encoder stage, the members of each cluster (one h per cluster). The mean is each strategy's
own average: the plain mean for FedAvg (as in the FedDyn paper), the data-size weighted average
of copies / superclients / slots / cluster members for FedCat, FedSeq and FedConcat (their
papers'). h covers the model's parameters only (the keys the clients' g_k cover); buffers such
as BatchNorm statistics are averaged as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from .common import to_numpy, to_record

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..runtime import ServerEnv

State = dict[str, np.ndarray]


def feddyn_server_update(
    previous: Mapping[str, np.ndarray],
    models: Sequence[Mapping[str, np.ndarray]],
    average: Mapping[str, np.ndarray],
    h: Mapping[str, np.ndarray],
    alpha: float,
    num_clients: int,
) -> tuple[State, State]:
    """(new global model, new h) per FedDyn's server step; keys outside `h` keep `average`.

    `previous` is θ_prev, `models` the θ_k of P, `average` their mean as the strategy forms it,
    `h` the current h (its keys are the corrected ones), `num_clients` m.
    """
    new_h = {
        key: (h[key] - (alpha / num_clients) * sum(model[key].astype(np.float64) - previous[key] for model in models))
        .astype(h[key].dtype)
        for key in h
    }
    model = {
        key: (value - new_h[key] / alpha).astype(value.dtype) if key in new_h else value
        for key, value in average.items()
    }
    return model, new_h


def parameter_names(make_model: Callable[[], nn.Module]) -> list[str]:
    """Names of the model's trainable parameters (not its buffers), without touching torch's RNG."""
    with torch.random.fork_rng(devices=[]):
        return [name for name, _ in make_model().named_parameters()]


class FedDynServer:
    """The server's FedDyn state h and step, for a strategy to call when it forms a global model.

    Parameters
    ----------
    alpha : float
        α (run-config `feddyn-alpha`), sent to the clients with ``local-objective='feddyn'``.
    keys : Sequence[str] | None (default: None)
        The arrays h covers: the model's parameters (`parameter_names`). None: every
        floating-point array of the first model seen.
    """

    def __init__(self, alpha: float, keys: Sequence[str] | None = None) -> None:
        if not alpha > 0:
            raise ValueError(f"FedDyn's alpha must be > 0, got {alpha}")
        self.alpha = alpha
        self.keys = None if keys is None else list(keys)
        self.h: State = {}

    def __repr__(self) -> str:
        return f"FedDynServer(alpha={self.alpha})"

    def settings(self) -> dict[str, Any]:
        """What the train messages must carry so the clients run FedDyn's objective."""
        return {"local-objective": "feddyn", "feddyn-alpha": self.alpha}

    def step(
        self, previous: ArrayRecord, models: Sequence[Mapping[str, np.ndarray]], average: ArrayRecord, num_clients: int
    ) -> ArrayRecord:
        """Update h from the `models` (numpy arrays by key) trained since `previous` and return
        the corrected global model."""
        before = to_numpy(previous)
        if not self.h:
            keys = self.keys or [k for k, v in before.items() if np.issubdtype(v.dtype, np.floating)]
            self.h = {key: np.zeros_like(before[key]) for key in keys}
        model, self.h = feddyn_server_update(
            before, list(models), to_numpy(average), self.h, self.alpha, num_clients
        )
        return to_record(model)

    @property
    def h_norm(self) -> float:
        """‖h‖ (recorded each aggregation to follow the correction)."""
        return float(np.sqrt(sum(float((value.astype(np.float64) ** 2).sum()) for value in self.h.values())))

    def state_dict(self) -> dict[str, Any]:
        """h as numpy arrays."""
        return {"h": {key: value.copy() for key, value in self.h.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.h = {key: np.asarray(value) for key, value in state["h"].items()}


def from_config(config: RunConfig, env: ServerEnv) -> FedDynServer | None:
    """The FedDyn server piece when the run's `local-objective` is `feddyn`, else None."""
    if config.local_objective != "feddyn":
        return None
    return FedDynServer(config.feddyn_alpha, parameter_names(env.make_model))
