"""The status errors every Strata server raises, and the RetryInfo that rides with an overload.

Each service maps failures to gRPC status codes in one place (gateway/errors.py,
services/tokenizer/errors.py, services/worker/errors.py); this module gives the first two the shared
vocabulary: a StatusError whose class fixes its code, a message that names the field or the limit, and
for RESOURCE_EXHAUSTED a retry hint sent twice: as a google.rpc.RetryInfo in the
`grpc-status-details-bin` trailer (the rich-error convention standard clients decode; strata.retry
reads it back) and as the `grpc-retry-pushback-ms` trailer that gRPC's own retry policy obeys. This
module must not decide when anything fails.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

if TYPE_CHECKING:
    from collections.abc import Iterable

STATUS_DETAILS_KEY = "grpc-status-details-bin"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
ELAPSED_KEY = "strata-elapsed-ms"
"""A failed call's trailer: the server's own milliseconds from the request's arrival to the decision."""


class StatusError(Exception):
    """A failure with the status code the caller must see."""

    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.metadata: tuple[tuple[str, str], ...] = ()
        """More trailing metadata for the call that fails with it (such as ELAPSED_KEY)."""
        self.created = time.perf_counter()
        """When the failure was decided: the call may end a few event-loop turns later."""


class InvalidArgument(StatusError):
    """Malformed or over a limit; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(StatusError):
    """A named thing (a model) does not exist here."""

    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(StatusError):
    """The caller is known but may not use what it named (an adapter outside its tenant's list)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(StatusError):
    """The request is well formed but the system is not in a state to serve it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(StatusError):
    """A service is down, loading or draining; retrying later may work."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(StatusError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(StatusError):
    code = grpc.StatusCode.CANCELLED


class ResourceExhausted(StatusError):
    """Overload: the caller should retry after `retry_after_s` seconds."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaExceeded(ResourceExhausted):
    """Over a quota: which one (`subject`, such as "tenant:search") and what it allows (`limit`)."""

    def __init__(self, message: str, retry_after_s: float, subject: str, limit: str) -> None:
        super().__init__(message, retry_after_s)
        self.subject = subject
        self.limit = limit


def status_details(error: StatusError) -> bytes:
    """The serialized google.rpc.Status for `error`, with a RetryInfo when it has a retry hint and a
    QuotaFailure naming the limit when it is over a quota."""
    status = status_pb2.Status(code=error.code.value[0], message=error.message)
    if isinstance(error, ResourceExhausted):
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromTimedelta(timedelta(seconds=max(0.0, error.retry_after_s)))
        status.details.add().Pack(retry)
    if isinstance(error, QuotaExceeded):
        violation = error_details_pb2.QuotaFailure.Violation(subject=error.subject, description=error.limit)
        status.details.add().Pack(error_details_pb2.QuotaFailure(violations=[violation]))
    return bytes(status.SerializeToString())


def elapsed_s(metadata: Iterable[tuple[str, str | bytes]]) -> float | None:
    """The server's ELAPSED_KEY trailer in seconds; None when absent or not a number."""
    for key, value in metadata:
        if key == ELAPSED_KEY:
            try:
                return float(value) / 1000.0
            except ValueError:
                return None
    return None


def retry_delay_s(details: bytes) -> float | None:
    """The RetryInfo delay in a `grpc-status-details-bin` value; None when it carries none or is garbled."""
    status = status_pb2.Status()
    try:
        status.ParseFromString(details)
    except DecodeError:
        return None
    for item in status.details:
        retry = error_details_pb2.RetryInfo()
        if item.Is(retry.DESCRIPTOR) and item.Unpack(retry):
            return float(retry.retry_delay.ToTimedelta().total_seconds())
    return None


def trailers(error: StatusError) -> tuple[tuple[str, str | bytes], ...]:
    """The trailing metadata for `error`: rich-status details, and the pushback of a retry hint."""
    metadata: tuple[tuple[str, str | bytes], ...] = ((STATUS_DETAILS_KEY, status_details(error)),)
    if isinstance(error, ResourceExhausted):
        pushback_ms = round(max(0.0, error.retry_after_s) * 1000)
        metadata += ((RETRY_PUSHBACK_KEY, str(pushback_ms)),)
    return metadata + error.metadata


async def abort(context: grpc.aio.ServicerContext[object, object], error: StatusError) -> NoReturn:
    """End the call with the error's status, message, rich-status details and retry pushback."""
    await context.abort(error.code, error.message, trailing_metadata=trailers(error))
    raise AssertionError("context.abort returned")  # grpc raises; this keeps NoReturn honest
