"""Fairness between tenants as `python -m bench.tenants` judges it: max-min fair shares and Jain's index.

The fair share of each tenant is the weighted max-min allocation of a capacity over the tenants'
demands (water-filling): capacity is split in proportion to the weights; a tenant asking less than
its part gets what it asks, and what it leaves is split again among the others, until every tenant
either has its demand or an equal weighted level. Each tenant's normalized throughput is what it was
served over min(its demand, its fair share), and Jain's index of those, (sum y)^2 / (n sum y^2), is
1 when every tenant got the same fraction of what it was due and 1/n when one tenant got everything.
This module only computes; it must not read results nor shape a record (bench/tenant_phase.py does).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence


def water_fill(
    demands: Sequence[float], capacity: float, weights: Sequence[float] | None = None
) -> list[float]:
    """Each tenant's weighted max-min fair share of `capacity` given its demand (equal weights by
    default); the shares add up to min(capacity, sum of demands)."""
    weights = [1.0] * len(demands) if weights is None else list(weights)
    if len(weights) != len(demands):
        raise ValueError(f"{len(demands)} demands but {len(weights)} weights")
    if any(d < 0 for d in demands) or any(not w > 0 for w in weights) or capacity < 0:
        raise ValueError(f"demands {list(demands)} and capacity {capacity} must be >= 0, weights > 0")
    shares = [0.0] * len(demands)
    open_tenants = set(range(len(demands)))
    left = capacity
    while open_tenants and left > 0:
        level = left / sum(weights[i] for i in open_tenants)
        # Tenants whose remaining demand fits under this round's level are satisfied and leave.
        satisfied = {i for i in open_tenants if demands[i] - shares[i] <= level * weights[i]}
        if not satisfied:
            for i in open_tenants:
                shares[i] += level * weights[i]
            break
        for i in satisfied:
            left -= demands[i] - shares[i]
            shares[i] = demands[i]
        open_tenants -= satisfied
    return shares


def normalized_throughputs(
    served: Sequence[float], demands: Sequence[float], fair_shares: Sequence[float]
) -> list[float | None]:
    """served_i / min(demand_i, fair_share_i); None for a tenant that was due nothing (no demand, or
    nothing to share)."""
    due = [min(d, f) for d, f in zip(demands, fair_shares, strict=True)]
    return [s / d if d > 0 else None for s, d in zip(served, due, strict=True)]


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 for equal values, 1/n when one holds all;
    None when there is nothing to judge (no values, or all zero)."""
    if any(v < 0 or not math.isfinite(v) for v in values):
        raise ValueError(f"Jain's index needs finite values >= 0, not {list(values)}")
    squares = sum(v * v for v in values)
    if not values or squares == 0:
        return None
    return sum(values) ** 2 / (len(values) * squares)
