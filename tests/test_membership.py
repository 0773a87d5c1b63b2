"""Elastic membership: the one mechanism, its records, and the nodes every strategy gives a place."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from concatfl.core.fedcat import CountTable, select_replacement
from concatfl.server_app import wait_for_start
from concatfl.strategies import FedAvg, FedCat
from concatfl.strategies.common import NO_REPLY, NOT_SENT, HopResult, Miss, Request
from concatfl.strategies.membership import JOINED, RETURNED, Membership, rest_rounds
from tests.fakes import BIG_IDS, FakeGrid, reply_with

MODEL = ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))})


def trainer(step: float = 1.0):
    """A node whose training adds `step` to every weight."""

    def handle(message: Message) -> Message:
        values = {k: Array(v.numpy() + step) for k, v in message.content.array_records["arrays"].items()}
        metrics = MetricRecord({"num-examples": 10})
        return reply_with(message, RecordDict({"arrays": ArrayRecord(values), "metrics": metrics}))

    return handle


def test_membership_tells_new_returning_and_departed_nodes_apart():
    members = Membership()
    first = members.look([BIG_IDS[0], BIG_IDS[1]])
    assert first.new == [BIG_IDS[0], BIG_IDS[1]] and first.returned == [] and first.left == []
    members.settle(BIG_IDS[0], "pool")
    members.settle(BIG_IDS[1], "pool")
    assert members.look([BIG_IDS[0], BIG_IDS[1]]) == type(first)([], [], [])
    gone = members.look([BIG_IDS[0]])
    assert gone.left == [BIG_IDS[1]] and gone.new == [] and gone.returned == []
    back = members.look([BIG_IDS[0], BIG_IDS[1], BIG_IDS[2]])
    assert back.returned == [BIG_IDS[1]] and back.new == [BIG_IDS[2]]
    # A node that was not placed stays new until it is; ids of 64 bits stay exact through the state.
    assert members.look([BIG_IDS[0], BIG_IDS[1], BIG_IDS[2]]).new == [BIG_IDS[2]]
    restored = Membership()
    restored.load_state_dict(members.state_dict())
    assert restored == members


def test_rests_begin_at_the_second_silent_hop_in_a_row_and_double_up_to_eight_rounds():
    assert [rest_rounds(silences) for silences in range(8)] == [0, 0, 1, 2, 4, 8, 8, 8]


def test_a_node_rests_after_hops_it_lets_time_out_and_wakes_when_it_answers_or_comes_back():
    node, other = BIG_IDS[1], BIG_IDS[2]
    members = Membership()
    assert members.note_hop(1, [other], [node]) == {node: 0} and members.resting(2) == set()
    assert members.note_hop(2, [], [node]) == {node: 1}
    assert members.resting(2) == members.resting(3) == {node} and members.resting(4) == set()
    assert members.note_hop(4, [other], [node]) == {node: 2}
    assert members.resting(6) == {node} and members.resting(7) == set()
    restored = Membership()
    restored.load_state_dict(members.state_dict())
    assert restored == members
    members.note_hop(7, [node], [])
    assert members.silences == {} and members.resting(7) == set()
    members.note_hop(8, [], [node])
    members.note_hop(9, [], [node])
    members.wake(node)  # it connected again
    assert members.resting(10) == set() and members.note_hop(10, [], [node]) == {node: 0}
    older = members.state_dict()  # a checkpoint written before nodes rested
    del older["silences"], older["rest_until"]
    restored.load_state_dict(older)
    assert restored.silences == {} and restored.resting(10) == set()


def silent_until(last_silent_round: int):
    """A node that sends nothing to the train messages of rounds ≤ `last_silent_round` (it hangs)."""
    train = trainer()

    def handle(message: Message) -> Message | None:
        server_round = int(message.content.config_records["config"]["server-round"])
        return None if server_round <= last_silent_round else train(message)

    return handle


def test_a_request_never_sent_neither_rests_nor_wakes_its_node():
    node, unsent = BIG_IDS[1], BIG_IDS[2]
    strategy = FedAvg(seed=0)
    strategy.membership.note_hop(1, [], [unsent])
    request = lambda n: Request(n, RecordDict())  # noqa: E731
    strategy._note_silences(HopResult(misses=[Miss(request(node), NO_REPLY), Miss(request(unsent), NOT_SENT)]))
    assert strategy.membership.silences == {node: 1, unsent: 1}


def test_fedavg_rests_a_node_that_lets_its_hops_time_out_and_takes_it_back_when_it_answers():
    grid = FakeGrid({1: trainer(), 2: trainer(), 3: silent_until(6)})
    strategy = FedAvg(seed=0, update_clip=0.0, weight_clip=0.0, round_timeout=0.05)
    strategy.start(grid, MODEL, num_rounds=8, train_config=ConfigRecord())
    asked = [3 in record["selected"] for record in strategy.history]
    # Silent in rounds 1 and 2: rests in 3; silent in 4: rests in 5 and 6; answers in 7.
    assert asked == [True, True, False, True, False, False, True, True]
    assert [record["membership"].get("resting") for record in strategy.history] == [
        None, None, [3], None, [3], [3], None, None
    ]
    assert [record["membership"]["trained"] for record in strategy.history] == [2, 2, 2, 2, 2, 2, 3, 3]
    assert strategy.membership.silences == {}


def test_flowers_own_round_hooks_rest_a_silent_node_too():
    grid = FakeGrid({1: trainer(), 2: silent_until(99)})
    strategy = FedAvg(seed=0, update_clip=0.0, weight_clip=0.0)
    asked = []
    for server_round in range(1, 5):
        messages = list(strategy.configure_train(server_round, MODEL, ConfigRecord(), grid))
        asked.append(sorted(message.metadata.dst_node_id for message in messages))
        strategy.aggregate_train(server_round, grid.send_and_receive(messages))
    assert asked == [[1, 2], [1, 2], [1], [1, 2]]


def test_a_round_never_rests_every_node():
    grid = FakeGrid({1: silent_until(10)})
    strategy = FedAvg(seed=0, update_clip=0.0, weight_clip=0.0, round_timeout=0.05)
    strategy.start(grid, MODEL, num_rounds=3, train_config=ConfigRecord())
    assert [record["selected"] for record in strategy.history] == [[1], [1], [1]]
    assert strategy.membership.silences == {1: 3}


def test_fedcat_selects_no_resting_device_for_a_copy_nor_as_a_replacement():
    nodes = {node: trainer() for node in (1, 2, 3, 4, 5)}
    nodes[5] = silent_until(99)
    strategy = FedCat(k=2, group_cycles=10, hop_step=1.0, hop_clip=0.0, update_clip=0.0, weight_clip=0.0, seed=0,
                      round_timeout=0.05)
    strategy.start(FakeGrid(nodes), MODEL, num_rounds=12, train_config=ConfigRecord())
    rested = [record for record in strategy.history if record["membership"].get("resting") == [5]]
    assert rested
    for record in rested:
        assert 5 not in record["selected"]
        assert 5 not in [entry["replacement"] for entry in record.get("replacements", [])]
    # Every node hangs: in round 3 all rest; each group still has a device selected (a round is
    # never emptied by rests), but a lost copy gets no resting stand-in.
    strategy = FedCat(k=2, hop_step=1.0, hop_clip=0.0, update_clip=0.0, weight_clip=0.0, seed=0, round_timeout=0.05)
    strategy.start(FakeGrid({node: silent_until(99) for node in (1, 2, 3, 4)}), MODEL, num_rounds=3,
                   train_config=ConfigRecord())
    assert [len(record["selected"]) for record in strategy.history] == [2, 2, 2]
    assert strategy.history[2]["membership"]["resting"] == [1, 2, 3, 4]
    assert [entry["replacement"] is None for entry in strategy.history[1]["replacements"]] == [False, False]
    assert [entry["replacement"] for entry in strategy.history[2]["replacements"]] == [None, None]


def test_fedavg_trains_a_node_from_the_round_it_joins_and_records_who_came_and_went():
    grid = FakeGrid({1: trainer(), 2: trainer()}, arrivals={3: (1, trainer())})
    strategy = FedAvg(seed=0, update_clip=0.0, weight_clip=0.0)
    original = grid.get_node_ids

    def listing():  # node 2 is away while round 3 starts
        nodes = list(original())
        return [node for node in nodes if not (node == 2 and grid.latest_round == 2)]

    grid.get_node_ids = listing
    strategy.start(grid, MODEL, num_rounds=4, train_config=ConfigRecord())
    rounds = strategy.history
    assert strategy.setup_record["start_nodes"] == 2
    assert rounds[0]["membership"] == {"connected": 2, "trained": 2} and "placements" not in rounds[0]
    assert rounds[1]["membership"] == {"connected": 3, "trained": 3, "joined": [3]}
    assert rounds[1]["placements"] == [{"node": 3, "where": "pool", "why": JOINED}]
    assert rounds[1]["selected"] == [1, 2, 3]
    assert rounds[2]["membership"] == {"connected": 2, "trained": 2, "left": [2]}
    assert rounds[3]["membership"] == {"connected": 3, "trained": 3, "returned": [2]}
    assert rounds[3]["placements"] == [{"node": 2, "where": "pool", "why": RETURNED}]


def test_fedcat_puts_a_joining_node_into_the_smallest_group_where_it_is_soon_selected():
    nodes = {node: trainer() for node in (1, 2, 3, 4, 5)}
    grid = FakeGrid(nodes, arrivals={9: (1, trainer())})
    strategy = FedCat(k=2, group_cycles=10, hop_step=1.0, hop_clip=0.0, update_clip=0.0, weight_clip=0.0, seed=0)
    strategy.start(grid, MODEL, num_rounds=6, train_config=ConfigRecord())
    first_groups = strategy.history[0]["groups"]
    (placed,) = strategy.history[1]["placements"]
    smallest = min(range(2), key=lambda g: (len(first_groups[g]), g))
    assert placed == {"node": 9, "where": {"group": smallest}, "why": JOINED}
    assert 9 in strategy.history[1]["groups"][smallest]
    # Its counts are zero while its group's others were selected: the count rule reaches it within
    # the group's size in cycles (both of ε's branches prefer a device never selected at an offset).
    assert any(9 in record["selected"] for record in strategy.history[1:])


def test_a_replacement_is_drawn_from_the_candidates_by_the_count_rule_and_counted():
    table = CountTable(2)
    table.increment(7, 1)
    rng = np.random.default_rng(0)
    # Never selected at this offset beats selected once, whatever ε draws.
    assert all(select_replacement([7, 8], CountTable.from_state(table.state_dict()), 1, eps, rng) == 8 for eps in (0.0, 1.0))
    assert select_replacement([], table, 1, 0.5, rng) is None
    assert select_replacement([7], table, 1, 0.5, rng) == 7 and table.counts([7], 1).tolist() == [2]


class ScriptedGrid:
    """Node ids that change at given (fake) times."""

    def __init__(self, timeline: list[tuple[float, list[int]]]) -> None:
        self.timeline, self.now = timeline, 0.0

    def get_node_ids(self):
        return next(nodes for at, nodes in reversed(self.timeline) if at <= self.now)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_start_waits_for_the_expected_nodes_or_a_stable_set_within_start_wait():
    arriving = [(0.0, [1]), (2.0, [1, 2]), (4.0, [1, 2, 3]), (30.0, [1, 2, 3, 4])]
    grid = ScriptedGrid(arriving)
    assert wait_for_start(grid, 2, expected=3, wait=60, clock=grid.clock, sleep=grid.sleep) == 3
    grid = ScriptedGrid(arriving)  # settle: 3 s without a change after node 3 came at 4 s
    assert wait_for_start(grid, 2, settle=3.0, wait=60, clock=grid.clock, sleep=grid.sleep) == 3 and grid.now < 8.0
    grid = ScriptedGrid(arriving)  # start-wait bounds the wait for a count that never comes in time
    assert wait_for_start(grid, 1, expected=9, wait=10, clock=grid.clock, sleep=grid.sleep) == 3
    assert 10.0 <= grid.now < 11.0
    grid = ScriptedGrid(arriving)  # the minimum alone: no settle, no expected count
    assert wait_for_start(grid, 1, clock=grid.clock, sleep=grid.sleep) == 1 and grid.now == 0.0
