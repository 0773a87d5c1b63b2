"""Faults with real processes: SuperNodes SIGKILLed mid-run and restarted, and a misbehaving
ClientApp. Every deployment runs over TLS with SuperNode authentication, so a restarted
SuperNode (same key) comes back with the same node id and the same partition.

Timing: a SIGKILLed node stays listed as online for up to two heartbeat intervals (2 x 30 s,
fixed in Flower 1.42); the SuperLink refuses to re-activate its node id before that, and at that
moment answers the message the dead node never replied to with a "Node Unavailable" error reply
(so the missed hop ends after <= 60 s, or after `round-timeout` = 90 s at the latest). The node is
restarted as soon as the SuperLink accepts it (a few seconds later).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict

from concatfl import PROJECT_DIR
from concatfl.deployment.commands import superlink_security
from concatfl.deployment.fleet import Node, log_count, make_certificates, online_node_ids, restart_when_possible, start_authenticated_nodes, wait_for
from concatfl.deployment.processes import kill_process_tree
from concatfl.deployment.session import FlowerSession
from concatfl.metrics import read_metrics
from concatfl.strategies.common import reply_problem

from .deploy import DEPLOY_EXECUTOR, DEPLOY_RUN, FAST_POLLING, misses_of
from .e2e import leftover_processes

MISBEHAVING_APP = PROJECT_DIR / "tests/apps/misbehaving"
# How a dead node's miss is recorded: no reply within round-timeout, or the SuperLink's error
# reply once the node's heartbeat expired (`collect` files it under the node it was sent to by
# the id of the message it answers; its source is the SuperLink).
MISSING_REASONS = ("no reply before the round timeout", "error reply: Error: Node Unavailable")


def _is_missing(reason: str) -> bool:
    return reason.startswith(MISSING_REASONS)


def _load_misbehaving_client():
    spec = importlib.util.spec_from_file_location("misbehaving_client", MISBEHAVING_APP / "misbehaving_client.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_fault_of_the_misbehaving_client_is_one_that_validation_rejects():
    client = _load_misbehaving_client()
    template = ArrayRecord({"w": Array(np.ones((2, 2), dtype=np.float32)), "b": Array(np.zeros(2, dtype=np.float32))})
    request = Message(RecordDict({"arrays": template}), dst_node_id=1, message_type=MessageType.TRAIN)
    expected = {"nan": "non-finite", "shape": "shape of", "negative": "must be a whole positive number"}
    assert [client.fault_of_round(r) for r in (1, 2, 3, 4)] == ["nan", "shape", "negative", "nan"]
    for fault, reason in expected.items():
        content = RecordDict({"arrays": ArrayRecord(dict(template.items())), "metrics": MetricRecord({"num-examples": 5})})
        reply = client.corrupt(Message(content, reply_to=_as_received(request)), fault)
        assert reason in reply_problem(reply.content, template)


def _as_received(message: Message) -> Message:
    """A message as a ClientApp receives it (with an id and a source node), so it can be replied to."""
    message.metadata.__dict__["_message_id"] = message.object_id
    message.metadata.__dict__["_src_node_id"] = 0
    return message


def _secure_session(tmp_path, num_supernodes):
    certificates = make_certificates(tmp_path / "certs", num_supernodes)
    session = FlowerSession(
        tmp_path,
        simulation=False,
        superlink_args=superlink_security(certificates, supernode_auth=True),
        root_certificates=certificates.ca_cert,
        env=FAST_POLLING,
        executor=DEPLOY_EXECUTOR,
    )
    return certificates, session


def _kill_and_restart(tmp_path, run_config, num_nodes, kill_at_train_message):
    """Run with `num_nodes` authenticated SuperNodes; SIGKILL the first node that receives its
    `kill_at_train_message`-th train message (at once: it never replies), restart it, and let
    the run finish. Returns (metrics, the killed node's id in metrics.json (its partition id, the
    ServerApp's stable node id), seconds until it was back)."""
    certificates, session = _secure_session(tmp_path, num_nodes)
    output = tmp_path / "output"
    with session:
        nodes = start_authenticated_nodes(session, certificates, list(range(num_nodes)), num_nodes)
        wait_for(lambda: len(online_node_ids(session)) == num_nodes, 90, "all SuperNodes online")
        run_id = session.submit({**DEPLOY_RUN, **run_config, "output-dir": str(output)})

        def reached() -> Node | None:
            for node in nodes.values():
                if log_count(tmp_path / f"supernode-{node.partition_id}.log", "Receiving: train message") >= kill_at_train_message:
                    return node
            return None

        victim = wait_for(reached, 600, f"a node's train message {kill_at_train_message}", interval=0.2)
        kill_process_tree(victim.process)
        restart_seconds = restart_when_possible(session, certificates, victim, num_nodes)
        session.wait(run_id, timeout=900)
        assert session.status(run_id) == "finished:completed"
        assert victim.node_id in online_node_ids(session)  # back, under its registered id
    return read_metrics(output), victim.partition_id, restart_seconds


@pytest.mark.e2e
def test_fedcat_survives_a_killed_and_restarted_supernode(tmp_path):
    # 3 nodes, K = 2 copies, groups redrawn every K rounds (λ = 1). The node can rejoin only
    # after the SuperLink gives up on it (<= 60 s); with the warm executor a round then takes
    # ~2 s, so enough rounds must be left for it to be back and selected again.
    config = {"strategy": "fedcat", "fedcat-k": 2, "fedcat-lambda": 1, "num-server-rounds": 16}
    metrics, victim, restart_seconds = _kill_and_restart(tmp_path, config, 3, kill_at_train_message=2)

    missed = misses_of(metrics, victim)
    assert missed and all(_is_missing(reason) for _, reason in missed), missed
    kill_round = missed[0][0]
    previous_sizes = [0, 0]
    for record in metrics["rounds"]:
        # No copy is lost: every round dispatches K copies and keeps K data sizes.
        assert len(record["copy_to_device"]) == len(record["data_sizes"]) == record["k"] == 2
        if record["offset"] == 0:
            previous_sizes = [0, 0]
        hop = record["hops"][0]
        missed_copies = {miss["tag"] for miss in hop["misses"]}
        for copy, (before, after) in enumerate(zip(previous_sizes, record["data_sizes"])):
            # A missed copy keeps its model and d_i; a replied copy grows by the reply's examples.
            assert (after == before) if copy in missed_copies else (after > before)
        assert hop["replies"] == 2 - len(missed_copies)
        previous_sizes = record["data_sizes"]
    later = [r for r in metrics["rounds"] if r["round"] > kill_round and victim in r["copy_to_device"]]
    replied_later = [r for r in later if victim not in {m["node"] for m in r["hops"][0]["misses"]}]
    assert replied_later, f"restarted node {victim} (back after {restart_seconds:.0f} s) was not selected again"
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"]
    assert leftover_processes(tmp_path) == []


@pytest.mark.e2e
def test_misbehaving_client_is_rejected_and_accuracy_matches_a_clean_run(tmp_path):
    certificates, session = _secure_session(tmp_path, 3)
    clean_output, faulty_output = tmp_path / "clean", tmp_path / "faulty"
    with session:
        # Clean: partitions 0 and 1 of 3. Faulty: the same two plus node 2, misbehaving.
        nodes = start_authenticated_nodes(
            session, certificates, [0, 1, 2], 3, node_config=lambda i: "misbehave='cycle'" if i == 2 else ""
        )
        wait_for(lambda: len(online_node_ids(session)) == 3, 90, "three SuperNodes online")
        run_id = session.submit({"output-dir": str(faulty_output)}, app_dir=MISBEHAVING_APP)
        session.wait(run_id, timeout=900)
        nodes[2].process.terminate()
        wait_for(lambda: len(online_node_ids(session)) == 2, 90, "the misbehaving node to leave")
        run_id = session.submit({"output-dir": str(clean_output)}, app_dir=MISBEHAVING_APP)
        session.wait(run_id, timeout=900)
    faulty, clean = read_metrics(faulty_output), read_metrics(clean_output)
    bad = nodes[2].node_id  # this app answers no identity query, so its nodes keep Flower's ids
    rejections = misses_of(faulty, bad)
    assert [round_ for round_, _ in rejections] == [1, 2, 3]
    for (_, reason), expected in zip(rejections, ("non-finite values", "shape of", "'num-examples' must be a whole positive")):
        assert reason.startswith("rejected: ") and expected in reason, reason
    for record in faulty["rounds"]:
        assert record["hops"][0]["replies"] == 2 and len(record["hops"][0]["misses"]) == 1
    # The rejected replies never reach the average: the good nodes' replies are those of the
    # clean run, so the accuracies agree up to client-side float nondeterminism.
    assert abs(faulty["final_accuracy"] - clean["final_accuracy"]) <= 0.02
    assert leftover_processes(tmp_path) == []
