"""Elastic membership: one mechanism for every node that has no place in a run.

In a deployment nodes come and go: a SuperNode connects minutes after the run started, crashes
and comes back, or answers stage 1 with nothing usable. A strategy that builds structure over
its nodes (FedSeq's superclients, FedConcat's clusters, FedCat's groups) must give each such node
a place, or the node's data never trains the model. `Membership` remembers where every node was
placed and which placed nodes were connected at the last look; `RelayStrategy` looks at the
start of every round and asks the strategy (`RelayStrategy.place`) where each node without a
place goes, for one of the reasons below (a node whose stage-1 reply was missing or rejected goes
through stage 1 once more, as a node that joins does, before the first round), and records every placement the same way for every
strategy: ``{"node", "where", "why"}`` under ``placements`` in the round's record (stage 1's in
the setup record), the round's ``membership`` counts (connected, trained, joined, returned,
left), and one log line when nodes join, come back or leave.

A connected node can still be of no use: a ClientApp that hangs, or a SuperNode killed a moment
ago that the SuperLink lists as online until its heartbeat expires. Every hop to it waits the
whole round timeout, for nothing, round after round. So a node that lets two hops in a row time
out (sends nothing at all; an error or a rejected reply is an answer; one lost reply is the
network's, two the node's) rests: it is left out of the next round, after a third silent hop of
the next 2, then 4, … (`rest_rounds`), and asked again after each rest; any answer or a
reconnection ends its rest. A round never rests all of its candidates.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# Why a node is being placed.
START = "connected at the start"  # placed by the strategy's stage 1 (or the run's first round)
JOINED = "joined after the start"  # connected for the first time after the run started
RETURNED = "came back"  # placed before, not connected at the last look, connected again
ASKED_AGAIN = "no usable stage-1 reply, asked again"  # connected at the start, its stage-1 reply missing or rejected

MAX_REST_ROUNDS = 8


def rest_rounds(silences: int) -> int:
    """Rounds a node sits out after `silences` hops in a row that it let time out: none after
    the first, then 1, 2, 4, … at most MAX_REST_ROUNDS (a node that hangs for good costs a
    timeout every MAX_REST_ROUNDS + 1 rounds; one that recovers waits at most that long)."""
    return 0 if silences < 2 else min(2 ** (silences - 2), MAX_REST_ROUNDS)


@dataclass(frozen=True)
class Changes:
    """What changed since the last look: nodes never placed, placed nodes back, placed nodes gone."""

    new: list[int]
    returned: list[int]
    left: list[int]


@dataclass
class Membership:
    """Where every node of the run was placed, and which placed nodes were connected at the last look.

    `places[node]` is the JSON-ready place the strategy gave the node ("pool" for strategies that
    sample from every connected node each round).
    """

    places: dict[int, Any] = field(default_factory=dict)
    connected: set[int] = field(default_factory=set)
    trained: set[int] = field(default_factory=set)  # nodes that had a training reply taken
    silences: dict[int, int] = field(default_factory=dict)  # hops in a row a node let time out
    rest_until: dict[int, int] = field(default_factory=dict)  # the last round a silent node sits out

    def look(self, live: Iterable[int]) -> Changes:
        """Compare the connected nodes `live` with the last look (placed nodes only are remembered)."""
        now = {int(node) for node in live}
        placed = now & self.places.keys()
        changes = Changes(
            new=sorted(now - self.places.keys()),
            returned=sorted(placed - self.connected),
            left=sorted(self.connected - now),
        )
        self.connected = placed
        return changes

    def note_hop(self, server_round: int, answered: Iterable[int], silent: Iterable[int]) -> dict[int, int]:
        """After a hop of `server_round`: the nodes that `answered` end their rest, each `silent`
        one (nothing before the timeout) rests; returns the rounds each silent node now sits out."""
        for node in answered:
            self.wake(node)
        rests = {}
        for node in silent:
            node = int(node)
            self.silences[node] = self.silences.get(node, 0) + 1
            rests[node] = rest_rounds(self.silences[node])
            self.rest_until[node] = server_round + rests[node]
        return rests

    def wake(self, node: int) -> None:
        """`node` answered or connected again: it no longer rests."""
        self.silences.pop(int(node), None)
        self.rest_until.pop(int(node), None)

    def resting(self, server_round: int) -> set[int]:
        """The nodes that sit out `server_round` (and those silent in it, for its later hops)."""
        return {node for node, last in self.rest_until.items() if last >= server_round}

    def settle(self, node: int, where: Any, connected: bool = True) -> None:
        """Record `node`'s place (`connected`: it is connected now)."""
        self.places[int(node)] = where
        if connected:
            self.connected.add(int(node))

    def report(self) -> dict[str, Any]:
        """metrics.json's ``membership``: how many nodes had a place, and which never trained."""
        return {"placed": len(self.places), "never_trained": sorted(self.places.keys() - self.trained)}

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: node ids as strings (JSON object keys)."""
        return {
            "places": {str(node): where for node, where in self.places.items()},
            "connected": sorted(self.connected),
            "trained": sorted(self.trained),
            "silences": {str(node): count for node, count in self.silences.items()},
            "rest_until": {str(node): last for node, last in self.rest_until.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output."""
        self.places = {int(node): where for node, where in state["places"].items()}
        self.connected = {int(node) for node in state["connected"]}
        self.trained = {int(node) for node in state["trained"]}
        # Checkpoints written before nodes rested have neither.
        self.silences = {int(node): int(count) for node, count in state.get("silences", {}).items()}
        self.rest_until = {int(node): int(last) for node, last in state.get("rest_until", {}).items()}


def placement(node: int, where: Any, why: str) -> dict[str, Any]:
    """One placement as metrics.json records it."""
    return {"node": int(node), "where": where, "why": why}
