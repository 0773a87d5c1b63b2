"""How concatfl starts Flower's processes: the SuperLink, the fleet door in front of it, SuperNodes
(with the warm executor), with their environment, TLS and SuperNode-authentication flags (natively,
in tests, scripts and the bench, and in docker-compose.yml, whose commands tests/test_compose.py
compares with these)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

# One door per role. The SuperLink's own port serves every API it has (Control: `flwr run/ls/log/stop`
# and `flwr supernode register`; Fleet; Runtime): only the operator's side reaches it (loopback, or a
# management network). SuperNodes reach the fleet door (HAProxy with deploy/haproxy.cfg), which
# passes the Fleet API calls of registered SuperNodes and nothing else.
OPERATOR_PORT = 9093
FLEET_DOOR_PORT = 8000

# How a SuperNode runs its ClientApp tasks: Flower's SuperExec (a new process per message) or
# concatfl's warm executor (one long-lived process per SuperNode, deployment/warm_executor.py) run by
# the SuperNode launcher in its own process (deployment/supernode.py).
EXECUTORS = ("stock", "warm")


def flower_env(flwr_home: Path, ray_tmpdir: Path | None = None) -> dict[str, str]:
    """Environment for Flower's CLI and SuperLink: isolated home, no telemetry or installs.

    Ray puts UNIX sockets under RAY_TMPDIR, whose paths may not exceed 107 bytes: a simulation
    gets a short directory of its own (`ray_tmpdir`) rather than one under a (possibly deep) work
    directory.
    """
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env.update(
        {
            "PATH": bin_dir + os.pathsep + env.get("PATH", ""),
            "FLWR_HOME": str(flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
            "RAY_DEDUP_LOGS": "0",
        }
    )
    if ray_tmpdir is not None:
        env["RAY_TMPDIR"] = str(ray_tmpdir)
    return env


@dataclass(frozen=True)
class Certificates:
    """The files `scripts/make-certs.sh` writes into `directory` (paths as the processes see them:
    a host directory natively, `/certs` inside the docker-compose containers)."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        """The CA certificate every SuperNode and the `flwr` CLI trust."""
        return self.directory / "ca.crt"

    @property
    def superlink_cert(self) -> Path:
        """The SuperLink's server certificate (SANs: 127.0.0.1, localhost, 10.200.0.1, superlink)."""
        return self.directory / "superlink.crt"

    @property
    def superlink_key(self) -> Path:
        """The SuperLink's TLS private key."""
        return self.directory / "superlink.key"

    def supernode_key(self, index: int) -> Path:
        """Authentication private key (OpenSSH, ECDSA P-384) of SuperNode `index`."""
        return self.directory / f"supernode-{index}"

    def supernode_public_key(self, index: int) -> Path:
        """Public key of SuperNode `index`, to register with `flwr supernode register`."""
        return self.directory / f"supernode-{index}.pub"


def superlink_security(certificates: Certificates | None, *, supernode_auth: bool = False) -> tuple[str, ...]:
    """SuperLink flags for TLS (None: `--insecure`) and CLI-managed SuperNode authentication
    (only registered public keys may connect; Flower requires TLS for it)."""
    if certificates is None:
        if supernode_auth:
            raise ValueError("SuperNode authentication needs TLS certificates")
        return ("--insecure",)
    tls = (
        f"--ssl-ca-certfile={certificates.ca_cert}",
        f"--ssl-certfile={certificates.superlink_cert}",
        f"--ssl-keyfile={certificates.superlink_key}",
    )
    return tls + (("--enable-supernode-auth",) if supernode_auth else ())


def supernode_security(
    ca_cert: str | os.PathLike | None, private_key: str | os.PathLike | None = None
) -> tuple[str, ...]:
    """SuperNode flags: trust `ca_cert` for TLS (None: `--insecure`) and authenticate with
    `private_key` (an OpenSSH EC private key whose public key the SuperLink has registered)."""
    if ca_cert is None:
        if private_key is not None:
            raise ValueError("SuperNode authentication needs TLS (a CA certificate)")
        return ("--insecure",)
    flags: tuple[str, ...] = (f"--root-certificates={ca_cert}",)
    return flags + ((f"--auth-supernode-private-key={private_key}",) if private_key is not None else ())


