"""docker-compose healthcheck: ask a Flower health server (`--health-server-address`) if it serves,
or an HTTP health URL (the fleet door's, deploy/haproxy.cfg) if it answers 200.

    python /app/deploy/healthcheck.py 127.0.0.1:8081                  # exit 0 when SERVING
    python /app/deploy/healthcheck.py http://127.0.0.1:8082/health    # exit 0 on 200
"""

import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT = 5  # seconds: compose's healthcheck timeout is 8 s


def main(target: str) -> int:
    """0 when `target` (host:port of a gRPC health service, or an http:// URL) is healthy within
    TIMEOUT seconds, else 1 (with the reason on stderr)."""
    return http_check(target) if target.startswith("http://") else grpc_check(target)


def grpc_check(address: str) -> int:
    """0 when the gRPC health service at `address` answers SERVING, else 1."""
    with grpc.insecure_channel(address) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status
        except grpc.RpcError as error:
            print(f"health check of {address} failed: {error.code().name}", file=sys.stderr)
            return 1
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def http_check(url: str) -> int:
    """0 when `url` answers 200, else 1."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as response:  # noqa: S310 (http:// only)
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as error:
        print(f"health check of {url} failed: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
