"""The gateway's view of LoRA adapters: which each route's workers serve, and loading or unloading one
on every replica of a route.

A route's adapters are what its ready workers report (ListAdapters), asked each time they are listed:
there is no copy here to go stale when a worker restarts. An adapter is served as `<route>:<adapter>`
(gateway/adapter_names.py). A load or unload goes to every ready worker of the route with the workers'
admin token (`worker_admin_token`), all at once; each worker's outcome is reported, so an operator
sees which replica refused and why. This module owns those calls; it must not serve HTTP (the
HTTP front door's adapter endpoints do) nor parse model names.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from strata.v1 import worker_pb2

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from gateway.route import Route
    from gateway.router import Router
    from gateway.worker_link import WorkerLink

log = logging.getLogger(__name__)

ADMIN_CALL_TIMEOUT_S = 60.0
"""A load reads the adapter's files on the worker between two engine steps: seconds at most."""
LIST_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """One worker's answer to a forwarded load or unload."""

    address: str
    code: grpc.StatusCode
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code is grpc.StatusCode.OK


async def route_adapters(route: Route) -> list[worker_pb2.Adapter]:
    """The adapters the route's ready workers serve, one entry per name (the first worker's)."""
    links = [link for link in route.links if link.ready]
    answers = await asyncio.gather(
        *(link.list_adapters(LIST_TIMEOUT_S) for link in links), return_exceptions=True
    )
    found: dict[str, worker_pb2.Adapter] = {}
    for link, answer in zip(links, answers, strict=True):
        if isinstance(answer, BaseException):
            log.warning("worker %s did not list its adapters: %r", link.address, answer)
            continue
        for adapter in answer.adapters:
            found.setdefault(adapter.name, adapter)
    return [found[name] for name in sorted(found)]


async def served_adapters(router: Router) -> list[tuple[Route, worker_pb2.Adapter]]:
    """Every route's adapters, route by route."""
    routes = router.routes()
    listed = await asyncio.gather(*(route_adapters(route) for route in routes))
    return [(route, adapter) for route, adapters in zip(routes, listed, strict=True) for adapter in adapters]


async def _forward(
    links: list[WorkerLink], call: str, send: Callable[[WorkerLink], Awaitable[None]]
) -> list[Outcome]:
    async def one(link: WorkerLink) -> Outcome:
        try:
            await send(link)
        except grpc.aio.AioRpcError as error:
            log.warning("worker %s refused %s: %s", link.address, call, error.details())
            return Outcome(link.address, error.code(), error.details() or "")
        return Outcome(link.address, grpc.StatusCode.OK)

    return list(await asyncio.gather(*(one(link) for link in links)))


async def load(route: Route, name: str, path: str, token: str) -> list[Outcome]:
    """LoadAdapter on every ready worker of `route`; each one's outcome."""
    request = worker_pb2.LoadAdapterRequest(name=name, path=path)
    links = [link for link in route.links if link.ready]
    return await _forward(
        links, "LoadAdapter", lambda link: link.load_adapter(request, token, ADMIN_CALL_TIMEOUT_S)
    )


async def unload(route: Route, name: str, token: str) -> list[Outcome]:
    """UnloadAdapter on every ready worker of `route`; each one's outcome."""
    links = [link for link in route.links if link.ready]
    return await _forward(
        links, "UnloadAdapter", lambda link: link.unload_adapter(name, token, ADMIN_CALL_TIMEOUT_S)
    )
