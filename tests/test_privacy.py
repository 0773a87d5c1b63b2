"""Flower's DP wrappers and mods around concatfl's strategies (docs/privacy.md).

Every combination the table calls "works" runs end to end on the user-style digits app of
tests/apps/quickstart (in-process, NODES nodes, a few rounds), and the test reads back the
accounting Flower reports (its log lines of noise and clipping, `privacy_spent()`); every refused
one raises its message before any message is sent; the clipping rule `privacy` adds and the
explanations of the mods' errors are tested on their own.
"""

from __future__ import annotations

import logging
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod, adaptiveclipping_mod, fixedclipping_mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, compute_clip_model_update, compute_stdv
from flwr.supercore.privacy_accounting import SamplingMethod

from concatfl.config import ConfigError, RunConfig
from concatfl.local_dp import local_dp_mod
from concatfl.protocol import FEATURES_ACTION, HEAD_ACTION, HEAD_MESSAGE_TYPE, LABELS_ACTION
from concatfl.runtime import ServerEnv
from concatfl.strategies import FedAvg, FedProx, build_strategy
from concatfl.strategies.fedcat import FedCat
from concatfl.strategies.fedconcat import FedConcat
from concatfl.strategies.feddyn import FedDynServer
from concatfl.strategies.fedseq import FedSeq, FedSeqInter
from concatfl.strategies.privacy import clip_update, driving_wrapper, mod_explanation
from concatfl.strategies.scaffold import Scaffold
from tests.fakes import BIG_IDS, FakeGrid, reply_with
from tests.user_app import RUN_CONFIG, fixture_app  # noqa: F401  (fixture)

NODES = 4
ROUNDS = 2
Z, C = 0.1, 10.0  # the noise multiplier and clipping norm
LOCAL = {"clipping_norm": 1.0, "sensitivity": 1.0, "epsilon": 50.0, "delta": 1e-5}
LOCAL_STD = LOCAL["sensitivity"] * math.sqrt(2 * math.log(1.25 / LOCAL["delta"])) / LOCAL["epsilon"]
TRAIN_CONFIG = {"lr": 0.1}

WRAPPERS = {
    "server-fixed": (lambda s: DifferentialPrivacyServerSideFixedClipping(s, Z, C, NODES), None),
    "client-fixed": (lambda s: DifferentialPrivacyClientSideFixedClipping(s, Z, C, NODES), fixedclipping_mod),
    "server-adaptive": (
        lambda s: DifferentialPrivacyServerSideAdaptiveClipping(s, Z, NODES, initial_clipping_norm=C), None
    ),
    "client-adaptive": (
        lambda s: DifferentialPrivacyClientSideAdaptiveClipping(s, Z, NODES, initial_clipping_norm=C),
        adaptiveclipping_mod,
    ),
}


def _strategies(net):
    """Each strategy of the table, small enough for a few rounds on NODES digits clients."""
    fedconcat = {"head": "fc3", "num_clusters": 2, "encoder_rounds": 1, "classifier_rounds": 2,
                 "make_model": net, "input_shape": (64,), "head_check": False}
    fedseq = {"pretrain_epochs": 1, "min_samples": 300, "history_check": False}
    return {
        "FedAvg": lambda: FedAvg(history_check=False),
        "FedProx": lambda: FedProx(history_check=False),
        "SCAFFOLD": lambda: Scaffold(),
        "FedCat": lambda: FedCat(k=2, history_check=False),
        "FedSeq": lambda: FedSeq(net, 10, **fedseq),
        "FedSeqInter": lambda: FedSeqInter(net, 10, **fedseq),
        "FedConcat": lambda: FedConcat(**fedconcat),
        "FedConcat-ID": lambda: FedConcat(label_inference=True, id_samples=500, **fedconcat),
    }


def _client_app(client, app_mods=(), model_mods=()):
    """The quickstart app's handlers in a ClientApp of their own: `app_mods` on every handler,
    `model_mods` on the handlers whose replies carry a model (train and FedConcat's head)."""
    app = ClientApp(mods=list(app_mods))
    app.train(mods=list(model_mods))(client.train)
    app.query(LABELS_ACTION)(client.label_query)
    app.train(FEATURES_ACTION)(client.features)
    app.train(HEAD_ACTION, mods=list(model_mods))(client.head)
    return app