def superlink_command(
    host: str,
    port: int,
    database: str | os.PathLike | None,
    *,
    simulation: bool,
    security: tuple[str, ...] = ("--insecure",),
    health_address: str | None = None,
) -> list[str]:
    """How concatfl starts a SuperLink (natively, in tests and in docker-compose.yml).

    `database` is an SQLite file that keeps the SuperLink's state (registered SuperNode keys,
    runs, messages and their objects) across restarts; None keeps it in memory (Flower's
    default), which is faster: every object a message carries is written to and read from it
    (measured: ~0.4 s of a FedSeq hop on loopback, docs/deployment.md). `security` comes from
    `superlink_security`; `health_address` (host:port) starts Flower's plain-gRPC health service
    there (docker-compose's healthcheck probes it).
    """
    command = [
        "flower-superlink",
        *security,
        f"--host={host}",
        f"--port={port}",
        *([f"--database={database}"] if database is not None else []),
        "--disable-runtime-dependency-installation",
    ]
    if health_address is not None:
        command.append(f"--health-server-address={health_address}")
    return command + (["--simulation", "--isolation=subprocess"] if simulation else [])


def supernode_command(
    superlink: str,
    port: int,
    partition_id: int,
    num_partitions: int,
    *,
    security: tuple[str, ...] = ("--insecure",),
    health_address: str | None = None,
    node_config: str = "",
    executor: str = "stock",
) -> list[str]:
    """How concatfl starts a SuperNode holding partition `partition_id` of `num_partitions`.

    `port` is the SuperNode's own Runtime API port (one per SuperNode on a host); `security`
    comes from `supernode_security`; `node_config` adds `key=value` pairs for the ClientApp.
    `executor` is "stock" (Flower's `flower-supernode`, which starts Flower's SuperExec: a new
    ClientApp process per message) or "warm" (concatfl's SuperNode launcher with
    `--warm-executor`: Flower's SuperNode with short waits that runs concatfl's warm executor in
    its own process, one long-lived ClientApp process for all tasks; concatfl/deployment/supernode.py).
    """
    check_executor(executor)
    command = [
        *(
            [sys.executable, "-m", "concatfl.deployment.supernode", "--warm-executor"]
            if executor == "warm"
            else ["flower-supernode"]
        ),
        *security,
        f"--superlink={superlink}",
        f"--port={port}",
        f"--node-config=partition-id={partition_id} num-partitions={num_partitions}"
        + (f" {node_config}" if node_config else ""),
    ]
    if health_address is not None:
        command.append(f"--health-server-address={health_address}")
    return command


def check_executor(executor: str) -> None:
    """Raise ValueError unless `executor` is one of EXECUTORS."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")


def fleet_door_command(config: str | os.PathLike) -> list[str]:
    """HAProxy with concatfl's fleet door configuration `config` (deploy/haproxy.cfg; its settings
    come from `fleet_door_env`), in the foreground. Master-worker mode (-W): the master stops its
    worker on SIGTERM also as a container's PID 1 (a lone HAProxy there ignores SIGTERM, and
    `docker stop` waited its 10 s for the SIGKILL)."""
    return ["haproxy", "-W", "-db", "-f", str(config)]


def fleet_door_env(
    address: str, superlink: str, superlink_name: str, certificates: Certificates, health: str
) -> dict[str, str]:
    """The settings deploy/haproxy.cfg reads from its environment.

    `address` (host:port, or :port for every interface) is where SuperNodes reach the door;
    `superlink` the SuperLink's own host:port behind it; `superlink_name` the name the door checks
    in the SuperLink's certificate (one of its SANs: `superlink` in docker-compose, `localhost`
    natively); `certificates` holds ca.crt and the SuperLink's certificate and key, which the door
    presents to SuperNodes; `health` (host:port) answers `GET /health` with 200 while the door has
    the SuperLink as a healthy backend.
    """
    return {
        "FLEET_DOOR_ADDRESS": address,
        "FLEET_DOOR_SUPERLINK": superlink,
        "FLEET_DOOR_SUPERLINK_NAME": superlink_name,
        "FLEET_DOOR_CERTS": str(certificates.directory),
        "FLEET_DOOR_HEALTH": health,
    }
