"""docker-compose.yml run as a user runs it, with a real Docker engine.

The image is built by deploy/build-images.sh (offline, cached: seconds when nothing changed),
certificates come from scripts/make-certs.sh, the stack comes up with `docker-compose up -d`
(TLS, SuperNode authentication, the fleet door, healthchecks, SuperNodes with the warm executor),
and then: an outsider on the host holding the CA certificate, at the published SuperNodes' port,
can neither register its own SuperNode key nor run its own app nor list runs; a FedCat job
through the `submit` service; a FedSeq job from the host's `flwr run` (the operator's door, the
SuperLink's own port on loopback) during which a SuperNode container is `docker kill`ed and
started again; an unregistered SuperNode container on the SuperNodes' network, which cannot
reach the SuperLink itself either; SuperNodes of a second "host" (deploy/supernodes.compose.yml,
host network) that reach the SuperLink only through the published fleet door; `docker-compose
down -v`.

They need a Docker engine and docker-compose: without them they are skipped (tests/conftest.py
says how to run them), except under CONCATFL_REQUIRE_DOCKER=1, which `.ci/run` sets after it
installs docker.io and starts dockerd: there a missing engine fails the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from concatfl import PROJECT_DIR
from concatfl.deployment.cli import CONNECTION, FlowerCli
from concatfl.deployment.commands import FLEET_DOOR_PORT, OPERATOR_PORT
from concatfl.deployment.fleet import make_certificates, wait_for
from concatfl.deployment.processes import SimulationError
from concatfl.deployment.warm_executor import task_records

from .deploy import misses_of

pytestmark = [pytest.mark.e2e, pytest.mark.docker]

PROJECT = "concatfl-e2e"
SECOND_HOST = "concatfl-e2e-host2"
IMAGE = "concatfl:0.1.0"
# The operator's door (the SuperLink's own port) and the SuperNodes' (the fleet door), as published.
OPERATOR_ADDRESS = f"127.0.0.1:{OPERATOR_PORT}"
FLEET_DOOR_ADDRESS = f"127.0.0.1:{FLEET_DOOR_PORT}"
# What the fleet door answers to anything but a registered SuperNode's Fleet API calls.
REFUSED = "Not served here"
# Keys 0 and 1: the `register` service; 2 and 3: the second host's SuperNodes, registered by an
# administrator with the CLI; 4: never registered.
NUM_KEYS = 5
UNREGISTERED_KEY = 4
# What a SuperNode logs when it takes a train message from the SuperLink.
TRAIN_RECEIVED = "Receiving: train message"
# A short job on the embedded digits dataset (one data partition per SuperNode).
JOB = {"local-epochs": 1, "batch-size": 32, "lr": 0.1, "round-timeout": 90.0, "seed": 0}


def docker(*args: str, timeout: float = 300, check: bool = True, env: dict[str, str] | None = None) -> str:
    """Run the docker CLI; return its stdout (and fail with its output when `check`)."""
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and done.returncode != 0:
        raise AssertionError(f"`docker {' '.join(args)}` failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout + done.stderr


class Compose:
    """`docker-compose -p PROJECT -f FILE` with the environment the compose file reads."""

    def __init__(self, project: str, file: Path, env: dict[str, str]) -> None:
        self.project = project
        self.file = file
        self.env = {**os.environ, **env}

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["docker-compose", "-p", self.project, "-f", str(self.file), *args],
            capture_output=True, text=True, timeout=timeout, env=self.env, cwd=PROJECT_DIR,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"`docker-compose {' '.join(args)}` failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def container(self, service: str) -> str:
        """The id of `service`'s container."""
        return self("ps", "-q", service).stdout.strip()

    def health(self, service: str) -> str:
        container = self.container(service)
        return docker("inspect", "-f", "{{.State.Health.Status}}", container).strip() if container else "absent"

    def wait_healthy(self, *services: str, timeout: float = 180) -> None:
        wait_for(lambda: all(self.health(s) == "healthy" for s in services), timeout, f"{services} healthy", 2.0)

    def resources(self) -> dict[str, list[str]]:
        """Every container, network and volume of this project that Docker still has."""
        label = f"label=com.docker.compose.project={self.project}"
        return {
            kind: docker(kind, "ls", "-q", *(["-a"] if kind == "container" else []), "--filter", label).split()
            for kind in ("container", "network", "volume")
        }