def _federation(client_app, nodes: int = NODES) -> FakeGrid:
    run_config = {**RUN_CONFIG, "local-epochs": 1}
    contexts = {
        BIG_IDS[i]: Context(run_id=1, node_id=BIG_IDS[i], node_config={"partition-id": i, "num-partitions": nodes},
                            state=RecordDict(), run_config=run_config)
        for i in range(nodes)
    }
    return FakeGrid({node: (lambda message, node=node: client_app(message, contexts[node])) for node in contexts})


def _start(runner, grid, initial, rounds=ROUNDS):
    return runner.start(grid=grid, initial_arrays=initial, num_rounds=rounds, train_config=ConfigRecord(TRAIN_CONFIG))


def _logged(caplog, pattern: str) -> list[float]:
    """The numbers Flower's log lines matching `pattern` (one group) report, in order."""
    return [float(match) for match in re.findall(pattern, caplog.text)]


def _moved(result, initial) -> bool:
    """Whether the run's model differs from the initial one (FedConcat's, a concatenated model,
    has other keys)."""
    if set(result.arrays.keys()) != set(initial.keys()):
        return True
    return any(not np.array_equal(result.arrays[k].numpy(), initial[k].numpy()) for k in initial.keys())


# ---------------------------------------------------------------------- works: FedAvg and FedProx × wrappers
@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("name", ["FedAvg", "FedProx"])
def test_fedavg_and_fedprox_run_under_each_wrapper_with_the_accounting_flower_reports(app, caplog, name, wrapper):
    task, client, _ = app
    wrap, mod = WRAPPERS[wrapper]
    strategy = _strategies(task.Net)[name]()
    grid = _federation(_client_app(client, model_mods=[mod] if mod else []))
    initial = ArrayRecord(task.Net().state_dict())
    dp = wrap(strategy)
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = _start(dp, grid, initial)
    assert _moved(result, initial) and sorted(result.train_metrics_clientapp) == [1, 2]
    assert len(grid.sent) == NODES * ROUNDS and "left out" not in caplog.text
    # The accounting Flower reports: the noise it added every round, and no ε without its accountant.
    stdevs = _logged(caplog, r"central DP noise with ([0-9]+\.[0-9]+) stdev added")
    assert len(stdevs) == ROUNDS
    if "fixed" in wrapper:
        assert stdevs == [round(compute_stdv(Z, C, NODES), 4)] * ROUNDS and dp.privacy_spent() is None
    else:
        assert dp.clipping_norm != C and all(stdev > 0 for stdev in stdevs)  # the norm adapted
    if wrapper.startswith("client"):
        assert all(message.content["config"][KEY_CLIPPING_NORM] > 0 for message in grid.sent)
        clipped = _logged(caplog, r"clipping_mod: (?:parameters|ndarrays) are clipped by value: ([0-9]+\.[0-9]+)")
        assert len(clipped) == NODES * ROUNDS
    if wrapper == "client-adaptive":
        assert all("norm_bit" in result.train_metrics_clientapp[r] for r in (1, 2))


def test_flowers_accountant_takes_flowers_fedavg_only():
    """Flower's own refusal at construction, before anything is sent: its accounted mode needs
    Flower's FedAvg.aggregate_train (docs/privacy.md)."""
    accountant = SimpleNamespace(config=SimpleNamespace(sampling_method=SamplingMethod.NO_AMPLIFICATION))
    with pytest.raises(ValueError, match="requires a strategy using FedAvg.aggregate_train"):
        DifferentialPrivacyServerSideFixedClipping(FedAvg(), Z, C, NODES, accountant=accountant)


