"""A tenant's fair share of one route's workers: its weight, whether it is below its share on a worker,
the priority its request gets there, and the credits it may take there.

With fair queuing on, each tenant is owed its weighted share of the token cost (prompt plus
max_new_tokens) of the work open on a worker, among the tenants holding some. A request whose tenant
holds less is sent favoured (`worker_priority`): the worker prefills it before the rest of its priority
and, when every running slot is taken, preempts a less favoured sequence for it, so fairness reaches
past the queue into who runs. For that request to reach the worker while another tenant holds every
credit, `fair_reserve_share` of each worker's credits go only to a tenant below its share there
(`usable_credits`), never more than the credits beyond the worker's running limit, which a lone tenant
so still fills. With fair queuing off no tenant is favoured, nothing is reserved, and the route's
queue serves first come, first served (it reads no weight).

This module reads links; it must not change credits, queue slots nor choose a link (route.py does).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gateway.admission import Priority
    from gateway.credits import StreamCredits
    from gateway.forecast import LinkLoad

DEFAULT_WEIGHT = 1.0
"""The weight of a tenant the settings do not name."""


class SharedLink(Protocol):
    """What the share reads of a worker link (a WorkerLink)."""

    @property
    def free_credits(self) -> int: ...

    @property
    def credits(self) -> StreamCredits: ...

    @property
    def load(self) -> LinkLoad: ...


class FairShare:
    """The tenants' weights on one route, and what they make of each of its links."""

    def __init__(self, weights: Mapping[str, float], reserve_share: float, on: bool) -> None:
        self.on = on
        """Fair queuing is on: tenants are weighed, favoured and served their reserve."""
        self._weights = weights
        self._reserve_share = reserve_share

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, DEFAULT_WEIGHT)

    def favoured(self, tenant: str, load: LinkLoad) -> bool:
        """Fair queuing is on and `tenant` holds less than its weighted share of the token cost open on
        `load`'s worker, among the tenants holding some (nothing open: nobody to be favoured over)."""
        if not self.on:
            return False
        costs = load.tenant_costs()
        weights = sum(self.weight(name) for name in {*costs, tenant})
        return costs.get(tenant, 0) < sum(costs.values()) * self.weight(tenant) / weights

    def worker_priority(self, priority: Priority, tenant: str, load: LinkLoad) -> int:
        """Submission.priority for a request of `tenant` on `load`'s worker: its class's, favoured
        when the tenant is below its share there."""
        return priority.worker_priority(self.favoured(tenant, load))

    def usable_credits(self, tenant: str, link: SharedLink, favoured: bool | None = None) -> int:
        """The credits of `link` a request of `tenant` may take: all that are free when the tenant is
        below its share there, else all but the reserve. `favoured` is `favoured(tenant, link.load)`
        where the caller has asked it already (it sums every tenant's open work)."""
        free = link.free_credits
        if free <= 0 or not self.on:
            return free
        if favoured is None:
            favoured = self.favoured(tenant, link.load)
        if favoured:
            return free
        limit = link.credits.limit
        beyond_running = max(0, limit - link.load.max_running)
        reserve = min(math.ceil(self._reserve_share * limit), beyond_running)
        return max(0, free - reserve)
