"""FedCat driven through a FakeGrid: dispatch order, exact aggregates, schedule, ablations,
faults, node loss, plain Flower ClientApps, state save/restore, and one `flwr run`."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Container

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from concatfl.core.fedcat import judged_late, long_cycle
from concatfl.config import RunConfig
from concatfl.strategies import FedCat as DefaultFedCat, build_strategy
from tests.fakes import FakeGrid, reply_with

def FedCat(**kwargs) -> DefaultFedCat:  # pylint: disable=invalid-name
    """The paper's algorithm (every reply taken as it is), which these tests follow exactly; the
    divergence check's extra evaluations are tested on their own. No history check: the nodes'
    "training" (`_train`) is a map that records the order of visits, not a step toward a node's
    data, so one node's successive updates need not agree (tests/test_guard.py tests the check)."""
    return DefaultFedCat(**{"hop_step": 1.0, "hop_clip": 0.0, "check_parts": False, "history_check": False, **kwargs})

INITIAL = {"w": np.array([1.0, 2.0, 3.0], dtype=np.float32), "b": np.array([0.5], dtype=np.float32)}
TRAIN_CONFIG = ConfigRecord({"lr": 0.1, "local-epochs": 1})


def _record(values: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({key: Array(np.array(value)) for key, value in values.items()})


def _numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: array.numpy() for key, array in record.items()}