def outputs_file(compose: Compose, path: str) -> str:
    """A file from the `outputs` volume (read through the SuperLink container)."""
    return compose("exec", "-T", "superlink", "cat", f"/outputs/{path}").stdout


@pytest.fixture(scope="module")
def engine() -> None:
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        pytest.fail("the docker and docker-compose commands are needed (.ci/run installs docker.io and docker-compose)")
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.fail("no Docker engine answers: start `dockerd` (.ci/run starts it)")
    started = time.monotonic()
    subprocess.run(["bash", str(PROJECT_DIR / "deploy/build-images.sh")], check=True, timeout=1800)
    print(f"image build: {time.monotonic() - started:.1f} s")


@pytest.fixture(scope="module")
def stack(engine, tmp_path_factory):
    """The compose stack (SuperLink, register, two SuperNodes) up and healthy, and a host CLI."""
    workdir = tmp_path_factory.mktemp("compose")
    certificates = make_certificates(workdir / "certs", NUM_KEYS)
    shutil.chown(workdir / "certs", 49999, 49999)
    for path in (workdir / "certs").iterdir():
        shutil.chown(path, 49999, 49999)  # the containers run as uid 49999
    (workdir / "data").mkdir()  # digits is embedded: the data mounts stay empty
    env = {
        "CONCATFL_CERTS": str(workdir / "certs"),
        "CONCATFL_DATA": str(workdir / "data"),
        "SUPERNODE_0_DATA": str(workdir / "data"),
        "SUPERNODE_1_DATA": str(workdir / "data"),
    }
    compose = Compose(PROJECT, PROJECT_DIR / "docker-compose.yml", env)
    second_host = Compose(SECOND_HOST, PROJECT_DIR / "deploy/supernodes.compose.yml", env)
    for project in (second_host, compose):
        project("down", "-v", "--remove-orphans", check=False)
    started = time.monotonic()
    try:
        compose("up", "-d", "superlink", "fleet-door", "register", "supernode-0", "supernode-1")
        compose.wait_healthy("superlink", "fleet-door", "supernode-0", "supernode-1")
        print(f"stack start: {time.monotonic() - started:.1f} s")
        cli = FlowerCli(workdir / "cli", OPERATOR_ADDRESS, root_certificates=certificates.ca_cert)
        yield compose, second_host, cli, certificates
    finally:
        for project in (second_host, compose):
            project("down", "-v", "--remove-orphans", check=False)


def online_nodes(cli: FlowerCli) -> list[int]:
    return sorted(int(node["node-id"]) for node in cli.supernodes() if node["status"] == "online")


def test_stack_is_healthy_with_registered_supernodes_and_loopback_only_ports(stack):
    compose, _, cli, _ = stack
    assert compose.health("superlink") == "healthy" and compose.health("fleet-door") == "healthy"
    register = docker("inspect", "-f", "{{.State.ExitCode}}", compose("ps", "-a", "-q", "register").stdout.strip())
    assert register.strip() == "0"
    wait_for(lambda: len(online_nodes(cli)) == 2, 60, "two SuperNodes online")
    for service, port in (("superlink", OPERATOR_PORT), ("fleet-door", FLEET_DOOR_PORT)):
        bindings = json.loads(docker("inspect", "-f", "{{json .NetworkSettings.Ports}}", compose.container(service)))
        published = {name: [(b["HostIp"], b["HostPort"]) for b in hosts or []] for name, hosts in bindings.items()}
        assert {name: hosts for name, hosts in published.items() if hosts} == {f"{port}/tcp": [("127.0.0.1", str(port))]}
    for supernode in ("supernode-0", "supernode-1"):  # each through the launcher, with its warm executor's worker
        processes = docker("top", compose.container(supernode))
        assert "concatfl.deployment.supernode --warm-executor" in processes and "warm_executor.py --worker" in processes


