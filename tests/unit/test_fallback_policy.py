"""The fallback policy alone: each trigger, each switch that turns it off, and the texts clients read."""

from __future__ import annotations

import pytest

from gateway.errors import Unavailable
from gateway.fallback import Detour, FallbackPolicy, Trigger, received
from strata.v1 import gateway_pb2


def _policy(
    *, fallback: str = "small", enabled: bool = True, allow: bool = False, never: bool = False
) -> FallbackPolicy:
    return FallbackPolicy("big", fallback, enabled, allow_fallback=allow, no_fallback=never)


OFF = {
    "no fallback route": (_policy(fallback=""), "no fallback model"),
    "route turned it off": (_policy(enabled=False), "turned off for route 'big'"),
    "request said no_fallback": (_policy(never=True), "no_fallback"),
}


class _Route:
    name = "big"
    fallback = "small"
    fallback_enabled = False


def test_the_policy_reads_the_route_and_the_request_flags() -> None:
    request = gateway_pb2.GenerateRequest(prompt="x", allow_fallback=True, no_fallback=True)
    assert FallbackPolicy.of(_Route(), request) == FallbackPolicy("big", "small", False, True, True)


def test_an_unavailable_primary_goes_to_a_ready_fallback_by_default() -> None:
    detour = _policy().when_unavailable("worker 1.2.3.4:5 is gone", fallback_ready=True)
    assert detour == Detour("small", Trigger.UNAVAILABLE, "primary big unavailable: worker 1.2.3.4:5 is gone")


@pytest.mark.parametrize("case", OFF)
def test_an_unavailable_primary_without_a_usable_fallback_is_unavailable(case: str) -> None:
    policy, why = OFF[case]
    with pytest.raises(Unavailable) as info:
        policy.when_unavailable("not connected yet", fallback_ready=True)
    assert info.value.message.startswith("model 'big' is unavailable: not connected yet")
    if policy.fallback:
        assert why in info.value.message
    assert not policy.usable


def test_both_routes_unavailable_names_both_reasons() -> None:
    with pytest.raises(Unavailable, match="'small' is unavailable too: loading") as info:
        _policy().when_unavailable("refused", fallback_ready=False, fallback_reason="loading")
    assert "'big' is unavailable: refused" in info.value.message


def test_a_saturated_primary_detours_only_requests_that_allow_it() -> None:
    allowed = _policy(allow=True)
    assert allowed.when_saturated("queue full: 64 requests waiting", fallback_free=True) == Detour(
        "small", Trigger.SATURATED, "primary saturated: queue full: 64 requests waiting"
    )
    assert _policy().when_saturated("queue full", fallback_free=True) is None
    assert allowed.when_saturated("queue full", fallback_free=False) is None
    assert _policy(allow=True, never=True).when_saturated("queue full", fallback_free=True) is None
    assert _policy(allow=True, enabled=False).when_saturated("queue full", fallback_free=True) is None
    assert _policy().blocker(Trigger.SATURATED) == "the request did not set allow_fallback"
    assert _policy().blocker(Trigger.FAILED) is None


def test_a_failure_before_the_first_token_is_retried_on_the_fallback() -> None:
    detour = _policy().when_failed("worker ended it with FINISH_REASON_ERROR", 0, "another tokenizer")
    assert detour.trigger is Trigger.FAILED and detour.route == "small"
    assert detour.reason == "primary failed before the first token: worker ended it with FINISH_REASON_ERROR"


def test_a_mid_stream_death_continues_on_a_fallback_with_the_same_tokenizer() -> None:
    detour = _policy().when_failed("stream broke", 7)
    assert detour == Detour(
        "small", Trigger.FAILOVER, "primary big failed mid-stream after 7 tokens: stream broke"
    )


def test_a_mid_stream_death_with_another_tokenizer_says_how_much_the_client_has() -> None:
    with pytest.raises(Unavailable) as info:
        _policy().when_failed("stream broke", 7, "its fallback 'small' has another tokenizer")
    message = info.value.message
    assert "after 7 tokens: stream broke" in message and "another tokenizer" in message
    assert message.endswith("the client received 7 tokens before the failure")


@pytest.mark.parametrize("case", OFF)
@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_failures_without_a_usable_fallback_say_how_much_the_client_has(case: str, tokens: int) -> None:
    policy, why = OFF[case]
    with pytest.raises(Unavailable) as info:
        policy.when_failed("gone", tokens)
    message = info.value.message
    assert message.endswith(received(tokens))
    if policy.fallback:
        assert why in message
    assert ("before its first token" in message) == (tokens == 0)


def test_received_counts_are_spelled_out() -> None:
    assert received(0) == "the client received no tokens"
    assert received(1) == "the client received 1 token before the failure"
    assert received(12) == "the client received 12 tokens before the failure"
