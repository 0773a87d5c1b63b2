"""concatfl's Flower strategies, and the registry that builds one from the run config.

Users import the classes (`from concatfl.strategies import FedCat`) and call `start()` from
their own ServerApp exactly like a built-in Flower strategy. concatfl's ServerApp goes through
`build_strategy`, which maps the run-config `strategy` to the module that knows how to build it
(each module exposes `build(config: RunConfig, env: ServerEnv) -> RelayStrategy`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import RelayStrategy
from .fedavg import FedAvg, FedProx
from .feddyn import FedDynServer

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..runtime import ServerEnv

STRATEGY_MODULES = {
    "fedavg": "fedavg",
    "fedprox": "fedavg",
    "scaffold": "scaffold",
    "fedcat": "fedcat",
    "fedseq": "fedseq",
    "fedseq-inter": "fedseq",
    "fedconcat": "fedconcat",
    "fedconcat-id": "fedconcat",
}
# Classes that live in modules importing heavier dependencies are loaded on first use.
_LAZY_CLASSES = {
    "Scaffold": "scaffold",
    "FedCat": "fedcat",
    "FedSeq": "fedseq",
    "FedSeqInter": "fedseq",
    "FedConcat": "fedconcat",
}

__all__ = ["FedAvg", "FedDynServer", "FedProx", "RelayStrategy", "build_strategy", *_LAZY_CLASSES]


def build_strategy(config: RunConfig, env: ServerEnv) -> RelayStrategy:
    """The strategy named by `config.strategy`, configured from the run config."""
    module = importlib.import_module(f"{__name__}.{STRATEGY_MODULES[config.strategy]}")
    return module.build(config, env)


def __getattr__(name: str) -> Any:
    if name in _LAZY_CLASSES:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY_CLASSES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
