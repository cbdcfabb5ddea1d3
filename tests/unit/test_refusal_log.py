"""The request log's budget for refusals: a tenant's refusal lines are a token bucket, and the first
line after some were dropped says how many; other failures are never dropped."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from gateway.errors import GatewayError, InvalidArgument, ResourceExhausted
from gateway.refusal_log import REFUSAL_LINES_PER_S, RefusalLog
from gateway.request_trace import RequestTrace
from gateway.request_values import Incoming
from strata.tracing import Tracing
from strata.v1 import gateway_pb2

if TYPE_CHECKING:
    import pytest


def test_a_tenants_refusals_are_logged_at_most_the_budget_a_second_and_the_rest_counted() -> None:
    now = [0.0]
    log = RefusalLog(clock=lambda: now[0])
    burst = int(REFUSAL_LINES_PER_S)
    assert [log.take("flood") for _ in range(burst)] == [0] * burst
    assert [log.take("flood") for _ in range(5)] == [None] * 5
    assert log.take("quiet") == 0, "another tenant has a bucket of its own"
    now[0] += 1.0 / REFUSAL_LINES_PER_S
    assert log.take("flood") == 5, "the first line after the drops says how many"
    assert log.take("flood") is None
    now[0] += 10.0
    assert [log.take("flood") for _ in range(burst)] == [1] + [0] * (burst - 1)


def test_a_flood_of_refusals_writes_a_bounded_number_of_lines_and_other_failures_all(
    caplog: pytest.LogCaptureFixture,
) -> None:
    request = gateway_pb2.GenerateRequest(prompt="hi", model="m")
    tracing = Tracing.off()
    refusals = int(REFUSAL_LINES_PER_S) * 3

    def fail(error: GatewayError, tenant: str) -> None:
        incoming = Incoming(request=request, tenant=tenant)
        RequestTrace(tracing, incoming, time.perf_counter()).fail(request, "r", error)

    with caplog.at_level(logging.INFO, logger="strata.requests"):
        for _ in range(refusals):
            fail(ResourceExhausted("overloaded", 1.0), "refusal-log-test")
        for _ in range(refusals):
            fail(InvalidArgument("bad field"), "refusal-log-test")
    lines = [record for record in caplog.records if record.name == "strata.requests"]
    refused = [r for r in lines if "resource_exhausted" in r.getMessage()]
    assert 1 <= len(refused) <= REFUSAL_LINES_PER_S + 1
    assert len(lines) - len(refused) == refusals
