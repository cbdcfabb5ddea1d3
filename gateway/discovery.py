"""Where a route's workers are: a static address list, or a DNS name resolved again periodically.

A static route gets one link per configured address, for its whole life. A DNS route (a Kubernetes
headless service, `name:port`) is resolved with the event loop's getaddrinfo at start and every
`dns_refresh_s`: each new address gets a link; an address that vanished stops taking requests and its
link closes once its open requests have ended (or comes back if the address does). A failed
resolution keeps the links it has. Duplicate answers (one per socket type or family alias) collapse
to one address. This module must not choose between links nor queue requests: route.py does.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from gateway.settings import RouteSettings
    from gateway.worker_link import WorkerLink

    Resolver = Callable[[str, int], Awaitable[list[str]]]

log = logging.getLogger(__name__)


async def resolve(host: str, port: int) -> list[str]:
    """The distinct host:port addresses `host` resolves to now (IPv6 ones in brackets), sorted."""
    answers = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = set()
    for family, _, _, _, sockaddr in answers:
        ip = str(sockaddr[0])
        addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(addresses)


class Discovery:
    """The live set of one route's worker links."""

    def __init__(
        self,
        settings: RouteSettings,
        make_link: Callable[[str], WorkerLink],
        on_change: Callable[[], None],
        resolver: Resolver = resolve,
    ) -> None:
        self._settings = settings
        self._make_link = make_link
        self._on_change = on_change
        self._resolver = resolver
        self.links: dict[str, WorkerLink] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.last_error = ""
        """Why the last DNS resolution failed; empty after a success."""

    def start(self) -> None:
        if self._settings.dns:
            self._task = asyncio.create_task(self._follow_dns(), name=f"dns-{self._settings.model}")
        else:
            self.apply(list(self._settings.workers))

    async def close(self) -> None:
        tasks = [task for task in (self._task, *self._closing) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        links, self.links = list(self.links.values()), {}
        await asyncio.gather(*(link.close() for link in links))

    def apply(self, addresses: list[str]) -> None:
        """Make the links match `addresses`: new ones start, vanished ones leave and close when idle."""
        wanted = set(addresses)
        changed = False
        for address in addresses:
            link = self.links.get(address)
            if link is None:
                link = self._make_link(address)
                self.links[address] = link
                link.start()
                changed = True
                log.info("route %s: worker %s added", self._settings.model, address)
            elif link.leaving:
                link.set_leaving(False)
                changed = True
        for address, link in list(self.links.items()):
            if address not in wanted and not link.leaving:
                link.set_leaving()
                changed = True
                log.info("route %s: worker %s left; closing it once idle", self._settings.model, address)
                task = asyncio.create_task(self._close_when_idle(address, link), name=f"leave-{address}")
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        if changed:
            self._on_change()

    async def _close_when_idle(self, address: str, link: WorkerLink) -> None:
        await link.wait_idle()
        if not link.leaving:  # the address came back while its requests ran
            return
        await link.close()
        if self.links.get(address) is link:
            del self.links[address]
        self._on_change()

    async def _follow_dns(self) -> None:
        host, _, port = self._settings.dns.rpartition(":")
        while True:
            try:
                addresses = await self._resolver(host, int(port))
            except OSError as exc:
                self.last_error = f"cannot resolve {self._settings.dns}: {exc}"
                log.warning(
                    "route %s: %s; keeping %d workers", self._settings.model, self.last_error, len(self.links)
                )
            else:
                self.last_error = "" if addresses else f"{self._settings.dns} resolves to no address"
                self.apply(addresses)
            await asyncio.sleep(self._settings.dns_refresh_s)
