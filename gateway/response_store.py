"""The Responses API's stored responses: what `previous_response_id` continues and GET /v1/responses/{id}
returns, per tenant, bounded in time and size.

Each tenant has its own store: a response is kept for `ttl_s` after it finished, and a tenant's stored
responses together take at most `max_bytes` (counted as the JSON text of the answer and of the
conversation it continues); past that, the tenant's oldest go first. One response larger than the
whole budget is not kept. A lookup finds only the asking tenant's responses: another tenant's id is
as unknown as a missing or expired one. Nothing is written to disk; a restart forgets every response.
This module owns the stored responses (only it adds, evicts and deletes them); it must not know HTTP
nor the pipeline.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from gateway.openai_schema import ChatMessage


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One finished response: its answer as returned, and the conversation a continuation reads."""

    body: dict[str, Any]
    conversation: tuple[ChatMessage, ...]
    """Every turn so far (earlier responses', this one's input and its answer), instructions aside."""
    expires: float
    size: int


class ResponseStore:
    """Every tenant's stored responses; `clock` is monotonic seconds (a test may pass its own)."""

    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._max_bytes = max_bytes
        self._clock = clock
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str, int] = {}

    def put(self, tenant: str, body: dict[str, Any], conversation: list[ChatMessage]) -> bool:
        """Keep `body` (its `id` the key) for `tenant`; False when it alone is over the budget."""
        size = len(json.dumps(body)) + sum(len(turn.model_dump_json()) for turn in conversation)
        if size > self._max_bytes:
            return False
        kept = self._tenants.setdefault(tenant, OrderedDict())
        self._expire(tenant)
        self._drop(tenant, body["id"])
        while kept and self._bytes.get(tenant, 0) + size > self._max_bytes:
            self._drop(tenant, next(iter(kept)))
        kept[body["id"]] = StoredResponse(body, tuple(conversation), self._clock() + self._ttl_s, size)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """`tenant`'s response `response_id`; None when unknown, expired, evicted or another's."""
        self._expire(tenant)
        kept = self._tenants.get(tenant)
        return kept.get(response_id) if kept is not None else None

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget `tenant`'s response `response_id`; False when there was none."""
        self._expire(tenant)
        return self._drop(tenant, response_id)

    def bytes_held(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)

    def _expire(self, tenant: str) -> None:
        # Every entry lives ttl_s from its insertion, so insertion order is expiry order.
        kept = self._tenants.get(tenant)
        now = self._clock()
        while kept and next(iter(kept.values())).expires <= now:
            self._drop(tenant, next(iter(kept)))

    def _drop(self, tenant: str, response_id: str) -> bool:
        kept = self._tenants.get(tenant)
        stored = kept.pop(response_id, None) if kept is not None else None
        if stored is None:
            return False
        self._bytes[tenant] -= stored.size
        return True
