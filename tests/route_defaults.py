"""The admission settings every test stack's routes start from, declared once: no TTFT SLO, and queue
bounds above any test's own burst.

Why off: the TTFT SLO refusal (gateway/admission_judge.py) compares a forecast of this machine's
speed with the route's `ttft_slo_ms`, so a correctness test that passes here is refused
RESOURCE_EXHAUSTED on a machine half as fast. A test whose subject is not admission must not depend
on how fast the machine is, so the harnesses (gateway_harness, admission_harness, fallback_harness,
http_harness, secure_harness, tiny_stack, the launcher configs of launcher_harness and
reliability/harness) give every route these settings. A test whose subject is admission (the SLO,
overload, fallback under load, tenants' quotas, queue bounds) passes its own `ttft_slo_ms` and
`max_queued_*` in the route, which win; `PRODUCT_TTFT_SLO_MS` is the product's default for those that
want it. This module starts nothing and asserts nothing.
"""

from __future__ import annotations

from typing import Any, Final

from gateway.settings import RouteSettings

NO_SLO_ROUTE: Final[dict[str, Any]] = {
    "ttft_slo_ms": 0.0,
    "max_queued_requests": 4096,
    "max_queued_tokens": 1 << 22,
}
"""A test route's admission settings: no forecast refusal, and a queue no test's burst fills."""

PRODUCT_TTFT_SLO_MS: Final[float] = float(RouteSettings.model_fields["ttft_slo_ms"].default)
"""RouteSettings' own SLO, for the admission tests that exercise it as shipped."""


def harness_route(model: str, **settings: Any) -> dict[str, Any]:
    """A route of `model` at NO_SLO_ROUTE; `settings` (workers, fallback, a test's own limits) win."""
    return {"model": model, **NO_SLO_ROUTE, **settings}
