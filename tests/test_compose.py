"""docker-compose.yml starts the same SuperLink/SuperNodes as the native deployment tests.

The file is parsed and its commands compared with the commands `concatfl.deployment.commands` uses for real
processes (tests/test_deploy_tls.py runs them with TLS and SuperNode authentication), and
`docker-compose config` validates both compose files. tests/test_compose_e2e.py runs them.
"""

import subprocess
from pathlib import Path

import pytest
import yaml

from concatfl import PROJECT_DIR
from concatfl.deployment.commands import Certificates, superlink_command, superlink_security, supernode_command, supernode_security

COMPOSE = yaml.safe_load((PROJECT_DIR / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
CERTS = Certificates(Path("/certs"))
HEALTH = "0.0.0.0:8081"


def supernodes():
    return sorted(name for name in SERVICES if name.startswith("supernode-"))


def test_superlink_command_matches_native_deployment_with_tls_and_authentication():
    security = superlink_security(CERTS, supernode_auth=True)
    assert SERVICES["superlink"]["command"] == superlink_command(
        "0.0.0.0", 8000, "/var/lib/flwr/state.db", simulation=False, security=security, health_address=HEALTH
    )
    assert SERVICES["superlink"]["ports"] == ["${SUPERLINK_PUBLISH_ADDRESS:-127.0.0.1}:8000:8000"]


def test_each_supernode_holds_its_own_partition_key_and_data_and_reaches_the_superlink():
    names = supernodes()
    assert names == [f"supernode-{i}" for i in range(len(names))] and len(names) >= 2
    for partition_id, name in enumerate(names):
        service = SERVICES[name]
        security = supernode_security(CERTS.ca_cert, CERTS.supernode_key(partition_id))
        assert service["command"] == supernode_command(
            "superlink:8000", 9094, partition_id, len(names), security=security, health_address=HEALTH
        )
        assert f"${{SUPERNODE_{partition_id}_DATA:-./data}}:/data:ro" in service["volumes"]
        # deploy/supernode.sh runs it through the launcher with the warm executor inside
        assert service["entrypoint"] == ["bash", "/app/deploy/supernode.sh"]
        assert service["environment"]["CONCATFL_EXECUTOR"] == "${CONCATFL_EXECUTOR:-warm}"
        assert service["depends_on"]["register"]["condition"] == "service_completed_successfully"
    register = SERVICES["register"]
    assert register["command"] == [str(CERTS.supernode_public_key(i)) for i in range(len(names))]
    assert register["depends_on"]["superlink"]["condition"] == "service_healthy"


def test_every_long_running_service_has_a_healthcheck_on_its_health_server():
    for name in ["superlink", *supernodes()]:
        service = SERVICES[name]
        port = service["healthcheck"]["test"][-1].rsplit(":", 1)[1]
        assert f"--health-server-address=0.0.0.0:{port}" in service["command"]
        assert "${CONCATFL_CERTS:-./deploy/certs}:/certs:ro" in service["volumes"]
    assert (PROJECT_DIR / "deploy/healthcheck.py").exists()


def test_volumes_and_submit_connection_are_declared():
    superlink_volumes = SERVICES["superlink"]["volumes"]
    assert "superlink-state:/var/lib/flwr" in superlink_volumes and "outputs:/outputs" in superlink_volumes
    assert set(COMPOSE["volumes"]) >= {"superlink-state", "outputs"}
    submit = SERVICES["submit"]
    config = (PROJECT_DIR / "deploy/flwr-home/config.toml").read_text()
    assert 'address = "superlink:8000"' in config and f'root-certificates = "{CERTS.ca_cert}"' in config
    assert "insecure" not in config.split("[superlink.compose]")[1]
    assert submit["entrypoint"][:3] == ["flwr", "run", "/app"]
    dockerfile = (PROJECT_DIR / "Dockerfile").read_text()
    for script in ("deploy/healthcheck.py", "deploy/register-supernodes.sh", "deploy/supernode.sh"):
        assert script in dockerfile and f"!{script}" in (PROJECT_DIR / ".dockerignore").read_text()


@pytest.mark.compose
def test_second_host_supernodes_run_the_native_command_against_the_published_address():
    # `docker-compose config` fills in the file's defaults: SuperNodes 0 and 1 on the host network.
    resolved = subprocess.run(
        ["docker-compose", "-f", str(PROJECT_DIR / "deploy/supernodes.compose.yml"), "config"],
        capture_output=True, text=True, cwd=PROJECT_DIR, check=True,
    ).stdout
    services = yaml.safe_load(resolved)["services"]
    for partition_id, name in enumerate(["supernode-a", "supernode-b"]):
        service = services[name]
        security = supernode_security(CERTS.ca_cert, CERTS.supernode_key(partition_id))
        assert service["command"] == supernode_command(
            "127.0.0.1:8000", 9094 + partition_id, partition_id, 2,
            security=security, health_address=f"127.0.0.1:{8091 + partition_id}",
        )
        assert service["network_mode"] == "host" and service["entrypoint"] == ["bash", "/app/deploy/supernode.sh"]


@pytest.mark.compose
@pytest.mark.parametrize("compose_file", ["docker-compose.yml", "deploy/supernodes.compose.yml"])
def test_docker_compose_accepts_the_file(compose_file):
    done = subprocess.run(
        ["docker-compose", "-f", str(PROJECT_DIR / compose_file), "config", "-q"],
        capture_output=True, text=True, cwd=PROJECT_DIR,
    )
    assert done.returncode == 0, done.stderr


def test_security_flags_and_authentication_requires_tls():
    assert superlink_security(None) == ("--insecure",) and supernode_security(None) == ("--insecure",)
    assert superlink_security(CERTS, supernode_auth=True) == (
        "--ssl-ca-certfile=/certs/ca.crt",
        "--ssl-certfile=/certs/superlink.crt",
        "--ssl-keyfile=/certs/superlink.key",
        "--enable-supernode-auth",
    )
    assert supernode_security("/certs/ca.crt") == ("--root-certificates=/certs/ca.crt",)
    with pytest.raises(ValueError, match="needs TLS"):
        superlink_security(None, supernode_auth=True)
    with pytest.raises(ValueError, match="needs TLS"):
        supernode_security(None, "/certs/supernode-0")