def test_an_outsider_with_the_ca_certificate_can_neither_register_a_supernode_nor_run_an_app(stack, tmp_path):
    _, _, cli, certificates = stack
    # Where SuperNodes connect, with the CA certificate every SuperNode and CLI user gets.
    outsider = FlowerCli(tmp_path / "outsider", FLEET_DOOR_ADDRESS, root_certificates=certificates.ca_cert)
    with pytest.raises(SimulationError, match=REFUSED):
        outsider.register_supernode(certificates.supernode_public_key(UNREGISTERED_KEY))
    with pytest.raises(SimulationError, match=REFUSED):
        outsider.submit({}, app_dir=PROJECT_DIR / "tests/apps/stateful")  # an app of its own
    # (Listing runs is refused alike: tests/test_deploy_multihost.py.) The operator sees no run
    # yet (the jobs below come later) and only the two SuperNodes of `register`.
    assert json.loads(cli.flwr(["ls", CONNECTION, "--format", "json"]))["runs"] == []
    assert len(cli.supernodes()) == 2


def test_fedcat_job_through_the_submit_service_completes_with_metrics_in_the_outputs_volume(stack):
    compose, _, cli, _ = stack
    overrides = " ".join(
        [f"{key}={json.dumps(value)}" for key, value in JOB.items()]
        + ["strategy='fedcat'", "fedcat-k=2", "num-server-rounds=4", "output-dir='/outputs/fedcat'"]
    )
    started = time.monotonic()
    submitted = compose("run", "--rm", "submit", "--run-config", overrides, timeout=900)
    elapsed = time.monotonic() - started
    runs = json.loads(cli.flwr(["ls", CONNECTION, "--format", "json"]))["runs"]
    assert [run["status"] for run in runs] == ["finished:completed"], submitted.stdout[-3000:]
    metrics = json.loads(outputs_file(compose, "fedcat/metrics.json"))
    assert metrics["strategy"] == "fedcat" and len(metrics["rounds"]) == 4
    assert all(record["hops"][0]["replies"] == 2 for record in metrics["rounds"])
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"]
    print(f"FedCat, 4 rounds through containers: {elapsed:.1f} s")


def test_fedseq_job_survives_a_killed_and_restarted_supernode_container(stack):
    compose, _, cli, _ = stack
    victim, survivor = compose.container("supernode-0"), compose.container("supernode-1")
    nodes_before = online_nodes(cli)
    received_before = docker("logs", victim).count(TRAIN_RECEIVED)
    survivor_log_before = docker("logs", survivor)
    run_id = cli.submit(
        {**JOB, "strategy": "fedseq", "fedseq-pretrain-epochs": 1, "num-server-rounds": 3, "output-dir": "/outputs/fedseq"}
    )
    # Killed as soon as its first chain hop arrives (its second train message, after pre-training):
    # a crashed host. The SuperLink answers that hop with "Node Unavailable" once the node's
    # heartbeat expired (<= 60 s); the chain goes on without it.
    wait_for(lambda: docker("logs", victim).count(TRAIN_RECEIVED) >= received_before + 2, 300, "its first chain hop", 0.2)
    docker("kill", victim)
    killed = time.monotonic()
    # Started again at once: the SuperLink refuses its node id until its heartbeat expired
    # (<= 60 s); the container exits and its restart policy tries again until it is let in.
    docker("start", victim)
    cli.wait(run_id, timeout=900)
    finished = time.monotonic() - killed
    metrics = json.loads(outputs_file(compose, "fedseq/metrics.json"))
    missed = [miss["reason"] for miss in metrics["setup"]["pretraining"]["misses"] if miss["node"] == 0]
    missed += [reason for _, reason in misses_of(metrics, 0)]  # partition 0: supernode-0's stable id
    assert missed, "the killed SuperNode's miss was not recorded"
    assert len(metrics["rounds"]) == 3
    wait_for(lambda: online_nodes(cli) == nodes_before, 180, "supernode-0 back under its registered node id")
    # supernode-1's warm executor ran every message of the run, each in the same worker process.
    survivor_log = docker("logs", survivor)
    tasks = task_records(survivor_log)[len(task_records(survivor_log_before)):]
    received = survivor_log.count("Receiving: ") - survivor_log_before.count("Receiving: ")
    assert len(tasks) == received >= 4  # pre-training and at least one chain hop per round
    assert {task["status"] for task in tasks} == {"completed"} and len({task["worker_pid"] for task in tasks}) == 1
    print(f"FedSeq, supernode-0 killed: misses {missed}; run completed {finished:.0f} s after the kill")


