"""Two hosts on one machine, as docs/deployment.md documents the native multi-machine recipe: the
SuperLink and its fleet door in one network namespace, the SuperNodes in another, joined only by a
veth pair (10.200.0.1/24 <-> 10.200.0.2/24); TLS and SuperNode authentication on.

The SuperLink listens on its host's loopback only, where the operator's CLI registers the
SuperNodes' keys and submits a FedCat job that completes. On the SuperNodes' host, an outsider
holding the public CA certificate reaches only the fleet door: registering its own key, starting
its own app and listing runs are refused, and the SuperLink's own port cannot be reached. (A
SuperNode with an unregistered key is refused at the door in tests/test_compose_e2e.py, and by
the SuperLink itself in tests/test_deploy_tls.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from concatfl import PROJECT_DIR
from concatfl.deployment.cli import CONNECTION, FlowerCli
from concatfl.deployment.commands import superlink_security
from concatfl.deployment.fleet import make_certificates, online_node_ids, start_authenticated_nodes, wait_for
from concatfl.deployment.processes import SimulationError, port_open
from concatfl.deployment.session import FlowerSession
from concatfl.metrics import read_metrics

from .deploy import DEPLOY_EXECUTOR, DEPLOY_RUN, FAST_POLLING
from .e2e import leftover_processes

pytestmark = [pytest.mark.e2e, pytest.mark.haproxy]

SERVER_ADDRESS, CLIENT_ADDRESS = "10.200.0.1", "10.200.0.2"
# What the fleet door answers to anything but a registered SuperNode's Fleet API calls.
REFUSED = "Not served here"
# An app of the outsider's own (any app that is not the operator's).
OUTSIDER_APP = PROJECT_DIR / "tests/apps/stateful"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str]]:
    """Namespaces (server, client) joined by a veth pair; both removed afterwards, also on failure."""
    tag = os.getpid() % 100_000
    server, client = f"cfl{tag}s", f"cfl{tag}c"
    try:
        _ip("netns", "add", server)
    except (OSError, subprocess.CalledProcessError) as error:
        reason = getattr(error, "stderr", None) or error
        pytest.skip(f"`ip netns add` is not permitted here: {str(reason).strip()}")
    try:
        _ip("netns", "add", client)
        _ip("link", "add", f"v{tag}s", "type", "veth", "peer", "name", f"v{tag}c")
        for namespace, link, address in ((server, f"v{tag}s", SERVER_ADDRESS), (client, f"v{tag}c", CLIENT_ADDRESS)):
            _ip("link", "set", link, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", namespace, "link", "set", link, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")  # each node's own Runtime API is on 127.0.0.1
        yield server, client
    finally:
        # Deleting a namespace deletes the veth end inside it (and so the pair).
        for namespace in (server, client):
            subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)
        assert not {server, client} & set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def test_only_the_operator_registers_and_runs_across_two_hosts_behind_the_fleet_door(tmp_path, two_hosts):
    server_ns, client_ns = two_hosts
    certificates = make_certificates(tmp_path / "certs", num_supernodes=3)
    output = tmp_path / "output"
    with FlowerSession(
        tmp_path,
        simulation=False,
        host=SERVER_ADDRESS,
        superlink_args=superlink_security(certificates, supernode_auth=True),
        root_certificates=certificates.ca_cert,
        superlink_netns=server_ns,  # the operator's CLI runs there too, against the SuperLink's loopback
        fleet_door=certificates,
        env=FAST_POLLING,
        executor=DEPLOY_EXECUTOR,
    ) as session:
        nodes = start_authenticated_nodes(session, certificates, [0, 1], num_partitions=2, netns=client_ns)
        # The outsider, on the SuperNodes' host with nothing but the CA certificate.
        outsider = FlowerCli(tmp_path / "outsider", session.address, root_certificates=certificates.ca_cert, cli_netns=client_ns)
        with pytest.raises(SimulationError, match=REFUSED):
            outsider.register_supernode(certificates.supernode_public_key(2))
        with pytest.raises(SimulationError, match=REFUSED):
            outsider.submit({}, app_dir=OUTSIDER_APP)
        listing = json.loads(outsider.flwr(["ls", CONNECTION, "--format", "json"]))
        assert not listing["success"] and REFUSED in listing["error-message"]
        assert not port_open(SERVER_ADDRESS, session.port, client_ns)  # the SuperLink's own port
        assert port_open(SERVER_ADDRESS, session.door_port, client_ns)

        registered = {node.node_id for node in nodes.values()}
        # Exactly the operator's two (the outsider's key was never registered).
        wait_for(lambda: online_node_ids(session) == registered, 60, "the two registered SuperNodes online")
        run_id = session.submit(
            {**DEPLOY_RUN, "strategy": "fedcat", "fedcat-k": 2, "num-server-rounds": 2, "output-dir": str(output)}
        )
        session.wait(run_id, timeout=400)
        supernode_command = " ".join(nodes[0].process.args)
        assert f"--superlink={SERVER_ADDRESS}:{session.door_port}" in supernode_command
    metrics = read_metrics(output)
    assert metrics["strategy"] == "fedcat" and metrics["num_nodes"] == 2
    for record in metrics["rounds"]:
        assert record["hops"][0]["replies"] == 2 and sorted(record["copy_to_device"]) == sorted(record["selected"])
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"]
    assert leftover_processes(tmp_path) == []
