"""The gateway's one map from failures to gRPC status codes, and the helper that aborts a call with one.

Every failure a client can see is a GatewayError carrying its status code and a message that names
the field or the limit. RESOURCE_EXHAUSTED also carries a retry hint, sent as a google.rpc.RetryInfo in
the `grpc-status-details-bin` trailer (the richer-error-model convention clients decode). This module
must not decide *when* something fails: callers raise, the servicer aborts.
"""

from __future__ import annotations

from datetime import timedelta
from typing import NoReturn

import grpc
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"


class GatewayError(Exception):
    """A failure with the status code the client must see."""

    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(GatewayError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(GatewayError):
    code = grpc.StatusCode.NOT_FOUND


class Unavailable(GatewayError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(GatewayError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(GatewayError):
    code = grpc.StatusCode.CANCELLED


class FailedPrecondition(GatewayError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(GatewayError):
    """Overload: the client should retry after `retry_after_s` seconds."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


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


def status_details(error: GatewayError) -> bytes:
    """The serialized google.rpc.Status for `error`, with a RetryInfo when it has a retry hint."""
    status = status_pb2.Status(code=error.code.value[0], message=error.message)
    if isinstance(error, ResourceExhausted):
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromTimedelta(timedelta(seconds=max(0.0, error.retry_after_s)))
        status.details.add().Pack(retry)
    return bytes(status.SerializeToString())


def retry_delay_s(details: bytes) -> float | None:
    """The RetryInfo delay in a `grpc-status-details-bin` value; None when it carries none."""
    status = status_pb2.Status.FromString(details)
    for item in status.details:
        retry = error_details_pb2.RetryInfo()
        if item.Unpack(retry):
            return float(retry.retry_delay.ToTimedelta().total_seconds())
    return None


async def abort(context: grpc.aio.ServicerContext, error: GatewayError) -> NoReturn:
    """End the call with the error's status, message and details."""
    await context.abort(
        error.code, error.message, trailing_metadata=((STATUS_DETAILS_KEY, status_details(error)),)
    )
    raise AssertionError("context.abort returned")  # grpc raises; this keeps NoReturn honest