# ---------------------------------------------------------------------- works: LocalDpMod × every strategy with ordinary replies
@pytest.mark.parametrize("name", ["FedAvg", "FedProx", "FedCat", "FedSeq", "FedSeqInter", "FedConcat", "FedConcat-ID"])
def test_local_dp_mod_on_the_model_handlers_runs_with_every_strategy_of_ordinary_replies(app, caplog, name):
    task, client, _ = app
    np.random.seed(0)  # LocalDpMod draws its noise from numpy's global generator
    strategy = _strategies(task.Net)[name]()
    grid = _federation(_client_app(client, model_mods=[LocalDpMod(**LOCAL)]))
    initial = ArrayRecord(task.Net().state_dict())
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = _start(strategy, grid, initial)
    assert _moved(result, initial)
    model_replies = [m for m in grid.sent if m.metadata.message_type in (MessageType.TRAIN, HEAD_MESSAGE_TYPE)]
    # The accounting Flower reports: one clip and one noise line per reply that carries a model.
    assert _logged(caplog, r"local DP noise with ([0-9]+\.[0-9]+) stddev added") == [round(LOCAL_STD, 4)] * len(model_replies)
    assert len(_logged(caplog, r"LocalDpMod: parameters are clipped by value: ([0-9]+\.[0-9]+)")) == len(model_replies)
    # No noised reply was rejected: every hop of setup and rounds kept all its replies.
    hops = [hop for record in strategy.history for hop in record["hops"]]
    hops += [strategy.setup_record[key] for key in ("pretraining",) if key in strategy.setup_record]
    assert hops and all(not hop["misses"] for hop in hops)


def test_the_history_check_says_when_it_rejects_updates_drowned_in_local_dp_noise(app):
    task, client, _ = app
    np.random.seed(0)
    strategy = FedAvg()  # history_check on: a noised update shares no direction with its node's last
    grid = _federation(_client_app(client, model_mods=[LocalDpMod(**LOCAL)]))
    _start(strategy, grid, ArrayRecord(task.Net().state_dict()), rounds=3)
    reasons = [miss["reason"] for record in strategy.history for hop in record["hops"] for miss in hop["misses"]]
    assert reasons and all("drowned in noise" in reason and "history_check=False" in reason for reason in reasons)


def test_concatfls_client_app_puts_local_dp_on_model_replies_only_when_the_run_config_asks():
    calls = []

    def handler(message, context):
        calls.append(message.metadata.message_type)
        arrays = ArrayRecord({"w": Array(message.content["arrays"]["w"].numpy() + 5.0)})
        return reply_with(message, RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})}))

    sent = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    context = Context(1, 1, {}, RecordDict(), {"local-dp-epsilon": 1e9, "local-dp-clip": 1.0})
    message = Message(RecordDict({"arrays": sent, "config": ConfigRecord()}), dst_node_id=1, message_type="train")
    reply = local_dp_mod(message, context, handler)
    assert np.linalg.norm(reply.content["arrays"]["w"].numpy()) == pytest.approx(1.0, abs=1e-3)  # clipped to C
    off = Context(1, 1, {}, RecordDict(), {"local-dp-epsilon": 0.0})
    assert np.allclose(local_dp_mod(message, off, handler).content["arrays"]["w"].numpy(), 5.0)
    query = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=1, message_type="query")
    assert not local_dp_mod(query, context, lambda m, c: reply_with(m, RecordDict())).has_error()


def test_the_user_style_apps_client_app_clips_and_noises_its_train_replies_when_the_run_config_asks(app):
    task, client, _ = app
    initial = task.Net().state_dict()
    flat = np.concatenate([value.numpy().ravel() for value in initial.values()])
    message = Message(RecordDict({"arrays": ArrayRecord(initial), "config": ConfigRecord({"lr": 0.1})}),
                      dst_node_id=1, message_type="train")

    def update(keys) -> np.ndarray:
        context = Context(1, 1, {"partition-id": 0, "num-partitions": NODES}, RecordDict(),
                          {**RUN_CONFIG, "local-epochs": 1, **keys})
        arrays = client.app(message, context).content["arrays"]
        return np.concatenate([arrays[key].numpy().ravel() for key in initial]) - flat

    assert np.linalg.norm(update({})) > 0.5  # trained, left as it is
    # ε so large that the noise is nothing: the update clipped to C.
    assert np.linalg.norm(update({"local-dp-epsilon": 1e9, "local-dp-clip": 0.5})) == pytest.approx(0.5, abs=1e-3)


def test_the_run_config_refuses_local_dp_with_scaffold_and_turns_the_direction_checks_off():
    with pytest.raises(ConfigError, match="strategy='scaffold' sends two"):
        RunConfig.from_mapping({"strategy": "scaffold", "local-dp-epsilon": 1.0})
    assert RunConfig.from_mapping({}).checks_update_history
    for name, checks in (("fedseq", lambda s: s.guard.history_check), ("fedconcat", lambda s: s.head_check)):
        plain = RunConfig.from_mapping({"strategy": name})
        noised = RunConfig.from_mapping({"strategy": name, "local-dp-epsilon": 1.0})
        env = ServerEnv.from_config(plain)
        assert checks(build_strategy(plain, env)) and not checks(build_strategy(noised, env))