def test_an_unregistered_supernode_container_is_refused_and_cannot_reach_the_superlink_itself(stack):
    _, _, cli, certificates = stack
    before = online_nodes(cli)
    # On the SuperNodes' network, where `superlink` is the fleet door; then, from the same place,
    # the SuperLink's own port: by its name on the operator's network, and by the door's name.
    probe = (
        "import socket\n"
        f"for target in [('superlink-api', {OPERATOR_PORT}), ('superlink', {OPERATOR_PORT})]:\n"
        "    try:\n"
        "        socket.create_connection(target, timeout=5).close(); print('reached', *target)\n"
        "    except OSError as error:\n"
        "        print('unreachable', *target, type(error).__name__)\n"
    )
    output = docker(
        "run", "--rm", "--network", f"{PROJECT}_fleet",
        "-v", f"{certificates.directory}:/certs:ro", "--entrypoint", "bash", IMAGE, "-c",
        "flower-supernode --root-certificates=/certs/ca.crt"
        f" --auth-supernode-private-key=/certs/supernode-{UNREGISTERED_KEY} --superlink=superlink:{FLEET_DOOR_PORT}"
        f" --node-config='partition-id=0 num-partitions=2'; python -c \"$0\"", probe,
        check=False, timeout=180,
    )
    assert "Failed to activate SuperNode" in output, output[-2000:]
    assert "reached" not in output.replace("unreachable", ""), output[-2000:]
    assert output.count("unreachable") == 2, output[-2000:]
    assert online_nodes(cli) == before


def test_supernodes_of_a_second_host_reach_the_superlink_through_the_published_fleet_door(stack):
    compose, second_host, cli, certificates = stack
    compose("stop", "-t", "5", "supernode-0", "supernode-1")
    for key in (2, 3):
        cli.register_supernode(certificates.supernode_public_key(key))
    second_host.env.update({"SUPERNODE_A_KEY": "supernode-2", "SUPERNODE_B_KEY": "supernode-3"})
    second_host("up", "-d")
    second_host.wait_healthy("supernode-a", "supernode-b")
    for service in ("supernode-a", "supernode-b"):
        mode = docker("inspect", "-f", "{{.HostConfig.NetworkMode}}", second_host.container(service)).strip()
        assert mode == "host"  # not on the first project's network
    run_id = cli.submit({**JOB, "strategy": "fedavg", "num-server-rounds": 1, "output-dir": "/outputs/host2"})
    cli.wait(run_id, timeout=600)
    metrics = json.loads(outputs_file(compose, "host2/metrics.json"))
    assert metrics["num_nodes"] == 2 and metrics["rounds"][0]["hops"][0]["replies"] == 2
    assert metrics["final_accuracy"] > metrics["initial"]["accuracy"]


def test_down_removes_every_container_network_and_volume(stack):
    compose, second_host, _, _ = stack
    for project in (second_host, compose):
        project("down", "-v", "--remove-orphans")
        assert project.resources() == {"container": [], "network": [], "volume": []}
