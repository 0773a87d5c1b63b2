"""docker-compose.yml starts the same SuperLink, fleet door and SuperNodes as the native deployment
tests, with one door per role.

The file is parsed and its commands compared with the commands `concatfl.deployment.commands` uses for real
processes (tests/test_deploy_tls.py runs them with TLS and SuperNode authentication,
tests/test_deploy_multihost.py behind the fleet door), its networks and published ports are
checked (SuperNodes share a network with the fleet door only; the SuperLink's own port is
published on loopback only), the fleet door's route list is compared with the Fleet API calls of
the installed Flower's SuperNode, and `docker-compose config` validates both compose files.
tests/test_compose_e2e.py runs them.
"""

import inspect
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from flwr.superlink.routers.fleet.router import router as fleet_router
from flwr.supernode.fleet_http_client import FleetHttpClient

from concatfl import PROJECT_DIR
from concatfl.deployment.commands import (
    FLEET_DOOR_PORT,
    OPERATOR_PORT,
    Certificates,
    fleet_door_command,
    fleet_door_env,
    superlink_command,
    superlink_security,
    supernode_command,
    supernode_security,
)
from concatfl.deployment.fleet import make_certificates

COMPOSE = yaml.safe_load((PROJECT_DIR / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
CERTS = Certificates(Path("/certs"))
HEALTH = "0.0.0.0:8081"
DOOR_CONFIG = PROJECT_DIR / "deploy/haproxy.cfg"


def supernodes():
    return sorted(name for name in SERVICES if name.startswith("supernode-"))


def test_superlink_command_matches_native_deployment_with_tls_and_authentication():
    security = superlink_security(CERTS, supernode_auth=True)
    assert SERVICES["superlink"]["command"] == superlink_command(
        "0.0.0.0", OPERATOR_PORT, "/var/lib/flwr/state.db", simulation=False, security=security, health_address=HEALTH
    )
    # The operator's door: the SuperLink's own port, on loopback unless a management address is set.
    assert SERVICES["superlink"]["ports"] == [f"${{OPERATOR_PUBLISH_ADDRESS:-127.0.0.1}}:{OPERATOR_PORT}:{OPERATOR_PORT}"]


def test_fleet_door_runs_haproxy_in_front_of_the_superlink_on_the_published_port():
    door = SERVICES["fleet-door"]
    assert door["command"] == fleet_door_command("/app/deploy/haproxy.cfg")
    health = "127.0.0.1:8082"
    assert door["environment"] == fleet_door_env(
        f":{FLEET_DOOR_PORT}", f"superlink-api:{OPERATOR_PORT}", "superlink", CERTS, health
    )
    assert door["ports"] == [f"${{SUPERLINK_PUBLISH_ADDRESS:-127.0.0.1}}:{FLEET_DOOR_PORT}:{FLEET_DOOR_PORT}"]
    assert door["healthcheck"]["test"][-1] == f"http://{health}/health"
    # SuperNodes reach the door by the name in the SuperLink's certificate; the door reaches the
    # SuperLink by another one, so that its own name never resolves to itself.
    assert door["networks"] == {"operator": {}, "fleet": {"aliases": ["superlink"]}}
    assert SERVICES["superlink"]["networks"] == {"operator": {"aliases": ["superlink-api"]}}


def test_supernodes_share_a_network_with_the_fleet_door_only():
    members = {network: set() for network in COMPOSE["networks"]}
    for name, service in SERVICES.items():
        for network in service["networks"]:  # every service names its networks: no default network
            members[network].add(name)
    assert members == {
        "fleet": {"fleet-door", *supernodes()},
        "operator": {"superlink", "fleet-door", "register", "submit"},
    }
    assert all("ports" not in SERVICES[name] for name in supernodes())


def test_the_fleet_door_passes_exactly_the_fleet_calls_of_a_registered_supernode():
    routes = re.search(r"path -m reg \^/v1/fleet/\(([a-z|-]+)\)\$", DOOR_CONFIG.read_text()).group(1).split("|")
    # Every Fleet API call Flower's SuperNode can make, from its HTTP client's source.
    client_calls = set(re.findall(r'path="/v1/fleet/([a-z-]+)"', inspect.getsource(FleetHttpClient)))
    # register-node/unregister-node: only SuperNodes without a registered key make them.
    assert set(routes) == client_calls - {"register-node", "unregister-node"}
    assert len(routes) == len(set(routes))
    served = {route.path for route in fleet_router.routes}
    assert {f"/v1/fleet/{call}" for call in client_calls} <= served
    assert "unless METH_POST fleet_call" in DOOR_CONFIG.read_text()


@pytest.mark.haproxy
def test_haproxy_accepts_the_fleet_door_configuration(tmp_path):
    certificates = make_certificates(tmp_path, num_supernodes=0)
    env = fleet_door_env(":8000", "127.0.0.1:9093", "localhost", certificates, "127.0.0.1:8082")
    done = subprocess.run(
        ["haproxy", "-c", "-f", str(DOOR_CONFIG)], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_each_supernode_holds_its_own_partition_key_and_data_and_reaches_the_superlink():
    names = supernodes()
    assert names == [f"supernode-{i}" for i in range(len(names))] and len(names) >= 2
    for partition_id, name in enumerate(names):
        service = SERVICES[name]
        security = supernode_security(CERTS.ca_cert, CERTS.supernode_key(partition_id))
        assert service["command"] == supernode_command(
            f"superlink:{FLEET_DOOR_PORT}", 9094, partition_id, len(names), security=security, health_address=HEALTH
        )
        assert service["networks"] == ["fleet"]  # `superlink` there is the fleet door
        assert service["depends_on"]["fleet-door"]["condition"] == "service_healthy"
        assert not any("runtime-dependency-installation" in arg for arg in service["command"])  # off by default
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
    # `register` and `submit` use the operator's door: the SuperLink's own port on their network.
    assert f'address = "superlink:{OPERATOR_PORT}"' in config and f'root-certificates = "{CERTS.ca_cert}"' in config
    assert "insecure" not in config.split("[superlink.compose]")[1]
    assert submit["entrypoint"][:3] == ["flwr", "run", "/app"]
    dockerfile = (PROJECT_DIR / "Dockerfile").read_text()
    for script in ("deploy/healthcheck.py", "deploy/register-supernodes.sh", "deploy/supernode.sh", "deploy/haproxy.cfg"):
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
            f"127.0.0.1:{FLEET_DOOR_PORT}", 9094 + partition_id, partition_id, 2,
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
