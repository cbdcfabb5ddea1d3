"""The gateway's status mapping: codes from peers, and the RetryInfo that RESOURCE_EXHAUSTED carries."""

from __future__ import annotations

import grpc
import pytest

from gateway.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    GatewayError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    from_code,
    retry_delay_s,
    status_details,
)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.CANCELLED, Cancelled),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        # A peer's internal failure is the serving side's, never the client's fault.
        (grpc.StatusCode.INTERNAL, Unavailable),
        (grpc.StatusCode.UNKNOWN, Unavailable),
    ],
)
def test_peer_codes_map_to_distinct_errors(code: grpc.StatusCode, kind: type[GatewayError]) -> None:
    error = from_code(code.value[0], "why", retry_after_s=2.5)
    assert type(error) is kind
    assert error.message == "why"
    assert error.code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


def test_resource_exhausted_carries_retry_info() -> None:
    details = status_details(ResourceExhausted("full", 1.25))
    assert retry_delay_s(details) == pytest.approx(1.25)
    assert b"full" in details


def test_other_errors_carry_no_retry_hint() -> None:
    assert retry_delay_s(status_details(InvalidArgument("sampling.top_k: bad"))) is None
