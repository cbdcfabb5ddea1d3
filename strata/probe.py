"""`python -m strata.probe HOST:PORT [--service NAME] [--timeout S]`: a gRPC health check for container
health checks, exiting 0 when the service answers SERVING and 1 otherwise (unreachable, NOT_SERVING,
unknown service), with one line saying which.

Docker's HEALTHCHECK runs it against a service's health port (`--service liveness` for liveness, the
default "" for readiness); Kubernetes has native gRPC probes and needs no program. This module must
not import anything heavy: it runs every few seconds in every container.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 2.0) -> tuple[bool, str]:
    """Whether `service` at `address` is SERVING, and what was found."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            code = exc.code().name if isinstance(exc, grpc.Call) else "error"
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            return False, f"{address} {service or '(server)'}: {code}: {details}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return (
        reply.status == health_pb2.HealthCheckResponse.SERVING,
        f"{address} {service or '(server)'}: {status}",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strata.probe", description=__doc__)
    parser.add_argument("address", help="host:port of the health port")
    parser.add_argument("--service", default="", help='health service name: "" (readiness) or liveness')
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    serving, what = check(args.address, args.service, args.timeout)
    print(what, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
