"""TLS and SuperNode authentication with real processes (scripts/make-certs.sh, no hand steps).

A SuperLink with TLS and `--enable-supernode-auth` accepts exactly the SuperNodes whose public
keys were registered (with `deploy/register-supernodes.sh`, as docker-compose does); a SuperNode
with an unregistered key, and one that does not trust the CA, cannot join; the two registered
ones complete a FedAvg job after a run with a bad run config failed naming the key. The SuperLink's health service answers `deploy/healthcheck.py`
(compose's healthcheck).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from concatfl import PROJECT_DIR
from concatfl.deployment.cli import CONNECTION
from concatfl.deployment.commands import superlink_security, supernode_security
from concatfl.deployment.fleet import Node, make_certificates, online_node_ids, start_authenticated_node, wait_for
from concatfl.deployment.processes import SimulationError, free_port
from concatfl.deployment.session import FlowerSession
from concatfl.metrics import read_metrics

from .deploy import DEPLOY_EXECUTOR, DEPLOY_RUN, FAST_POLLING
from .e2e import leftover_processes

pytestmark = pytest.mark.e2e


def test_tls_with_supernode_authentication_admits_only_registered_nodes(tmp_path):
    certificates = make_certificates(tmp_path / "certs", num_supernodes=3)
    output = tmp_path / "output"
    health = f"127.0.0.1:{free_port()}"
    with FlowerSession(
        tmp_path,
        simulation=False,
        superlink_args=(*superlink_security(certificates, supernode_auth=True), f"--health-server-address={health}"),
        root_certificates=certificates.ca_cert,
        env=FAST_POLLING,
        executor=DEPLOY_EXECUTOR,
    ) as session:
        assert _healthcheck(health) == 0
        assert _healthcheck(f"127.0.0.1:{free_port()}") == 1  # nothing serves there
        keys = [str(certificates.supernode_public_key(i)) for i in (0, 1)]
        registered_ids = [int(n) for n in re.findall(r'"node-id": (\d+)', _register(session, keys))]
        assert len(registered_ids) == 2
        assert _register(session, keys).count("already registered") == 2  # running it again is harmless
        nodes = {
            i: Node(i, node_id, start_authenticated_node(session, certificates, i, num_partitions=2))
            for i, node_id in zip((0, 1), registered_ids)
        }
        # Key pair 2 exists but was never registered; the last node has a registered key but
        # trusts only the system CAs, not ours.
        unregistered = session.start_supernode(
            2, 2, security=supernode_security(certificates.ca_cert, certificates.supernode_key(2)),
            log_name="unregistered.log",
        )
        untrusting = session.start_supernode(
            0, 2, security=(f"--auth-supernode-private-key={certificates.supernode_key(0)}",),
            log_name="no-ca.log",
        )
        registered = {node.node_id for node in nodes.values()}
        wait_for(lambda: online_node_ids(session) == registered, 60, "the two registered nodes online")
        wait_for(lambda: unregistered.poll() is not None, 60, "the unregistered node to give up")
        wait_for(lambda: untrusting.poll() is not None, 60, "the node without the CA to give up")
        assert unregistered.returncode != 0 and untrusting.returncode != 0
        assert "Failed to activate SuperNode" in (tmp_path / "unregistered.log").read_text()
        assert "CERTIFICATE_VERIFY_FAILED" in (tmp_path / "no-ca.log").read_text()
        assert online_node_ids(session) == registered  # the SuperLink's node list, after both failed

        # A bad run config: the ServerApp refuses it before training, and the run's log says why.
        with pytest.raises(SimulationError, match="fedcat-epsilon"):
            session.wait(session.submit({**DEPLOY_RUN, "fedcat-epsilon": 1.5, "output-dir": str(output)}), timeout=120)
        run_id = session.submit({**DEPLOY_RUN, "strategy": "fedavg", "num-server-rounds": 1, "output-dir": str(output)})
        session.wait(run_id, timeout=400)
    metrics = read_metrics(output)
    assert metrics["num_nodes"] == 2
    hop = metrics["rounds"][0]["hops"][0]
    assert hop["replies"] == 2 and hop["misses"] == []
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"]
    assert leftover_processes(tmp_path) == []


def _register(session: FlowerSession, public_keys: list[str]) -> str:
    """deploy/register-supernodes.sh against the session's SuperLink; its output."""
    done = subprocess.run(
        ["bash", str(PROJECT_DIR / "deploy/register-supernodes.sh"), CONNECTION, *public_keys],
        env=session.env, capture_output=True, text=True, timeout=120, check=True,
    )
    return done.stdout


def _healthcheck(address: str) -> int:
    """Exit code of deploy/healthcheck.py against `address`."""
    command = [sys.executable, str(PROJECT_DIR / "deploy/healthcheck.py"), address]
    return subprocess.run(command, capture_output=True, timeout=30).returncode