# ---------------------------------------------------------------------- refused: before any message
REFUSED = ["SCAFFOLD", "FedCat", "FedSeq", "FedSeqInter", "FedConcat", "FedConcat-ID"]


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("name", [*REFUSED, "FedAvg-median", "FedAvg-feddyn"])
def test_every_other_strategy_under_each_wrapper_is_refused_before_any_message(app, name, wrapper):
    task, _, _ = app
    builders = _strategies(task.Net)
    builders["FedAvg-median"] = lambda: FedAvg(aggregation="median")
    builders["FedAvg-feddyn"] = lambda: FedAvg(feddyn=FedDynServer(0.01))
    grid = FakeGrid({node: lambda message: None for node in BIG_IDS[:NODES]})
    dp = WRAPPERS[wrapper][0](builders[name]())
    with pytest.raises(ValueError) as refused:
        _start(dp, grid, ArrayRecord(task.Net().state_dict()))
    text = str(refused.value)
    shown = "FedAvg" if name.startswith("FedAvg-") else name
    assert f"{shown} under Flower's {type(dp).__name__} is refused" in text
    assert ("What works instead" in text) if name in REFUSED else ("Use " in text)
    assert grid.sent == [] and grid.hops == []


@pytest.mark.parametrize("name", ["FedSeq", "FedSeqInter", "FedConcat", "FedConcat-ID"])
def test_a_strategy_with_a_stage_1_driven_by_hand_says_to_use_its_start(app, name):
    task, _, _ = app
    grid = FakeGrid({node: lambda message: None for node in BIG_IDS[:NODES]})
    strategy = _strategies(task.Net)[name]()
    with pytest.raises(RuntimeError, match=r"driven through its own start\(grid=.*stage 1 \(setup\)"):
        strategy.configure_train(1, ArrayRecord(task.Net().state_dict()), ConfigRecord(), grid)
    assert grid.sent == [] and grid.hops == []


# ---------------------------------------------------------------------- the mods' errors, explained
def test_a_clipping_mod_without_its_wrapper_is_explained_once(app, caplog):
    task, client, _ = app
    grid = _federation(_client_app(client, model_mods=[fixedclipping_mod]))
    strategy = FedAvg()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        result = _start(strategy, grid, ArrayRecord(task.Net().state_dict()))
    assert not result.train_metrics_clientapp  # Flower's behaviour: every reply is the mod's error
    assert caplog.text.count("wrap FedAvg in Flower's DifferentialPrivacyClientSideFixedClipping") == 1


def test_a_stage_1_that_dp_mods_refused_fails_saying_why(app):
    task, client, _ = app
    grid = _federation(_client_app(client, model_mods=[fixedclipping_mod]))
    with pytest.raises(RuntimeError, match="does not compose with DifferentialPrivacyClientSideFixedClipping"):
        _start(_strategies(task.Net)["FedSeq"](), grid, ArrayRecord(task.Net().state_dict()))
    grid = _federation(_client_app(client, app_mods=[LocalDpMod(**LOCAL)]))
    with pytest.raises(RuntimeError, match="not on the whole ClientApp"):
        _start(_strategies(task.Net)["FedConcat"](), grid, ArrayRecord(task.Net().state_dict()))


def test_scaffolds_two_records_are_explained_when_a_dp_mod_refuses_them(app, caplog):
    task, client, _ = app
    grid = _federation(_client_app(client, model_mods=[LocalDpMod(**LOCAL)]))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _start(Scaffold(), grid, ArrayRecord(task.Net().state_dict()), rounds=1)
    assert "no Flower DP mod composes with SCAFFOLD" in caplog.text


