"""The strategy's side of elastic membership (`membership`): at the start of every round it looks
at the connected nodes, asks the strategy (`RelayStrategy.place`) where each node without a place
goes, records every placement, and rests the nodes that let hops time out.

`Admission` is a part of `RelayStrategy`; the state it keeps is the strategy's `membership`.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

from flwr.app import MessageType
from flwr.serverapp import Grid
from flwr.supercore import log

from .common import NO_REPLY, HopResult, live_node_ids
from .membership import ASKED_AGAIN, JOINED, RETURNED, START, Membership, placement


class Admission:
    """Placing nodes that joined, came back or were asked again, and resting silent ones."""

    membership: Membership
    setup_record: dict[str, Any]
    round_timeout: float | None
    _round: int
    _deferred: set[int]
    _membership_record: dict[str, Any]
    _round_hops: list[HopResult]
    _placing_hops: list[HopResult]

    def _note_silences(self, part: HopResult) -> None:
        """Rest the nodes that let this hop time out, wake those that answered (`membership`)."""
        answered = [reply.node_id for reply in part.replies] + [m.request.node_id for m in part.misses if m.answered]
        silent = [miss.request.node_id for miss in part.misses if miss.reason == NO_REPLY]
        for node, rounds in self.membership.note_hop(self._round, answered, silent).items():
            if rounds:
                log(WARNING, "Node %s let %d hops in a row time out (%s s each): it sits out the next %d round(s)",
                    node, self.membership.silences[node], self.round_timeout, rounds)

    def awake(self, nodes: Iterable[int], never_empty: bool = True) -> list[int]:
        """`nodes` without those that rest after letting hops time out (`membership.rest_rounds`);
        with `never_empty`, all of `nodes` when every one of them rests (a round's selection is
        never emptied by rests; a stand-in for a lost hop is better none than a resting node)."""
        nodes = list(nodes)
        resting = self.membership.resting(self._round)
        return [node for node in nodes if node not in resting] or (nodes if never_empty else [])

    def _place_start(self, grid: Grid) -> None:
        """After setup: place the connected nodes that setup did not place. For a strategy
        without a stage 1 that is every node, placed without a record per node; after a stage 1
        it is the nodes it deferred (`defer`) and those that connected while it ran, placed as
        nodes that joined (recorded in the setup record's ``placements``)."""
        staged = bool(self.membership.places)
        unplaced = [node for node in live_node_ids(grid) if node not in self.membership.places]
        deferred, self._deferred = self._deferred, set()
        groups = (
            ([n for n in unplaced if n in deferred], ASKED_AGAIN), ([n for n in unplaced if n not in deferred], JOINED)
        ) if staged else ((unplaced, START),)
        placements = self.setup_record.setdefault("placements", []) if staged and unplaced else None
        for nodes, why in groups:
            for node, where in (self.place(grid, nodes, why, 0).items() if nodes else ()):
                self.settle(node, where, why, placements)
        self.setup_record["start_nodes"] = len(self.membership.places)

    def defer(self, nodes: Iterable[int]) -> None:
        """Leave `nodes` (connected at the start, their stage-1 reply missing or rejected: lost on
        the way, or a node that came up slowly) without a place for now: right after `setup`,
        stage 1 asks them once more, as it asks a node that joins (`place` with ASKED_AGAIN);
        only a second failure places them without stage-1 information."""
        self._deferred.update(int(node) for node in nodes)

    def settle(self, node: int, where: Any, why: str, placements: list[dict[str, Any]] | None = None) -> None:
        """Record `node`'s place; a placement for a reason other than START is also appended to
        `placements` (a strategy's setup record keeps its own)."""
        self.membership.settle(node, where)
        if placements is not None and why != START:
            placements.append(placement(node, where, why))

    def _admit(self, grid: Grid, server_round: int) -> None:
        """The start of a round: place the nodes that joined or came back, and note who left."""
        self._round = server_round
        live = live_node_ids(grid)
        changes = self.membership.look(live)
        for node in changes.returned:
            self.membership.wake(node)
        placements: list[dict[str, Any]] = []
        for nodes, why in ((changes.new, JOINED), (changes.returned, RETURNED)):
            if nodes:
                for node, where in self.place(grid, nodes, why, server_round).items():
                    self.settle(node, where, why, placements)
        self._membership_record = {"connected": len(live)}
        if resting := sorted(self.membership.resting(server_round) & set(live)):
            self._membership_record["resting"] = resting
        for key, nodes in (("joined", changes.new), ("returned", changes.returned), ("left", changes.left)):
            if nodes:
                self._membership_record[key] = nodes
        if placements:
            self.record("placements", placements)
        if changes.new or changes.returned or changes.left:
            where = {entry["node"]: entry["where"] for entry in placements}
            unplaced = [node for node in changes.new + changes.returned if node not in where]
            log(
                INFO,
                "Round %s: %d nodes connected; joined %s, came back %s, left %s; placed (node: where) %s%s",
                server_round, len(live), changes.new, changes.returned, changes.left, where,
                f"; not placed yet {unplaced}" if unplaced else "",
            )

    def _trained_nodes(self) -> set[int]:
        """The nodes that had a training reply accepted this round (placing hops aside)."""
        placing = {id(hop) for hop in self._placing_hops}
        return {
            reply.node_id
            for hop in self._round_hops
            if id(hop) not in placing
            for reply in hop.replies
            if reply.request.message_type.startswith(MessageType.TRAIN)
        }
