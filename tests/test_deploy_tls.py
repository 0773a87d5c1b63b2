"""TLS and SuperNode authentication with real processes (scripts/make-certs.sh, no hand steps).

A SuperLink with TLS and `--enable-supernode-auth` accepts exactly the SuperNodes whose public
keys were registered (`flwr supernode register`); a SuperNode with an unregistered key, and one
that does not trust the CA, cannot join; the two registered ones complete a FedAvg job.
"""

from __future__ import annotations

import pytest

from concatfl.launch import FlowerSession, superlink_security, supernode_security
from concatfl.metrics import read_metrics

from .deploy import DEPLOY_RUN, FAST_POLLING, make_certificates, online_node_ids, start_authenticated_nodes, wait_for
from .e2e import leftover_processes

pytestmark = pytest.mark.e2e


def test_tls_with_supernode_authentication_admits_only_registered_nodes(tmp_path):
    certificates = make_certificates(tmp_path / "certs", num_supernodes=3)
    output = tmp_path / "output"
    with FlowerSession(
        tmp_path,
        simulation=False,
        superlink_args=superlink_security(certificates, supernode_auth=True),
        root_certificates=certificates.ca_cert,
        env=FAST_POLLING,
    ) as session:
        nodes = start_authenticated_nodes(session, certificates, [0, 1], num_partitions=2)
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
        assert wait_for(lambda: unregistered.poll() is not None, 60, "the unregistered node to give up") != 0
        assert wait_for(lambda: untrusting.poll() is not None, 60, "the node without the CA to give up") != 0
        assert "Failed to activate SuperNode" in (tmp_path / "unregistered.log").read_text()
        assert "CERTIFICATE_VERIFY_FAILED" in (tmp_path / "no-ca.log").read_text()
        assert online_node_ids(session) == registered  # the SuperLink's node list, after both failed

        run_id = session.submit({**DEPLOY_RUN, "strategy": "fedavg", "num-server-rounds": 1, "output-dir": str(output)})
        session.wait(run_id, timeout=400)
    metrics = read_metrics(output)
    assert metrics["num_nodes"] == 2
    hop = metrics["rounds"][0]["hops"][0]
    assert hop["replies"] == 2 and hop["misses"] == []
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"]
    assert leftover_processes(tmp_path) == []
