"""docker-compose.yml starts the same SuperLink/SuperNodes as the native deployment test.

No Docker engine is needed: the file is parsed and its commands compared with the commands
`concatfl.launch` uses for real processes (which tests/test_e2e_foundation.py runs).
"""

from pathlib import Path

import yaml

from concatfl.launch import PROJECT_DIR, superlink_command, supernode_command

COMPOSE = yaml.safe_load((PROJECT_DIR / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def supernodes():
    return sorted(name for name in SERVICES if name.startswith("supernode-"))


def test_superlink_command_matches_native_deployment():
    assert SERVICES["superlink"]["command"] == superlink_command(
        "0.0.0.0", 8000, "/var/lib/flwr/state.db", simulation=False
    )
    assert "8000:8000" in SERVICES["superlink"]["ports"]


def test_each_supernode_holds_its_own_partition_and_reaches_the_superlink():
    names = supernodes()
    assert names == [f"supernode-{i}" for i in range(len(names))] and len(names) >= 2
    for partition_id, name in enumerate(names):
        assert SERVICES[name]["command"] == supernode_command("superlink:8000", 9094, partition_id, len(names))
        assert "superlink" in SERVICES[name]["depends_on"]


def test_volumes_and_submit_connection_are_declared():
    superlink_volumes = SERVICES["superlink"]["volumes"]
    assert any(v.startswith("superlink-state:") and v.endswith("/var/lib/flwr") for v in superlink_volumes)
    assert set(COMPOSE["volumes"]) >= {"superlink-state", "outputs"}
    submit = SERVICES["submit"]
    config = (PROJECT_DIR / "deploy/flwr-home/config.toml").read_text()
    assert 'address = "superlink:8000"' in config and submit["entrypoint"][:3] == ["flwr", "run", "/app"]
    assert Path(PROJECT_DIR / "Dockerfile").read_text().count("scripts/install.sh") == 1
