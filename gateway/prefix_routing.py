"""Prefix-aware routing: requests that share a prompt prefix go to the replica that has it cached.

A request's key is a stable hash (blake2b, the same in every process) of its tenant and its first
`prefix_tokens` prompt ids, taken after tokenizing: the tenant salts it as it salts the workers'
caches, so the requests it groups are exactly those that can share cached blocks. The key picks a
replica on a consistent-hash ring of the route's worker addresses (VIRTUAL_NODES points each), so
every gateway replica, given the same addresses, computes the same ring and sends a prefix to the
same worker, and a worker joining or leaving moves only its share of the keys.
The load bound keeps affinity from piling work on one replica (consistent hashing with bounded
loads): the key's replica (the first point of the ring at or after the key) takes the request when
it has a free credit and its open requests (running plus queued there, from every gateway) stay
within load_factor x the route's average once this one is added; otherwise the least loaded
replica takes it. This module only
chooses among the links it is given: it must not grant credits (route.py does) nor talk to workers.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

VIRTUAL_NODES = 64
"""Ring points per replica: enough that two or three replicas split the key space near evenly."""

PREFIX = "prefix"
"""The reason of a choice the ring made."""
LOAD_BOUND = "load_bound"
"""The key's replica was over the load bound (or out of credits): the least loaded took it."""
LEAST_LOADED = "least_loaded"
"""No key (prefix routing off, or the prompt not tokenized when the credit was granted)."""


class Replica(Protocol):
    """What routing reads of a worker link."""

    @property
    def address(self) -> str: ...

    @property
    def free_credits(self) -> int: ...

    @property
    def open_load(self) -> int:
        """Requests open on the worker from every gateway: running plus queued there."""


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_key(tenant: str, prompt_ids: Sequence[int], prefix_tokens: int) -> int | None:
    """The routing key of a tokenized prompt; None when prefix routing is off (prefix_tokens 0)."""
    if prefix_tokens <= 0 or not prompt_ids:
        return None
    head = array("I", prompt_ids[:prefix_tokens]).tobytes()
    return _hash(tenant.encode() + b"\0" + head)


class Ring:
    """The consistent-hash ring of a set of addresses."""

    def __init__(self, addresses: Iterable[str]) -> None:
        self.addresses = tuple(sorted(set(addresses)))
        points = [
            (_hash(f"{address}#{i}".encode()), address)
            for address in self.addresses
            for i in range(VIRTUAL_NODES)
        ]
        points.sort()
        self._keys = [point for point, _ in points]
        self._owners = [address for _, address in points]

    def walk(self, key: int) -> list[str]:
        """Every address once, in ring order from the first point at or after `key`."""
        start = bisect.bisect_left(self._keys, key)
        order: list[str] = []
        for offset in range(len(self._owners)):
            address = self._owners[(start + offset) % len(self._owners)]
            if address not in order:
                order.append(address)
                if len(order) == len(self.addresses):
                    break
        return order


R = TypeVar("R", bound=Replica)


@dataclass(frozen=True, slots=True)
class Choice(Generic[R]):
    """The replica a request goes to, and why."""

    replica: R
    reason: str
    preferred: str = ""
    """The ring's first replica for the key (empty without a key)."""


def load_bound(replicas: Sequence[Replica], factor: float) -> int:
    """The most open requests a replica may hold once one more request is added to the route:
    factor x the average, rounded down (so no replica passes it), but never below the average rounded
    up (so some replica always has room)."""
    average = (sum(replica.open_load for replica in replicas) + 1) / len(replicas)
    return max(math.floor(factor * average), math.ceil(average))


def choose(
    replicas: Sequence[R],
    ring: Ring,
    key: int | None,
    factor: float,
    free: Mapping[str, int],
) -> Choice[R] | None:
    """The replica for a request with routing key `key` among the ready `replicas`; None when none
    has a credit for it. `free[address]` is what the request may take there (fair_share.py keeps some
    of a replica's free credits for tenants below their share)."""
    if not any(value > 0 for value in free.values()):
        return None
    # Least loaded as the dispatcher has always judged it: the most credits this gateway may use.
    least = max(
        (replica for replica in replicas if free[replica.address] > 0),
        key=lambda replica: (free[replica.address], -replica.open_load),
    )
    if key is None:
        return Choice(least, LEAST_LOADED)
    by_address = {replica.address: replica for replica in replicas}
    preferred = next(address for address in ring.walk(key) if address in by_address)
    replica = by_address[preferred]
    if free[preferred] > 0 and replica.open_load + 1 <= load_bound(replicas, factor):
        return Choice(replica, PREFIX, preferred)
    return Choice(least, LOAD_BOUND, preferred)
