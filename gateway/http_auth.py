"""API keys on the HTTP API: one ASGI middleware in front of every route but the readiness check; and how a
request refused at the door is answered (`answer_refusal`, which the endpoints use too).

With keys configured (GatewaySettings.tenant_keys: the default tenant's and every tenant's, one set), a
request whose `authorization: Bearer <key>` (or, as Anthropic's clients send it, `x-api-key: <key>`)
carries none of them gets 401 before any route runs, in the error shape of the route's API (OpenAI's, or
what `shapes` makes of it for a path), counted in `strata_gateway_http_responses_total` under its
endpoint and logged as refused; keys are compared in constant time (gateway/auth.py). An accepted
request carries its tenant to the routes in the ASGI scope (`tenant(scope)`); without keys every request
is the default tenant's. This module must not read bodies, know a route's work, nor log a key.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from starlette.datastructures import Headers

from gateway.auth import key_matches, tenant_of
from gateway.metrics import HTTP_RESPONSES
from gateway.openai_errors import HttpError, unauthenticated
from gateway.tenant_settings import DEFAULT_TENANT

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from starlette.types import ASGIApp, Receive, Scope, Send

# The request log's logger: a refusal at the door is a line of it, as a finished request is.
log = logging.getLogger("strata.requests")

_TENANT = "strata.tenant"
"""The scope key the middleware sets and `tenant` reads."""


class ApiKeys:
    """The middleware: `endpoints` names each path for the metrics (a key ending in '/' names the paths
    under it); `open_paths` need no key;
    `shapes` gives a path's errors its API's shape (OpenAI's where none is given)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: tuple[tuple[bytes, str], ...],
        endpoints: Mapping[str, str],
        open_paths: frozenset[str],
        shapes: Mapping[str, Callable[[HttpError], HttpError]] | None = None,
    ) -> None:
        self.app = app
        self._keys = keys
        self._accepted = tuple(key for key, _ in keys)
        self._endpoints = endpoints
        self._open = open_paths
        self._shapes = shapes or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        header = headers.get("authorization")
        if header is None and (key := headers.get("x-api-key")) is not None:
            header = f"Bearer {key}"
        if self._keys and not key_matches(header, self._accepted):
            await self._refuse(scope, receive, send)
            return
        scope[_TENANT] = tenant_of(header, self._keys, DEFAULT_TENANT) if self._keys else DEFAULT_TENANT
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        shape = self._shapes.get(path)
        error = unauthenticated() if shape is None else shape(unauthenticated())
        await answer_refusal(error, self._endpoint(path), scope, receive, send)

    def _endpoint(self, path: str) -> str:
        """The metrics' name of `path`: its own, that of a prefix ending in '/' (a path with an id in
        it), or `other`: a label per unknown path would grow without bound."""
        if path in self._endpoints:
            return self._endpoints[path]
        under = [prefix for prefix in self._endpoints if prefix.endswith("/") and path.startswith(prefix)]
        return self._endpoints[max(under, key=len)] if under else "other"


async def answer_refusal(error: HttpError, endpoint: str, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer a request refused before it reached the pipeline (no key, a bad body): the error body,
    one log line and the response counter."""
    log.info(
        "request refused by the HTTP API: %d",
        error.status,
        extra={
            "fields": {
                "event": "request_refused",
                "protocol": "http",
                "endpoint": endpoint,
                "status": error.status,
                "error": error.message,
            }
        },
    )
    await error.response()(scope, receive, send)
    HTTP_RESPONSES.labels(endpoint, str(error.status)).inc()


def tenant(scope: Scope) -> str:
    """The tenant ApiKeys found for this request."""
    found: str = scope[_TENANT]
    return found
