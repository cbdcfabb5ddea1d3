"""strata.retry.CallAttempts: one call's attempts, counted against its policy and its overall timeout.

The sync and asyncio clients both decide their retries here, so these rules hold for both; the
clients themselves are tested against a real server in test_client_retry.py.
"""

from __future__ import annotations

import random
import time

import grpc
import pytest

from strata.retry import PUSHBACK_KEY, CallAttempts, RetryPolicy

# No jitter and a fixed backoff, so that every un-hinted wait is exactly 0.01 s.
POLICY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, backoff_multiplier=1.0, jitter=0.0)


def failure(code: grpc.StatusCode, *trailers: tuple[str, str]) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), "refused")


def test_each_failure_counts_and_the_last_allowed_attempt_is_not_retried() -> None:
    attempts = CallAttempts(POLICY, None, random.Random(0))
    overloaded = failure(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert attempts.delay_after(overloaded) == pytest.approx(0.01)
    assert attempts.delay_after(overloaded) == pytest.approx(0.01)
    assert attempts.delay_after(overloaded) is None


def test_a_server_hint_is_the_wait() -> None:
    attempts = CallAttempts(POLICY, None)
    assert attempts.delay_after(failure(grpc.StatusCode.UNAVAILABLE, (PUSHBACK_KEY, "250"))) == 0.25


def test_an_attempt_that_delivered_part_of_its_answer_is_never_retried() -> None:
    attempts = CallAttempts(POLICY, None)
    assert attempts.delay_after(failure(grpc.StatusCode.UNAVAILABLE), delivered=True) is None


def test_a_code_outside_the_policy_goes_to_the_caller() -> None:
    attempts = CallAttempts(POLICY, None)
    assert attempts.delay_after(failure(grpc.StatusCode.INVALID_ARGUMENT)) is None


def test_the_timeout_bounds_every_attempt_and_every_wait() -> None:
    assert CallAttempts(POLICY, None).time_left_s() is None
    attempts = CallAttempts(POLICY, 0.2)
    left = attempts.time_left_s()
    assert left is not None
    assert 0.0 < left <= 0.2
    # A hint longer than what is left of the call is not waited out.
    assert attempts.delay_after(failure(grpc.StatusCode.UNAVAILABLE, (PUSHBACK_KEY, "500"))) is None
    expired = CallAttempts(POLICY, 0.01)
    time.sleep(0.02)  # the time under test: the call's 10 ms pass
    assert expired.time_left_s() == 0.0
