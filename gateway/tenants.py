"""Each tenant's use of this gateway replica against its limits: concurrent requests, tokens per minute
and the highest priority it may ask for.

A Reservation is one request's hold on its tenant's quota, from admission to its end.
`TenantBook.reserve` takes it at once or raises: QuotaExceeded (RESOURCE_EXHAUSTED, reason "quota",
with a QuotaFailure naming the limit and a RetryInfo for when it frees) or InvalidArgument for a
priority above the tenant's ceiling. It reserves the request's prompt plus max_new_tokens;
`Reservation.release(used)` gives the concurrency back and refunds the tokens it did not use. The
pipeline, which owns the request's lifecycle, releases every reservation on every path. Tokens per
minute is a token bucket (it holds at most a minute's worth and refills at the limit / 60 per second),
so a quiet tenant may burst and the window frees continuously. Limits count per gateway replica: N
replicas behind a load balancer admit N times the limits. This module does no I/O and must not queue
requests (admission_queue.py orders them by tenant).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.adapter_names import check_allowed
from gateway.admission import Priority
from gateway.errors import InvalidArgument
from gateway.metrics import TENANT_REQUESTS, TENANT_RUNNING
from gateway.tenant_settings import DEFAULT_TENANT, TenantSettings
from strata.status import QuotaExceeded
from strata.v1 import gateway_pb2

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from gateway.adapter_names import ModelName

QUOTA_REASON = "quota"


@dataclass(slots=True)
class _Usage:
    """One tenant's counters."""

    settings: TenantSettings
    running: int = 0
    tokens: float = 0.0
    """Tokens in the bucket (tokens_per_minute only)."""
    refilled: float = 0.0
    """When `tokens` was last brought up to date (time.monotonic())."""


class Reservation:
    """One request's hold on its tenant's quota; release it exactly once (later calls do nothing)."""

    def __init__(self, book: TenantBook, tenant: str, tokens: int) -> None:
        self.tenant = tenant
        self.tokens = tokens
        """Tokens taken from the tenant's bucket (0 without a tokens_per_minute limit)."""
        self._book = book
        self._released = False

    def release(self, used_tokens: int) -> None:
        """The request ended having used `used_tokens` (prompt plus generated): refund the rest."""
        if self._released:
            return
        self._released = True
        self._book._give_back(self.tenant, max(0, self.tokens - used_tokens))


class TenantBook:
    """Every configured tenant's usage (and the default tenant's, which has no limits)."""

    def __init__(
        self, tenants: Iterable[TenantSettings], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        now = clock()
        # The default tenant (plain api_keys, or no keys at all): weight 1 and no limits.
        self._usage = {DEFAULT_TENANT: _Usage(TenantSettings.model_construct(name=DEFAULT_TENANT))}
        for tenant in tenants:
            bucket = float(tenant.tokens_per_minute or 0)
            self._usage[tenant.name] = _Usage(tenant, tokens=bucket, refilled=now)

    @property
    def names(self) -> list[str]:
        return list(self._usage)

    def weight(self, tenant: str) -> float:
        return self._usage[tenant].settings.weight

    def priority_for(self, tenant: str, asked: gateway_pb2.Priority.ValueType) -> Priority:
        """The priority a request runs at: the tenant's ceiling when it asks none, InvalidArgument when
        it asks for more than the ceiling."""
        ceiling = (
            Priority.BATCH if self._usage[tenant].settings.max_priority == "batch" else Priority.INTERACTIVE
        )
        if asked == gateway_pb2.PRIORITY_UNSPECIFIED:
            return ceiling
        priority = Priority.BATCH if asked == gateway_pb2.PRIORITY_BATCH else Priority.INTERACTIVE
        if priority < ceiling:
            raise InvalidArgument(
                f"priority: tenant {tenant!r} may ask for {ceiling.name.lower()} at most "
                f"(max_priority), not {priority.name.lower()}"
            )
        return priority

    def check_model(self, tenant: str, name: ModelName, aliases: Mapping[str, str]) -> None:
        """Raise PermissionDenied when the tenant may not use the adapter `name` runs through."""
        allowed = self._usage[tenant].settings.adapters
        check_allowed(name, tenant, None if allowed is None else {aliases.get(a, a) for a in allowed})

    def reserve(self, tenant: str, tokens: int) -> Reservation:
        """Take one request's concurrency and `tokens` from the tenant's quota, or raise QuotaExceeded."""
        usage = self._usage[tenant]
        limits = usage.settings
        if limits.max_concurrent_requests is not None and usage.running >= limits.max_concurrent_requests:
            TENANT_REQUESTS.labels(tenant, QUOTA_REASON).inc()
            raise QuotaExceeded(
                f"tenant {tenant!r} is over its quota: {usage.running} requests running "
                f"(max_concurrent_requests={limits.max_concurrent_requests}); retry when one ends",
                1.0,
                f"tenant:{tenant}",
                f"max_concurrent_requests={limits.max_concurrent_requests}",
            )
        if limits.tokens_per_minute is not None:
            self._refill(usage)
            # A request larger than a minute's worth waits for a full bucket rather than forever.
            need = min(float(tokens), float(limits.tokens_per_minute))
            if usage.tokens < need:
                TENANT_REQUESTS.labels(tenant, QUOTA_REASON).inc()
                wait_s = (need - usage.tokens) * 60.0 / limits.tokens_per_minute
                raise QuotaExceeded(
                    f"tenant {tenant!r} is over its quota: {tokens} tokens asked (prompt plus "
                    f"max_new_tokens), {int(usage.tokens)} left of tokens_per_minute="
                    f"{limits.tokens_per_minute}; retry in {wait_s:.1f} s",
                    wait_s,
                    f"tenant:{tenant}",
                    f"tokens_per_minute={limits.tokens_per_minute}",
                )
            usage.tokens -= need
        else:
            need = 0.0
        usage.running += 1
        TENANT_REQUESTS.labels(tenant, "reserved").inc()
        TENANT_RUNNING.labels(tenant).set(usage.running)
        return Reservation(self, tenant, int(need))

    def status(self) -> list[gateway_pb2.TenantStatus]:
        """Each tenant's running requests, tokens left in its window and limits (ListModels)."""
        statuses = []
        for name, usage in self._usage.items():
            limits = usage.settings
            if limits.tokens_per_minute is not None:
                self._refill(usage)
            statuses.append(
                gateway_pb2.TenantStatus(
                    name=name,
                    weight=limits.weight,
                    running=usage.running,
                    max_concurrent_requests=limits.max_concurrent_requests or 0,
                    tokens_per_minute=limits.tokens_per_minute or 0,
                    tokens_left=int(usage.tokens) if limits.tokens_per_minute is not None else 0,
                )
            )
        return statuses

    def _refill(self, usage: _Usage) -> None:
        per_minute = usage.settings.tokens_per_minute or 0
        now = self._clock()
        usage.tokens = min(float(per_minute), usage.tokens + (now - usage.refilled) * per_minute / 60.0)
        usage.refilled = now

    def _give_back(self, tenant: str, unused_tokens: int) -> None:
        usage = self._usage[tenant]
        usage.running -= 1
        TENANT_RUNNING.labels(tenant).set(usage.running)
        per_minute = usage.settings.tokens_per_minute
        if per_minute is not None:
            self._refill(usage)
            usage.tokens = min(float(per_minute), usage.tokens + unused_tokens)
