"""Tests of prefix-aware routing's choice alone: the ring, the key, the load bound.

Replicas are plain records of what routing reads (address, free credits, open load); the choices
must be the same for every gateway that knows the same addresses, follow the prefix while the load
bound allows, and fall back to the least loaded replica when it does not.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gateway.prefix_routing import LEAST_LOADED, LOAD_BOUND, PREFIX, Ring, choose, load_bound, prefix_key

ADDRESSES = ["10.0.0.1:50053", "10.0.0.2:50053", "10.0.0.3:50053"]


@dataclass
class Replica:
    address: str
    free_credits: int = 8
    open_load: int = 0


def free(replicas: list[Replica]) -> dict[str, int]:
    """Every credit each replica has free: what a request of a tenant below its share may take."""
    return {replica.address: replica.free_credits for replica in replicas}


def test_every_gateway_computes_the_same_ring_and_keys() -> None:
    """Two rings built from the same addresses in another order walk identically for every key, and
    a key depends only on the tenant and the first tokens (stable across processes: blake2b)."""
    shuffled = list(ADDRESSES)
    random.Random(1).shuffle(shuffled)
    one, two = Ring(ADDRESSES), Ring(shuffled)
    for seed in range(200):
        key = prefix_key("acme", [seed, 1, 2, 3], 64)
        assert key is not None
        assert one.walk(key) == two.walk(key)
        assert sorted(one.walk(key)) == sorted(ADDRESSES)
    assert prefix_key("acme", list(range(100)), 64) == prefix_key("acme", [*range(64), 7, 7], 64)
    assert prefix_key("acme", list(range(100)), 64) != prefix_key("globex", list(range(100)), 64)
    assert prefix_key("acme", [1, 2], 0) is None


def test_the_ring_spreads_keys_and_a_removed_replica_moves_only_its_own() -> None:
    """1,000 keys over 3 replicas: each gets at least a fifth; removing one replica moves only the keys
    it had (consistent hashing)."""
    ring = Ring(ADDRESSES)
    keys = [prefix_key("t", [i], 64) or 0 for i in range(1000)]
    owners = {key: ring.walk(key)[0] for key in keys}
    for address in ADDRESSES:
        assert sum(owner == address for owner in owners.values()) > 200
    smaller = Ring(ADDRESSES[:2])
    for key, owner in owners.items():
        if owner != ADDRESSES[2]:
            assert smaller.walk(key)[0] == owner


def test_a_prefix_goes_to_its_replica_within_the_load_bound() -> None:
    """The key's replica takes the request while 1.25 x the average allows; beyond, the least loaded
    replica does, with the reason saying so; without a key, the one with the most credits."""
    replicas = [Replica(address) for address in ADDRESSES]
    ring = Ring(ADDRESSES)
    key = prefix_key("t", [42], 64)
    preferred = ring.walk(key or 0)[0]
    choice = choose(replicas, ring, key, 1.25, free(replicas))
    assert choice is not None and (choice.replica.address, choice.reason) == (preferred, PREFIX)
    home = next(r for r in replicas if r.address == preferred)
    home.open_load = 4
    others = [r for r in replicas if r is not home]
    others[0].open_load = 1
    # total 5 + 1 over 3 replicas: average 2, bound floor(1.25 x 2) = 2 < 4 + 1.
    assert load_bound(replicas, 1.25) == 2
    home.free_credits, others[0].free_credits = 4, 7
    choice = choose(replicas, ring, key, 1.25, free(replicas))
    assert choice is not None and choice.reason == LOAD_BOUND and choice.replica is others[1]
    assert choice.preferred == preferred
    no_key = choose(replicas, ring, None, 1.25, free(replicas))
    assert no_key is not None and no_key.reason == LEAST_LOADED and no_key.replica is others[1]


def test_a_replica_without_credit_is_never_chosen() -> None:
    """The key's replica with no credit left gives the request to one that has some; none: None."""
    replicas = [Replica(address) for address in ADDRESSES]
    ring = Ring(ADDRESSES)
    key = prefix_key("t", [5], 64)
    home = next(r for r in replicas if r.address == ring.walk(key or 0)[0])
    home.free_credits = 0
    choice = choose(replicas, ring, key, 1.25, free(replicas))
    assert choice is not None and choice.replica is not home and choice.reason == LOAD_BOUND
    for replica in replicas:
        replica.free_credits = 0
    assert choose(replicas, ring, key, 1.25, free(replicas)) is None


def test_under_a_stream_of_arrivals_no_replica_exceeds_the_bound() -> None:
    """600 arrivals of 4 prefixes (one of them half the traffic) onto 2 replicas, each request staying
    open: no replica ever holds more than 1.25 x the average once a request is added (rounded down,
    or the average rounded up when that is more)."""
    replicas = [Replica(address, free_credits=10**6) for address in ADDRESSES[:2]]
    ring = Ring(ADDRESSES[:2])
    rng = random.Random(3)
    keys = [prefix_key("t", [p], 64) for p in range(4)]
    for _ in range(600):
        key = keys[0] if rng.random() < 0.5 else rng.choice(keys[1:])
        bound = load_bound(replicas, 1.25)
        choice = choose(replicas, ring, key, 1.25, free(replicas))
        assert choice is not None
        choice.replica.open_load += 1
        assert choice.replica.open_load <= max(bound, min(r.open_load for r in replicas) + 1)
    total = sum(r.open_load for r in replicas)
    assert max(r.open_load for r in replicas) <= 1.25 * total / 2
