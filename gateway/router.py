"""Which worker link serves a request: model name -> the route's links -> the ready one with most credit.

`admit` is the one door a request passes to reach a worker. Today it picks at once: no ready link is
UNAVAILABLE (naming why each link is not ready), no credit anywhere is RESOURCE_EXHAUSTED with a
retry hint. Admission queues, deadline-aware waiting and fallback routes belong behind this same door.
This module must not talk to workers itself (worker_link.py does) nor validate requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.errors import NotFound, ResourceExhausted, Unavailable

if TYPE_CHECKING:
    from gateway.settings import GatewaySettings
    from gateway.worker_link import WorkerLink


@dataclass(frozen=True, slots=True)
class RouteStatus:
    """A route's state as ListModels reports it."""

    model: str
    max_model_len: int
    ready_workers: int
    configured_workers: int


class Router:
    """The routes of one gateway and their worker links."""

    def __init__(self, settings: GatewaySettings, links: dict[str, list[WorkerLink]]) -> None:
        self._settings = settings
        self._links = links

    @property
    def models(self) -> list[str]:
        return list(self._links)

    def links(self) -> list[WorkerLink]:
        return [link for route in self._links.values() for link in route]

    def _route(self, model: str) -> list[WorkerLink]:
        route = self._links.get(model)
        if route is None:
            raise NotFound(f"model: no route serves {model!r}; known models: {', '.join(self._links)}")
        return route

    def ready(self, model: str) -> bool:
        return any(link.ready for link in self._route(model))

    def all_ready(self) -> bool:
        return all(self.ready(model) for model in self._links)

    def max_model_len(self, model: str) -> int | None:
        """The context length a worker of the route reported; None before any connected."""
        for link in self._route(model):
            if link.info is not None:
                return int(link.info.max_model_len)
        return None

    def context_limit(self, model: str) -> int:
        """The route's context length; UNAVAILABLE (saying why) when no worker of it ever connected."""
        limit = self.max_model_len(model)
        if limit is None:
            raise self._unavailable(model)
        return limit

    def _unavailable(self, model: str) -> Unavailable:
        reasons = "; ".join(link.not_ready_reason for link in self._route(model))
        return Unavailable(f"no worker is ready for model {model!r}: {reasons}")

    def pick(self, model: str) -> WorkerLink:
        """The ready link with the most credit."""
        ready = [link for link in self._route(model) if link.ready]
        if not ready:
            raise self._unavailable(model)
        best = max(ready, key=lambda link: link.credits)
        if best.credits <= 0:
            raise ResourceExhausted(
                f"every worker for model {model!r} is at capacity; retry shortly",
                self._settings.overload_retry_after_s,
            )
        return best

    async def admit(self, model: str) -> WorkerLink:
        """The link to submit to now; the seam for admission queues and fallback."""
        return self.pick(model)

    def status(self, model: str) -> RouteStatus:
        route = self._route(model)
        return RouteStatus(
            model=model,
            max_model_len=self.max_model_len(model) or 0,
            ready_workers=sum(1 for link in route if link.ready),
            configured_workers=len(route),
        )
