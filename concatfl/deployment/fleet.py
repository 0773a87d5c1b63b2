"""A fleet of authenticated SuperNodes on one machine: certificates and keys, starting, killing
and restarting nodes, waiting for the SuperLink to see them (the deployment tests and the soak).

Every node runs over TLS with SuperNode authentication, so a restarted SuperNode (same key)
comes back with the same node id and the same partition.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .. import PROJECT_DIR
from .commands import Certificates, supernode_security
from .processes import SimulationError, kill_process_tree
from .session import FlowerSession

T = TypeVar("T")


def make_certificates(directory: Path, num_supernodes: int) -> Certificates:
    """Run scripts/make-certs.sh into `directory`."""
    subprocess.run(
        ["bash", str(PROJECT_DIR / "scripts/make-certs.sh"), str(directory), str(num_supernodes)],
        check=True,
        capture_output=True,
    )
    return Certificates(directory)


@dataclass
class Node:
    """An authenticated SuperNode: its partition, registered node id, key and process."""

    partition_id: int
    node_id: int
    process: subprocess.Popen[bytes]


def start_authenticated_nodes(
    session: FlowerSession,
    certificates: Certificates,
    partitions: list[int],
    num_partitions: int,
    node_config: Callable[[int], str] = lambda _: "",
    netns: str | None = None,
) -> dict[int, Node]:
    """Register the key of SuperNode i (i in `partitions`) and start it with partition i (in
    network namespace `netns` when given)."""
    nodes = {}
    for i in partitions:
        node_id = session.register_supernode(certificates.supernode_public_key(i))
        process = start_authenticated_node(session, certificates, i, num_partitions, node_config(i), netns)
        nodes[i] = Node(i, node_id, process)
    return nodes


def start_authenticated_node(
    session: FlowerSession,
    certificates: Certificates,
    partition_id: int,
    num_partitions: int,
    node_config: str = "",
    netns: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start SuperNode `partition_id` with TLS and its authentication key (in `netns` when given)."""
    security = supernode_security(certificates.ca_cert, certificates.supernode_key(partition_id))
    return session.start_supernode(partition_id, num_partitions, security=security, node_config=node_config, netns=netns)


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 1.0) -> T:
    """Poll `condition` until it returns something truthy (returned); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def online_node_ids(session: FlowerSession) -> set[int]:
    """Node ids the SuperLink lists as online."""
    return {int(node["node-id"]) for node in session.supernodes() if node["status"] == "online"}


def log_count(path: Path, text: str) -> int:
    """How often `text` occurs in a log file (0 when it does not exist yet)."""
    return path.read_text(errors="replace").count(text) if path.exists() else 0


def restart_when_possible(
    session: FlowerSession, certificates: Certificates, node: Node, num_partitions: int, timeout: float = 150
) -> float:
    """Start the killed SuperNode again (same key, so the same node id, and same partition).

    The SuperLink refuses to activate a node id it still lists as online: a SIGKILLed node is
    listed until two heartbeat intervals (2 x 30 s) pass without a heartbeat. So the node is
    started once the SuperLink lists it offline (a start before that exits with "Failed to
    activate SuperNode", and each try costs a SuperNode, an executor and a worker), and retried
    if it still fails. Returns the seconds the restart took.
    """
    started = time.monotonic()
    log_file = session.workdir / f"supernode-{node.partition_id}.log"

    def listed_offline() -> bool:
        try:
            return node.node_id not in online_node_ids(session)
        except (SimulationError, subprocess.TimeoutExpired):  # the SuperLink is down or restarting
            return False

    def attempt() -> bool:
        before = log_count(log_file, "SuperNode ID:")
        process = start_authenticated_node(session, certificates, node.partition_id, num_partitions)
        try:
            wait_for(lambda: process.poll() is not None or log_count(log_file, "SuperNode ID:") > before, 60, "start")
        except AssertionError:  # still trying to reach the SuperLink: stop it before the next try
            kill_process_tree(process)
            return False
        if process.poll() is None:
            node.process = process
            return True
        return False

    wait_for(listed_offline, timeout, f"SuperNode {node.partition_id} to be listed offline", interval=5.0)
    wait_for(attempt, timeout - (time.monotonic() - started), f"SuperNode {node.partition_id} to be accepted again", interval=2.0)
    return time.monotonic() - started
