"""The gateway's one map from failures to gRPC status codes.

Every failure a client can see is a GatewayError (strata.status's StatusError) carrying its status
code and a message that names the field or the limit; RESOURCE_EXHAUSTED also carries a retry hint,
sent as a google.rpc.RetryInfo. Here, too, the codes other services report (an EntryError, a
Rejection, a failed internal call) become what the client sees. This module must not decide *when*
something fails: callers raise, the servicer aborts.
"""

from __future__ import annotations

import grpc

from strata.status import (
    STATUS_DETAILS_KEY,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    abort,
    retry_delay_s,
    status_details,
)
from strata.status import StatusError as GatewayError

__all__ = [
    "STATUS_DETAILS_KEY",
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "GatewayError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "TokenizerUnavailable",
    "Unavailable",
    "abort",
    "from_code",
    "from_rpc_error",
    "retry_delay_s",
    "status_details",
]


class TokenizerUnavailable(Unavailable):
    """The tokenizer service failed a request mid-way (it could not detokenize its tokens): no worker
    retry helps, since every worker's tokens pass through the same service."""


_BY_CODE: dict[int, type[GatewayError]] = {
    grpc.StatusCode.INVALID_ARGUMENT.value[0]: InvalidArgument,
    grpc.StatusCode.NOT_FOUND.value[0]: NotFound,
    grpc.StatusCode.UNAVAILABLE.value[0]: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED.value[0]: DeadlineExceeded,
    grpc.StatusCode.CANCELLED.value[0]: Cancelled,
    grpc.StatusCode.FAILED_PRECONDITION.value[0]: FailedPrecondition,
}


def from_code(code: int, message: str, retry_after_s: float = 1.0) -> GatewayError:
    """The error for a status code another service reported (an EntryError, a Rejection)."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
        return ResourceExhausted(message, retry_after_s)
    # A code we do not expect from a peer is the serving side's failure, never the client's.
    return _BY_CODE.get(code, Unavailable)(message)


def from_rpc_error(error: grpc.aio.AioRpcError, what: str) -> GatewayError:
    """A failed call to an internal service, as the client should see it.

    The client's own deadline or cancellation ends its handler before any internal call returns, so
    an internal call's DEADLINE_EXCEEDED is the gateway's own timeout: the service is unavailable. A
    client's bad input fails its batch entry alone, so a whole call failing is never the client's fault.
    """
    message = f"{what}: {error.code().name}: {error.details()}"
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(message, 1.0)
    return Unavailable(message)
