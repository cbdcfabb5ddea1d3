"""How many of a tenant's refusals the request log writes: at most REFUSAL_LINES_PER_S a second each.

A flood of calls is mostly refused at once (RESOURCE_EXHAUSTED: overload, quota, the RPC caps' kin in
admission), and a `request_failed` line per refusal costs the gateway more than deciding the refusal:
the log would be the flood's amplifier, on the gateway's one event loop and on the disk. So a tenant's
refusals are logged through a token bucket of REFUSAL_LINES_PER_S lines a second (holding at most that
many), and the first line logged after some were dropped says how many (`suppressed`). Other failures,
and every request that ends, are always logged; the metrics (gateway/metrics.py) count every refusal.
This module only decides whether a line is written; it must not format nor write it (request_trace.py
does).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

REFUSAL_LINES_PER_S = 20.0


class RefusalLog:
    """Per tenant: the bucket's tokens, when it was last filled, and the refusals not logged since the
    last line. Tenants are the configured ones and the default one, so the map stays small."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[float, float, int]] = {}

    def take(self, tenant: str) -> int | None:
        """None when this refusal's line is dropped; else how many of the tenant's were dropped
        before it (0 usually)."""
        now = self._clock()
        tokens, filled, dropped = self._buckets.get(tenant, (REFUSAL_LINES_PER_S, now, 0))
        tokens = min(REFUSAL_LINES_PER_S, tokens + (now - filled) * REFUSAL_LINES_PER_S)
        if tokens < 1.0:
            self._buckets[tenant] = (tokens, now, dropped + 1)
            return None
        self._buckets[tenant] = (tokens - 1.0, now, 0)
        return dropped


REFUSALS = RefusalLog()
"""The gateway's one log of refusals (the request log is one per process, as its logger is)."""
