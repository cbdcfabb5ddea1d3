"""Tenants alone: their settings and errors, the key that names a tenant, and each tenant's quota
(concurrency, tokens per minute with the refund of unused tokens, the priority ceiling) on a clock
the test moves. No I/O."""

from __future__ import annotations

import pytest
from google.rpc import error_details_pb2, status_pb2
from pydantic import SecretStr

from gateway.admission import Priority
from gateway.auth import tenant_of
from gateway.errors import InvalidArgument
from gateway.settings import GatewaySettings
from gateway.tenant_settings import TenantSettings
from gateway.tenants import TenantBook
from strata.settings import SettingsError
from strata.status import QuotaExceeded, status_details
from strata.v1 import gateway_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gateway(**extra: object) -> GatewaySettings:
    return GatewaySettings.build(
        {"tokenizer_address": "t:1", "routes": [{"model": "m", "workers": ["h:1"]}], **extra}
    )


def test_keys_name_their_tenants_and_plain_keys_the_default_one() -> None:
    settings = gateway(
        api_keys=["plain"],
        tenants=[
            {"name": "search", "api_keys": ["k-search"]},
            {"name": "chat", "api_keys": ["k-chat", "k2"]},
        ],
    )
    keys = settings.tenant_keys()
    assert tenant_of("Bearer k-search", keys, "default") == "search"
    assert tenant_of(b"Bearer k2", keys, "default") == "chat"
    assert tenant_of("Bearer plain", keys, "default") == "default"
    assert tenant_of("Bearer nobody", keys, "default") == "default"  # the interceptor refused it before
    assert tenant_of(None, keys, "default") == "default"
    assert set(settings.accepted_keys()) == {b"plain", b"k-search", b"k-chat", b"k2"}


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        ([{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}], "also belongs to tenant 'a'"),
        ([{"name": "a", "api_keys": ["plain"]}], "also belongs to tenant 'default'"),
        ([{"name": "a", "api_keys": ["k"], "weight": 0}], "weight=0.0 must be > 0"),
        (
            [{"name": "a", "api_keys": ["k"], "max_priority": "urgent"}],
            "max_priority='urgent' is not a priority",
        ),
        ([{"name": "a", "api_keys": ["k"], "tokens_per_minute": 0}], "tokens_per_minute=0 must be >= 1"),
        ([{"name": "a"}], "has no api_keys"),
        ([{"name": "a b", "api_keys": ["k"]}], "must be letters, digits"),
        ([{"name": "a", "api_keys": ["k1"]}, {"name": "a", "api_keys": ["k2"]}], "name a tenant twice"),
    ],
)
def test_bad_tenant_settings_fail_at_start_with_the_fix(
    tenants: list[dict[str, object]], message: str
) -> None:
    with pytest.raises(SettingsError, match=message):
        gateway(api_keys=["plain"], tenants=tenants)


def test_concurrency_quota_refuses_with_a_quota_failure_and_frees_on_release() -> None:
    book = TenantBook(
        [TenantSettings(name="a", api_keys=(SecretStr("k"),), max_concurrent_requests=2)], Clock()
    )
    held = [book.reserve("a", 10), book.reserve("a", 10)]
    with pytest.raises(QuotaExceeded) as info:
        book.reserve("a", 10)
    assert "max_concurrent_requests=2" in info.value.message
    status = status_pb2.Status.FromString(status_details(info.value))
    failure = error_details_pb2.QuotaFailure()
    assert any(detail.Unpack(failure) for detail in status.details)
    assert failure.violations[0].subject == "tenant:a"
    assert failure.violations[0].description == "max_concurrent_requests=2"
    held[0].release(5)
    held[0].release(5)  # once only
    assert book.reserve("a", 10)
    assert book.reserve("default", 10**9)  # the default tenant has no limits


def test_tokens_per_minute_reserve_the_whole_request_and_refund_what_it_did_not_use() -> None:
    clock = Clock()
    book = TenantBook([TenantSettings(name="a", api_keys=(SecretStr("k"),), tokens_per_minute=600)], clock)
    first = book.reserve("a", 400)  # prompt + max_new_tokens
    with pytest.raises(QuotaExceeded) as info:
        book.reserve("a", 300)  # 200 left
    assert info.value.retry_after_s == pytest.approx(100 * 60 / 600)  # 100 tokens at 10 a second
    first.release(used_tokens=150)  # 250 unused come back: 450 left
    (status,) = [s for s in book.status() if s.name == "a"]
    assert (status.tokens_left, status.running, status.tokens_per_minute) == (450, 0, 600)
    second = book.reserve("a", 300)
    clock.now += 6.0  # 60 tokens refilled
    (status,) = [s for s in book.status() if s.name == "a"]
    assert status.tokens_left == 150 + 60
    second.release(used_tokens=300)
    clock.now += 600.0
    (status,) = [s for s in book.status() if s.name == "a"]
    assert status.tokens_left == 600  # never more than a minute's worth
    assert book.reserve("a", 5000).tokens == 600  # bigger than a minute: waits for a full bucket only


def test_a_tenants_priority_ceiling() -> None:
    book = TenantBook(
        [TenantSettings(name="batchy", api_keys=(SecretStr("k"),), max_priority="batch")], Clock()
    )
    assert book.priority_for("batchy", gateway_pb2.PRIORITY_UNSPECIFIED) is Priority.BATCH
    assert book.priority_for("batchy", gateway_pb2.PRIORITY_BATCH) is Priority.BATCH
    with pytest.raises(InvalidArgument, match="may ask for batch at most"):
        book.priority_for("batchy", gateway_pb2.PRIORITY_INTERACTIVE)
    assert book.priority_for("default", gateway_pb2.PRIORITY_UNSPECIFIED) is Priority.INTERACTIVE
    assert book.names == ["default", "batchy"]
    assert book.weight("batchy") == 1.0
