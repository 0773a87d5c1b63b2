"""Two hosts on one machine: the SuperLink in one network namespace, the SuperNodes in another,
joined only by a veth pair (10.200.0.1/24 <-> 10.200.0.2/24), running a FedCat job over TLS."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from concatfl.deployment.commands import superlink_security, supernode_security
from concatfl.deployment.fleet import make_certificates, online_node_ids, wait_for
from concatfl.deployment.session import FlowerSession
from concatfl.metrics import read_metrics

from .deploy import DEPLOY_EXECUTOR, DEPLOY_RUN, FAST_POLLING
from .e2e import leftover_processes

pytestmark = pytest.mark.e2e

SERVER_ADDRESS, CLIENT_ADDRESS = "10.200.0.1", "10.200.0.2"


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


def test_fedcat_across_two_network_namespaces(tmp_path, two_hosts):
    server_ns, client_ns = two_hosts
    certificates = make_certificates(tmp_path / "certs", num_supernodes=0)
    output = tmp_path / "output"
    with FlowerSession(
        tmp_path,
        simulation=False,
        host=SERVER_ADDRESS,
        superlink_args=superlink_security(certificates),
        root_certificates=certificates.ca_cert,
        superlink_netns=server_ns,
        cli_netns=client_ns,  # the CLI submits from the client host, over the veth pair
        env=FAST_POLLING,
        executor=DEPLOY_EXECUTOR,
    ) as session:
        for partition_id in range(2):
            session.start_supernode(partition_id, 2, security=supernode_security(certificates.ca_cert), netns=client_ns)
        wait_for(lambda: len(online_node_ids(session)) == 2, 60, "both SuperNodes online")
        run_id = session.submit(
            {**DEPLOY_RUN, "strategy": "fedcat", "fedcat-k": 2, "num-server-rounds": 2, "output-dir": str(output)}
        )
        session.wait(run_id, timeout=400)
        assert f"--superlink={SERVER_ADDRESS}:{session.port}" in " ".join(session.processes[1].args)
    metrics = read_metrics(output)
    assert metrics["strategy"] == "fedcat" and metrics["num_nodes"] == 2
    for record in metrics["rounds"]:
        assert record["hops"][0]["replies"] == 2 and sorted(record["copy_to_device"]) == sorted(record["selected"])
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"]
    assert leftover_processes(tmp_path) == []
