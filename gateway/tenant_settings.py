"""Tenants as the gateway's settings declare them: a name, API keys, a weight and optional limits.

A tenant is who pays for a request: admission serves tenants by their weight (fair shares of token
cost) and holds each to its limits (concurrent requests, tokens per minute, the highest priority it
may ask for). Keys map to tenants one to one; the gateway's plain `api_keys` belong to the default
tenant. With no keys at all every request is the default tenant's and nothing is limited. This
module only describes and checks settings: it must not count usage (tenants.py does) nor read
requests.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, SecretStr, model_validator

DEFAULT_TENANT = "default"
PRIORITIES = ("interactive", "batch")


class TenantSettings(BaseModel):
    """One tenant."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """How metrics, logs, spans and ListModels name it (a metric label: only configured names exist)."""
    api_keys: tuple[SecretStr, ...] = ()
    """Keys its clients send as `authorization: Bearer <key>`; a key belongs to one tenant."""
    weight: float = 1.0
    """Its share of a saturated route, relative to the others waiting: 2 gets twice the token cost of 1."""
    max_concurrent_requests: int | None = None
    """Requests it may have admitted and not finished at once, per gateway replica; None: no limit."""
    tokens_per_minute: int | None = None
    """Prompt plus max_new_tokens it may reserve per minute, per gateway replica (unused tokens come
    back when a request ends); None: no limit."""
    max_priority: Literal["interactive", "batch"] = "interactive"
    """The highest priority it may ask for: batch makes its interactive requests INVALID_ARGUMENT."""
    adapters: tuple[str, ...] | None = None
    """The LoRA adapters it may use, by served name (`smollm2:support`, or an alias); another is
    PERMISSION_DENIED. None: every adapter. The base models stay open to it either way."""

    @model_validator(mode="before")
    @classmethod
    def _known_priority(cls, data: object) -> object:
        if isinstance(data, dict) and "max_priority" in data and data["max_priority"] not in PRIORITIES:
            raise ValueError(
                f"tenant {data.get('name')!r}: max_priority={data['max_priority']!r} is not a priority; "
                f"use one of {', '.join(PRIORITIES)}"
            )
        return data

    @model_validator(mode="after")
    def _check(self) -> TenantSettings:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"tenant name {self.name!r} must be letters, digits, - or _ (e.g. search-team)")
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name!r}: weight={self.weight} must be > 0, e.g. 1")
        for field in ("max_concurrent_requests", "tokens_per_minute"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(f"tenant {self.name!r}: {field}={value} must be >= 1, or unset for no limit")
        if not self.api_keys:
            raise ValueError(
                f"tenant {self.name!r} has no api_keys: requests name their tenant by key; add one"
            )
        if any(not key.get_secret_value().strip() for key in self.api_keys):
            raise ValueError(f"tenant {self.name!r}: api_keys must not hold an empty key; remove it")
        return self


def check_tenants(tenants: tuple[TenantSettings, ...], default_keys: tuple[str, ...]) -> None:
    """Raise ValueError naming the fix when two tenants share a name or a key, or when a tenant's key is
    also one of the gateway's plain api_keys (those belong to the default tenant)."""
    names = [tenant.name for tenant in tenants]
    if len(set(names)) != len(names):
        raise ValueError(f"tenants name a tenant twice: {names}; merge them")
    owner: dict[str, str] = dict.fromkeys(default_keys, DEFAULT_TENANT)
    for tenant in tenants:
        for key in tenant.api_keys:
            secret = key.get_secret_value()
            if secret in owner and owner[secret] != tenant.name:
                raise ValueError(
                    f"an API key of tenant {tenant.name!r} also belongs to tenant {owner[secret]!r}: "
                    "a key names one tenant; give each its own key"
                )
            owner[secret] = tenant.name
