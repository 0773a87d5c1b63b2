"""docker-compose healthcheck: ask a Flower health server (`--health-server-address`) if it serves.

    python /app/deploy/healthcheck.py 127.0.0.1:8081     # exit 0 when SERVING
"""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(address: str) -> int:
    """0 when the health service at `address` answers SERVING within 5 s, else 1."""
    with grpc.insecure_channel(address) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError as error:
            print(f"health check of {address} failed: {error.code().name}", file=sys.stderr)
            return 1
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