def _train(node: int, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A node's "training": an affine map that does not commute with other nodes' maps, so the
    final copies reveal the order in which they visited the nodes."""
    return {key: (0.5 * value + (node % 97)).astype(value.dtype) for key, value in values.items()}


def _examples(node: int) -> int:
    return 10 + node % 7


def _content(arrays: ArrayRecord, num_examples: float) -> RecordDict:
    return RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": num_examples})})


def _good(node: int) -> Callable[[Message], Message]:
    def handle(message: Message) -> Message:
        trained = _train(node, _numpy(message.content.array_records["arrays"]))
        return reply_with(message, _content(_record(trained), _examples(node)))

    return handle


def _grid(nodes: list[int], faulty: dict[int, Callable[[Message], Message | None]] | None = None) -> FakeGrid:
    return FakeGrid({node: (faulty or {}).get(node, _good(node)) for node in nodes})


def _group_of(groups: list[list[int]], node: int) -> int:
    return next(g for g, members in enumerate(groups) if node in members)


def _expected_aggregate(rounds: list[dict], start: dict[str, np.ndarray], skip: Container[int] = ()):
    """Σ d_i·m_i / Σ d_i replayed by hand from the recorded copy→device maps of one cycle."""
    k = len(rounds[0]["copy_to_device"])
    copies, sizes = [dict(start) for _ in range(k)], [0] * k
    for record in rounds:
        visits = list(record["copy_to_device"])
        for replaced in record.get("replacements", []):  # a lost copy trained at its replacement instead
            visits[replaced["copy"]] = replaced["replacement"]
        for i, node in enumerate(visits):
            if node is not None and node not in skip:
                copies[i], sizes[i] = _train(node, copies[i]), sizes[i] + _examples(node)
    return {
        key: sum(d * c[key].astype(np.float64) for d, c in zip(sizes, copies)) / sum(sizes) for key in start
    }, copies, sizes


def _run(strategy: FedCat, grid: FakeGrid, rounds: int, start: dict[str, np.ndarray] = INITIAL):
    """The run's result and the rounds in which the server evaluated (once each: an aggregation
    also scores the first hops' FedAvg round, `FirstHopWitness`)."""
    evaluated: list[int] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if evaluated[-1:] != [server_round]:
            evaluated.append(server_round)
        return MetricRecord({"accuracy": 0.0})

    result = strategy.start(
        grid, _record(start), num_rounds=rounds, train_config=TRAIN_CONFIG, evaluate_fn=evaluate
    )
    return result, evaluated


def _assert_arrays(record: ArrayRecord, expected: dict[str, np.ndarray]) -> None:
    for key, value in expected.items():
        np.testing.assert_allclose(record[key].numpy(), value, rtol=1e-6)


def test_one_cycle_dispatches_in_the_papers_order_and_aggregates_sum_d_m_over_sum_d():
    nodes = [101, 102, 103, 104, 105, 106, 107]
    grid = _grid(nodes)
    strategy = FedCat(k=3, group_cycles=2, epsilon=0.5, seed=4)
    result, evaluated = _run(strategy, grid, rounds=3)

    rounds = strategy.history
    groups = rounds[0]["groups"]
    assert sorted(n for g in groups for n in g) == nodes and sorted(map(len, groups)) == [2, 2, 3]
    assert all("groups" not in record for record in rounds[1:])
    visits: list[list[int]] = [[], [], []]
    for offset, (record, hop) in enumerate(zip(rounds, grid.hops)):
        assert record["k"] == 3 and record["offset"] == offset
        assert [_group_of(groups, node) for node in record["selected"]] == [0, 1, 2]
        selected = record["selected"]
        assert record["copy_to_device"] == [selected[(offset + i) % 3] for i in range(3)]
        # Exactly K models down (to the planned nodes) and K up, with bytes measured.
        assert [m.metadata.dst_node_id for m in hop] == record["copy_to_device"]
        assert record["hops"][0]["sent"] == record["hops"][0]["replies"] == 3
        assert record["bytes_sent"] > 0 and record["bytes_received"] > 0
        for message in hop:
            sent_config = dict(message.content.config_records["config"])
            assert sent_config == {**dict(TRAIN_CONFIG), "server-round": offset + 1}
            assert set(message.content.keys()) == {"arrays", "config"}
        for i, node in enumerate(record["copy_to_device"]):
            visits[i].append(node)
    for i, path in enumerate(visits):
        assert [_group_of(groups, node) for node in path] == [(i + j) % 3 for j in range(3)]

    # The models sent in round 2 are exactly the copies returned in round 1.
    for i, message in enumerate(grid.hops[1]):
        _assert_arrays(message.content.array_records["arrays"], _train(visits[i][0], INITIAL))

    expected, _, sizes = _expected_aggregate(rounds, INITIAL)
    assert rounds[-1]["data_sizes"] == sizes
    assert [r["aggregated"] for r in rounds] == [False, False, True]
    assert evaluated == [0, 3]
    _assert_arrays(result.arrays, expected)


def test_copies_restart_from_the_new_global_at_each_cycle():
    nodes = [1, 2, 3, 4]
    strategy = FedCat(k=2, seed=0)
    grid = _grid(nodes)
    result, evaluated = _run(strategy, grid, rounds=4)
    first, _, _ = _expected_aggregate(strategy.history[:2], INITIAL)
    first32 = {key: value.astype(np.float32) for key, value in first.items()}
    for message in grid.hops[2]:
        _assert_arrays(message.content.array_records["arrays"], first32)
    second, _, _ = _expected_aggregate(strategy.history[2:], first32)
    assert evaluated == [0, 2, 4]
    _assert_arrays(result.arrays, second)


@pytest.mark.parametrize("group_cycles", [1, 2, 3])
def test_regrouping_happens_exactly_every_lambda_k_rounds(group_cycles):
    strategy = FedCat(k=2, group_cycles=group_cycles, seed=1)
    _run(strategy, _grid([1, 2, 3, 4, 5]), rounds=13)
    regrouped = [record["round"] for record in strategy.history if "groups" in record]
    assert regrouped == list(range(1, 14, 2 * group_cycles))


def test_count_table_counts_each_selection_at_its_offset():
    strategy = FedCat(k=2, group_cycles=100, epsilon=1.0, seed=2)
    _run(strategy, _grid([1, 2, 3, 4, 5, 6]), rounds=6)
    counts = strategy.state_dict()["fedcat"]["counts"]
    table = dict(zip(counts["nodes"], counts["counts"].tolist()))
    for offset in (0, 1):
        chosen = [n for record in strategy.history if record["offset"] == offset for n in record["selected"]]
        assert sum(row[offset] for row in table.values()) == len(chosen) == 6
        # ε = 1 with groups of 3 and 3 picks per offset: every member once per offset.
        assert sorted(chosen) == [1, 2, 3, 4, 5, 6]
        assert all(table[n][offset] == 1 for n in chosen)


def test_random_selection_ablation_uses_no_groups_and_no_counts():
    strategy = FedCat(k=3, selection="random", seed=0)
    result, evaluated = _run(strategy, _grid([1, 2, 3, 4, 5, 6]), rounds=3)
    assert all("groups" not in record for record in strategy.history)
    assert all(len(set(record["selected"])) == 3 for record in strategy.history)
    assert strategy.state_dict()["fedcat"]["counts"]["nodes"] == []
    expected, _, _ = _expected_aggregate(strategy.history, INITIAL)
    assert evaluated == [0, 3]
    _assert_arrays(result.arrays, expected)


@pytest.mark.parametrize("selection", ["grouped-count", "random"])
def test_no_concat_ablation_aggregates_fresh_copies_every_round(selection):
    strategy = FedCat(k=3, selection=selection, concat=False, seed=0)
    grid = _grid([1, 2, 3, 4, 5, 6, 7])
    result, evaluated = _run(strategy, grid, rounds=3)
    assert evaluated == [0, 1, 2, 3]
    assert [r["aggregated"] for r in strategy.history] == [True] * 3
    start = INITIAL
    for record in strategy.history:
        # Every round is FedAvg over the K selected nodes: each copy trains once from the global.
        expected, _, sizes = _expected_aggregate([record], start)
        assert record["data_sizes"] == sizes
        start = {key: value.astype(np.float32) for key, value in expected.items()}
    _assert_arrays(result.arrays, start)


def _missing(message: Message) -> None:
    return None


def _nan(message: Message) -> Message:
    values = _numpy(message.content.array_records["arrays"])
    values["w"][0] = np.nan
    return reply_with(message, _content(_record(values), 12))


def _wrong_shape(message: Message) -> Message:
    values = _numpy(message.content.array_records["arrays"])
    values["w"] = np.zeros(5, dtype=np.float32)
    return reply_with(message, _content(_record(values), 12))


def _zero_examples(message: Message) -> Message:
    return reply_with(message, _content(message.content.array_records["arrays"], 0))


@pytest.mark.parametrize("fault", [_missing, _nan, _wrong_shape, _zero_examples])
def test_a_lost_copy_goes_on_to_a_replacement_device_of_the_same_group_in_the_same_round(fault):
    bad = 3
    nodes = [1, 2, 3, 4, 5, 6]
    strategy = FedCat(k=3, seed=0)
    grid = _grid(nodes, faulty={bad: fault})
    result, evaluated = _run(strategy, grid, rounds=6)
    assert evaluated == [0, 3, 6]
    hops = iter(grid.hops)
    lost_rounds = 0
    for record in strategy.history:
        hop = next(hops)
        if bad not in record["copy_to_device"]:
            assert "replacements" not in record and len(record["hops"]) == 1
            continue
        lost_rounds += 1
        copy_index = record["copy_to_device"].index(bad)
        (replaced,) = record["replacements"]
        assert replaced["copy"] == copy_index and replaced["lost"] == bad
        # The other member of bad's group (groups of two here), which was not selected this round.
        groups = [r["groups"] for r in strategy.history[: record["round"]] if "groups" in r][-1]
        (partner,) = [node for node in next(g for g in groups if bad in g) if node != bad]
        assert replaced["replacement"] == partner and partner not in record["selected"]
        (retry,) = next(hops)
        assert retry.metadata.dst_node_id == partner and len(record["hops"]) == 2
        _assert_arrays(retry.content.array_records["arrays"], _numpy(hop[copy_index].content.array_records["arrays"]))
    assert lost_rounds >= 2
    first, _, sizes = _expected_aggregate(strategy.history[:3], INITIAL, skip={bad})
    assert strategy.history[2]["data_sizes"] == sizes and 0 not in sizes
    second, _, _ = _expected_aggregate(strategy.history[3:], {k: v.astype(np.float32) for k, v in first.items()}, skip={bad})
    _assert_arrays(result.arrays, second)


@pytest.mark.parametrize("fault", [_missing, _nan, _wrong_shape, _zero_examples])
def test_a_lost_copy_without_a_replacement_keeps_its_model_and_data_size(fault):
    bad = 3
    nodes = [1, 2, 3, 4, 5, 6]
    strategy = FedCat(k=6, seed=0)  # every node is selected every round: no one can take over
    grid = _grid(nodes, faulty={bad: fault})
    result, evaluated = _run(strategy, grid, rounds=6)
    assert len(strategy.history) == 6 and evaluated == [0, 6]
    for record in strategy.history:
        misses = record["hops"][0]["misses"]
        assert [m["node"] for m in misses] == [bad] and len(record["hops"]) == 1
        assert misses[0]["tag"] == record["copy_to_device"].index(bad)
        assert record["replacements"] == [{"copy": misses[0]["tag"], "lost": bad, "replacement": None}]
    # Each round's message to the next node carries the copy exactly as it was before the miss.
    for offset, hop in ((1, grid.hops[1]), (2, grid.hops[2])):
        _, copies, _ = _expected_aggregate(strategy.history[:offset], INITIAL, skip={bad})
        for i, message in enumerate(hop):
            _assert_arrays(message.content.array_records["arrays"], copies[i])
    first, _, sizes = _expected_aggregate(strategy.history[:6], INITIAL, skip={bad})
    assert strategy.history[5]["data_sizes"] == sizes
    _assert_arrays(result.arrays, first)


def test_a_cycle_without_any_valid_reply_keeps_the_global_model():
    strategy = FedCat(k=2, seed=0)
    result, evaluated = _run(strategy, _grid([1, 2, 3], faulty={n: _missing for n in (1, 2, 3)}), rounds=2)
    assert evaluated == [0]
    assert strategy.history[-1]["data_sizes"] == [0, 0]
    _assert_arrays(result.arrays, INITIAL)


def test_a_disconnected_node_leaves_its_group_and_an_empty_group_is_redrawn_at_once():
    nodes = [1, 2, 3, 4, 5]
    grid = _grid(nodes)
    strategy = FedCat(k=2, group_cycles=5, seed=0)
    _run(strategy, grid, rounds=1)
    groups = strategy.history[0]["groups"]
    small = min(groups, key=len)
    large = max(groups, key=len)
    # One node of the large group goes: the groups stay, that node is never selected again.
    gone = large[0]
    del grid.handlers[gone]
    _run(strategy, grid, rounds=3)
    assert all("groups" not in r and gone not in r["copy_to_device"] for r in strategy.history[1:3])
    assert strategy.state_dict()["fedcat"]["groups"] == [
        [n for n in g if n != gone] for g in groups
    ]
    # The whole small group goes: groups are redrawn at once over the remaining nodes.
    for node in small:
        del grid.handlers[node]
    _run(strategy, grid, rounds=4)
    redrawn = strategy.history[3]["groups"]
    assert sorted(n for g in redrawn for n in g) == sorted(grid.handlers) and all(redrawn)
    assert strategy.history[3]["k"] == 2 and strategy.history[3]["offset"] == 1


def test_fewer_nodes_than_k_shrinks_k_and_folds_the_open_cycle_into_the_global():
    nodes = [1, 2, 3]
    grid = _grid(nodes)
    strategy = FedCat(k=3, seed=0)
    result, evaluated = _run(strategy, grid, rounds=1)
    after_one, _, _ = _expected_aggregate(strategy.history[:1], INITIAL)  # the last-round average
    _assert_arrays(result.arrays, after_one)
    del grid.handlers[2]
    result, evaluated = _run(strategy, grid, rounds=3)
    shrunk = strategy.history[1]
    assert shrunk["k"] == 2 and shrunk["offset"] == 0 and sorted(map(len, shrunk["groups"])) == [1, 1]
    folded = {key: value.astype(np.float32) for key, value in after_one.items()}
    for message in grid.hops[1]:
        _assert_arrays(message.content.array_records["arrays"], folded)
    # The folded model is returned (and evaluated) at once; the new 2-round cycle ends at round 3.
    assert [r["aggregated"] for r in strategy.history[1:]] == [True, True]
    assert evaluated == [2, 3]
    expected, _, _ = _expected_aggregate(strategy.history[1:], folded)
    _assert_arrays(result.arrays, expected)


def test_k_larger_than_the_connected_nodes_is_capped():
    strategy = FedCat(k=5, seed=0)
    _run(strategy, _grid([1, 2, 3]), rounds=1)
    assert strategy.history[0]["k"] == 3


def test_a_run_ending_inside_a_cycle_returns_the_average_of_the_copies_so_far():
    strategy = FedCat(k=3, seed=0)
    result, evaluated = _run(strategy, _grid([1, 2, 3, 4, 5, 6]), rounds=2)
    assert evaluated == [0, 2]
    expected, _, _ = _expected_aggregate(strategy.history, INITIAL)
    _assert_arrays(result.arrays, expected)


def test_fedcat_drives_a_plain_flower_clientapp():
    """A ClientApp that knows nothing of concatfl: reads "arrays", replies "arrays" + num-examples."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content["arrays"]
        trained = ArrayRecord(
            {key: Array(_train(context.node_id, {key: array.numpy()})[key]) for key, array in arrays.items()}
        )
        metrics = MetricRecord({"num-examples": _examples(context.node_id)})
        return Message(RecordDict({"arrays": trained, "metrics": metrics}), reply_to=msg)

    def node(node_id: int) -> Callable[[Message], Message]:
        def handle(message: Message) -> Message:
            context = Context(run_id=1, node_id=node_id, node_config={}, state=RecordDict(), run_config={})
            return app(message, context)

        return handle

    nodes = [2**40 + 1, 2**40 + 2, 2**40 + 3, 2**40 + 4, 2**40 + 5, 2**63 + 9]
    grid = FakeGrid({n: node(n) for n in nodes})
    strategy = FedCat(k=3, seed=7)
    result, _ = _run(strategy, grid, rounds=3)
    assert all(r["hops"][0]["replies"] == 3 and not r["hops"][0]["misses"] for r in strategy.history)
    expected, copies, sizes = _expected_aggregate(strategy.history, INITIAL)
    for i, saved in enumerate(strategy.state_dict()["fedcat"]["copies"]):
        for key in INITIAL:
            np.testing.assert_array_equal(saved[key], copies[i][key])
    assert strategy.history[-1]["data_sizes"] == sizes
    _assert_arrays(result.arrays, expected)


def test_a_restored_strategy_continues_identically():
    nodes = [1, 2, 3, 4, 5, 6, 7]
    options = {"k": 3, "group_cycles": 1, "epsilon": 0.5}
    straight = FedCat(seed=11, **options)
    straight_result, _ = _run(straight, _grid(nodes), rounds=8)

    first = FedCat(seed=11, **options)
    first_result, _ = _run(first, _grid(nodes), rounds=4)
    state = pickle.loads(pickle.dumps(copy.deepcopy(first.state_dict())))
    assert isinstance(state["fedcat"]["copies"][0]["w"], np.ndarray)
    resumed = FedCat(seed=99, **options)  # a different seed: everything must come from the state
    resumed.load_state_dict(state)
    resumed_result = resumed.start(_grid(nodes), first_result.arrays, num_rounds=8, train_config=TRAIN_CONFIG)

    keys = ("copy_to_device", "selected", "offset", "data_sizes", "aggregated")
    for a, b in zip(straight.history[4:], resumed.history[4:]):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert a.get("groups") == b.get("groups")
    assert sum("groups" in r for r in resumed.history[4:]) == 1  # the grouping point at round 7
    np.testing.assert_array_equal(
        straight.state_dict()["fedcat"]["counts"]["counts"], resumed.state_dict()["fedcat"]["counts"]["counts"]
    )
    for key in INITIAL:
        np.testing.assert_array_equal(straight_result.arrays[key].numpy(), resumed_result.arrays[key].numpy())


def test_build_reads_the_fedcat_run_config():
    config = RunConfig(
        strategy="fedcat", fraction_train=0.2, fedcat_k=4, fedcat_lambda=3, fedcat_epsilon=0.25,
        fedcat_selection="random", fedcat_concat=False, seed=5, round_timeout=0.0,
    )
    strategy = build_strategy(config, env=None)  # FedCat needs nothing from the environment
    assert isinstance(strategy, DefaultFedCat)
    assert (strategy.k, strategy.fraction_train, strategy.group_cycles, strategy.epsilon) == (4, 0.2, 3, 0.25)
    assert (strategy.selection, strategy.concat, strategy.round_timeout) == ("random", False, None)


def test_fedcat_takes_the_papers_ten_percent_unless_k_or_a_fraction_is_given():
    assert DefaultFedCat().fraction_train == 0.1
    assert build_strategy(RunConfig(strategy="fedcat"), env=None).fraction_train == 0.1
    assert build_strategy(RunConfig(strategy="fedcat", fraction_train=0.3), env=None).fraction_train == 0.3
    assert build_strategy(RunConfig(strategy="fedcat", fedcat_k=5), env=None).k == 5


def test_invalid_parameters_fail_clearly():
    for kwargs in ({"k": 1}, {"group_cycles": 0}, {"epsilon": 1.5}, {"selection": "best"}, {"fraction_train": 0},
                   {"hop_step": "sized"}):
        with pytest.raises(ValueError):
            FedCat(**kwargs)


@pytest.mark.e2e
def test_fedcat_end_to_end_on_digits(tmp_path):
    e2e = pytest.importorskip("tests.e2e")
    metrics = e2e.run_in_process(
        tmp_path,
        {"strategy": "fedcat", "dataset": "digits", "num-server-rounds": 4, "fedcat-k": 2, "local-epochs": 2},
        num_supernodes=6,
    )
    rounds = metrics["rounds"]
    assert [r["aggregated"] for r in rounds] == [False, True, False, True]
    assert ["accuracy" in r for r in rounds] == [False, True, False, True]
    groups = rounds[0]["groups"]
    assert sum(map(len, groups)) == metrics["num_nodes"] == 6
    assert all("groups" not in r for r in rounds[1:])  # the next grouping point is round 5
    for first, second in (rounds[0:2], rounds[2:4]):
        for i in range(2):
            path = [first["copy_to_device"][i], second["copy_to_device"][i]]
            assert [_group_of(groups, node) for node in path] == [i, 1 - i]
    assert all(r["hops"][0]["replies"] == 2 and not r["hops"][0]["misses"] for r in rounds)
    # The model must learn from two cycles.
    assert metrics["final_loss"] < metrics["initial"]["loss"]
    assert metrics["final_accuracy"] > 0.2


def test_copies_that_score_below_one_fedavg_round_of_their_first_hops_twice_are_warned_about(caplog):
    strategy = FedCat(k=3, seed=0)
    scores = iter([0.1, 0.2, 0.5, 0.3, 0.6])  # the start, then per cycle: the copies' average, the first hops'

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({"accuracy": next(scores)})

    with caplog.at_level("WARNING"):
        result = strategy.start(_grid([1, 2, 3, 4, 5, 6]), _record(INITIAL), num_rounds=6, train_config=TRAIN_CONFIG,
                                evaluate_fn=evaluate)
    assert [strategy.history[r].get("witness") for r in (2, 5)] == [
        {"chains_accuracy": 0.2, "first_hops_accuracy": 0.5},
        {"chains_accuracy": 0.3, "first_hops_accuracy": 0.6},
    ]
    warnings = [r.getMessage() for r in caplog.records if "here FedCat does worse than FedAvg" in r.getMessage()]
    assert len(warnings) == 1 and "round 6" in warnings[0]
    assert result.evaluate_metrics_serverapp[6]["accuracy"] == 0.3  # FedCat keeps its own average


@pytest.mark.parametrize(
    "k, rounds, reasons", [(2, 3, ["late"]), (2, 8, []), (6, 24, ["long"]), (6, 12, ["long", "late"])]
)
def test_a_cycle_too_long_or_a_run_too_short_for_its_checks_is_told_at_the_first_round(caplog, k, rounds, reasons):
    strategy = FedCat(k=k, seed=0)
    expected = {"long": long_cycle(k), "late": judged_late(k, rounds)}
    with caplog.at_level("WARNING"):
        _run(strategy, _grid(list(range(1, 7))), rounds=rounds)
    reasons_there = {f"FedCat: {message}" for message in expected.values() if message}
    told = [r.getMessage() for r in caplog.records if r.getMessage() in reasons_there]
    assert told == [f"FedCat: {expected[reason]}" for reason in reasons]
