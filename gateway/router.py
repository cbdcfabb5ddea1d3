"""Which route serves a model, and the routes' lifecycle: the gateway's map from model names to routes.

Each route (route.py) owns its worker links, found by discovery.py, its admission queue and its
dispatcher; the Router builds them from the settings, creates their links with the tokenizer client
and the readiness callback, and answers the questions the servicer asks across routes. This module
must not queue requests nor talk to workers.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from gateway import adapter_names
from gateway.discovery import resolve
from gateway.errors import Unavailable
from gateway.route import Route
from gateway.worker_link import WorkerLink

if TYPE_CHECKING:
    from collections.abc import Callable

    from gateway.discovery import Resolver
    from gateway.settings import GatewaySettings
    from gateway.tokenizer_client import TokenizerClient


class Router:
    """The routes of one gateway."""

    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer: TokenizerClient,
        on_change: Callable[[], None],
        resolver: Resolver = resolve,
    ) -> None:
        def make_link(address: str, model: str, on_capacity: Callable[[], None]) -> WorkerLink:
            return WorkerLink(address, model, settings, tokenizer, on_change, on_capacity)

        self._aliases = settings.adapter_aliases
        self._routes = {
            route.model: Route(route, settings, make_link, on_change, resolver) for route in settings.routes
        }

    @property
    def models(self) -> list[str]:
        return list(self._routes)

    def route(self, model: str) -> Route:
        """The route serving `model` (a route's name, `<route>:<adapter>` or an adapter alias)."""
        return self._routes[adapter_names.resolve(model, self._routes, self._aliases).route]

    def routes(self) -> list[Route]:
        return list(self._routes.values())

    def links(self) -> list[WorkerLink]:
        return [link for route in self._routes.values() for link in route.links]

    def start(self) -> None:
        for route in self._routes.values():
            route.start()

    async def close(self) -> None:
        await asyncio.gather(*(route.close() for route in self._routes.values()))

    def max_model_len(self, model: str) -> int | None:
        return self.route(model).max_model_len()

    def context_limit(self, model: str) -> int:
        """The route's context length; UNAVAILABLE (saying why) when no worker of it ever connected."""
        route = self.route(model)
        limit = route.max_model_len()
        if limit is None:
            raise Unavailable(route.unavailable_reason())
        return limit