# ---------------------------------------------------------------------- the rules privacy.py adds
def test_a_client_side_wrapper_gets_clipped_replies_from_a_client_app_without_the_mod(caplog):
    initial = ArrayRecord({"w": Array(np.zeros((2, 2), np.float32)), "b": Array(np.zeros(1, np.float32))})

    def far(message):  # a ClientApp without fixedclipping_mod: an update of length 10
        arrays = ArrayRecord({k: Array(v.numpy() + 10 / math.sqrt(5)) for k, v in message.content["arrays"].items()})
        return reply_with(message, RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 10})}))

    grid = FakeGrid({node: far for node in BIG_IDS[:2]})
    dp = DifferentialPrivacyClientSideFixedClipping(FedAvg(update_clip=0, weight_clip=0), 0.0, 0.5, 2)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        result = _start(dp, grid, initial)
    length = math.sqrt(sum(float(np.sum(result.arrays[k].numpy() ** 2)) for k in ("w", "b")))
    assert length == pytest.approx(2 * 0.5, rel=1e-4)  # two rounds, each moved by the clipping norm
    assert caplog.text.count("does not run Flower's fixedclipping_mod") == 1


def test_clip_update_scales_the_update_to_the_norm_as_flower_does():
    rng = np.random.default_rng(0)
    sent = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)}
    returned = {"w": sent["w"] + rng.normal(size=(3, 4)), "b": sent["b"] + 3.0}
    clipped, length = clip_update(sent, returned, 1.0)
    flower = [returned["w"].copy(), returned["b"].copy()]
    compute_clip_model_update(flower, [sent["w"], sent["b"]], 1.0)
    assert length > 1 and np.allclose(clipped["w"], flower[0]) and np.allclose(clipped["b"], flower[1])
    update = np.concatenate([(clipped[k] - sent[k]).ravel() for k in sent])
    assert np.linalg.norm(update) == pytest.approx(1.0)
    # Within the norm: returned as it is.
    unchanged, short = clip_update(sent, {k: v + 0.01 for k, v in sent.items()}, 1.0)
    assert short < 1 and all(np.allclose(unchanged[k], sent[k] + 0.01) for k in sent)
    # Every array keeps its dtype; integer arrays (BatchNorm's counters) are rounded.
    counters, _ = clip_update({"n": np.array(7, np.int64), "w": np.zeros(2, np.float32)},
                              {"n": np.array(11, np.int64), "w": np.full(2, 3.0, np.float32)}, 1.0)
    assert counters["n"].dtype == np.int64 and counters["w"].dtype == np.float32 and int(counters["n"]) == 8
    with pytest.raises(ValueError):
        clip_update(sent, returned, 0.0)


def test_the_wrapper_is_found_only_when_it_drives_the_strategy():
    initial = ArrayRecord({"w": Array(np.zeros(2, np.float32))})
    grid = FakeGrid({node: lambda message: None for node in BIG_IDS[:2]})
    strategy = FedAvg()
    strategy.configure_train(1, initial, ConfigRecord(), grid)
    assert driving_wrapper(strategy) is None and strategy._privacy.wrapper is None  # by hand
    dp = DifferentialPrivacyServerSideFixedClipping(strategy, Z, C, 2)
    assert len(list(dp.configure_train(2, initial, ConfigRecord(), grid))) == 2
    assert strategy._privacy.wrapper is dp

    class OwnWrapper(Strategy):  # a user's wrapper that is not one of Flower's DP wrappers: not ours to judge
        def __init__(self, inner):
            super().__init__()
            self.strategy = inner

        def configure_train(self, *args):
            return self.strategy.configure_train(*args)

        def aggregate_train(self, *args):
            return self.strategy.aggregate_train(*args)

        def configure_evaluate(self, *args):
            return []

        def aggregate_evaluate(self, *args):
            return None

        def summary(self):
            pass

    fedcat = FedCat(k=2)
    assert len(list(OwnWrapper(fedcat).configure_train(1, initial, ConfigRecord(), grid))) == 2
    assert fedcat._privacy.wrapper is None


@pytest.mark.parametrize(
    ("reason", "words"),
    [
        ("fixedclipping_mod requires the key 'clipping_norm' to be present", "wrap FedAvg in Flower's"),
        ("LocalDpMod expects exactly one ArrayRecord, but found 2 ArrayRecord(s).", "no Flower DP mod composes"),
        ("LocalDpMod expects exactly one ArrayRecord, but found 0 ArrayRecord(s).", "not on the whole ClientApp"),
        ("adaptiveclipping_mod expects exactly one MetricRecord, but found 2", "refused a message"),
    ],
)
def test_each_mod_error_has_its_explanation(reason, words):
    explained = mod_explanation(FedAvg(), f"error reply: {reason}")
    assert explained is not None and words in explained[1]
    assert mod_explanation(FedAvg(), "error reply: ValueError: something else") is None
