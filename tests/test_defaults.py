"""One default per knob: a strategy built from the run config's defaults is the strategy its class
builds by default (the run config only adds what comes from the run's data and model)."""

from __future__ import annotations

import inspect

import pytest

from concatfl.config import DEFAULT_ROUND_TIMEOUT, FEDPROX_DEFAULT_MU, RunConfig
from concatfl.runtime import ServerEnv
from concatfl.strategies import FedAvg, FedProx, build_strategy
from concatfl.strategies.base import RelayStrategy
from concatfl.strategies.fedcat import FedCat
from concatfl.strategies.fedconcat import FedConcat
from concatfl.strategies.fedseq import FedSeq, FedSeqInter
from concatfl.strategies.scaffold import Scaffold

ENV = ServerEnv.from_config(RunConfig())
# Taken from the run's data and model, not knobs: what the class cannot know by itself.
FROM_THE_RUN = {
    "self", "control_keys", "model_name", "input_shape", "output_path", "device", "label_inference", "make_model",
    "evaluate_model", "normalization",
}
POOL = (ENV.data.x_test, ENV.data.y_test)
CLASS_DEFAULTS = {
    "fedavg": lambda: FedAvg(),
    "fedprox": lambda: FedProx(),
    "scaffold": lambda: Scaffold(),
    "fedcat": lambda: FedCat(),
    "fedseq": lambda: FedSeq(ENV.make_model, ENV.num_classes, exemplar_pool=POOL),
    "fedseq-inter": lambda: FedSeqInter(ENV.make_model, ENV.num_classes, exemplar_pool=POOL),
    "fedconcat": lambda: FedConcat(make_model=ENV.make_model, input_shape=(1, 8, 8)),
    "fedconcat-id": lambda: FedConcat(label_inference=True, make_model=ENV.make_model, input_shape=(1, 8, 8)),
}


def knobs(strategy: RelayStrategy) -> dict[str, str]:
    """The strategy's constructor parameters as it holds them (callables left out)."""
    values = {}
    for klass in type(strategy).__mro__:
        if "__init__" not in vars(klass) or not issubclass(klass, RelayStrategy):
            continue
        for name in inspect.signature(klass.__init__).parameters:
            value = getattr(strategy, name, None)
            if name not in FROM_THE_RUN and not callable(value):
                values.setdefault(name, repr(value))
    return values


@pytest.mark.parametrize("name", list(CLASS_DEFAULTS))
def test_the_run_configs_defaults_build_the_class_default(name):
    from_config = build_strategy(RunConfig.from_mapping({"strategy": name}), ENV)
    by_class = CLASS_DEFAULTS[name]()
    # A class built without round_timeout waits what `start()` waits: the run config's default.
    assert by_class.round_timeout is None and from_config.round_timeout == DEFAULT_ROUND_TIMEOUT
    expected = {**knobs(by_class), "round_timeout": repr(DEFAULT_ROUND_TIMEOUT)}
    assert knobs(from_config) == expected
    assert inspect.signature(RelayStrategy.start).parameters["timeout"].default == DEFAULT_ROUND_TIMEOUT


def test_fedprox_takes_its_class_default_mu_when_the_key_is_left_at_zero():
    assert RunConfig.from_mapping({"strategy": "fedprox"}).proximal_mu == FEDPROX_DEFAULT_MU == FedProx().proximal_mu
    assert RunConfig.from_mapping({"local-objective": "fedprox"}).proximal_mu == FEDPROX_DEFAULT_MU
    assert RunConfig.from_mapping({"strategy": "fedprox", "proximal-mu": 0.1}).proximal_mu == 0.1
    assert RunConfig.from_mapping({}).proximal_mu == 0.0  # plain FedAvg keeps no proximal term
