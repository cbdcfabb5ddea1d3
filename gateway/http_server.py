"""The gateway's second front door: the OpenAI-compatible HTTP API, served in the gateway's own process and
event loop by uvicorn (HTTP/1.1 over h11) and Starlette.

`HttpFrontDoor` binds `http_listen` itself (so a port in use is an OSError naming it, and port 0's
choice is known at once), serves the routes (the completions endpoints of http_endpoints.py, Anthropic's
Messages endpoints of anthropic_messages.py, OpenAI's Responses endpoints of responses_api.py with their
store, GET /v1/models, GET /health for readiness) behind the API-key middleware (http_auth.py;
readiness needs no key), and stops on the gateway's command: uvicorn's own SIGINT/SIGTERM handlers are
turned off, so the gateway's drain decides (health 503, no new connections, running requests finish
within the grace period, then are cancelled). uvicorn runs on the running asyncio loop (never a loop of
its own choosing, such as uvloop under grpc.aio), with TLS from the gateway's `tls` settings and the
connection bounds of http_guard.py. This module must not hold request logic (the pipeline) nor map
errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.adapter_admin import served_adapters
from gateway.anthropic_errors import anthropic_error
from gateway.anthropic_messages import CountTokens, Messages
from gateway.http_adapters import AdapterEndpoints
from gateway.http_auth import ApiKeys
from gateway.http_endpoints import Completions
from gateway.http_guard import guarded_protocol
from gateway.response_store import ResponseStore
from gateway.responses_api import Responses, StoredResponses

if TYPE_CHECKING:
    from collections.abc import Callable, Generator

    from starlette.requests import Request

    from gateway.pipeline import Pipeline
    from gateway.router import Router
    from gateway.settings import GatewaySettings

STARTED_POLL_S = 0.005
BACKLOG = 2048


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the gateway's drain stops both front doors in order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class HttpFrontDoor:
    """The HTTP API of one gateway: its app, its uvicorn server and its bound address."""

    def __init__(
        self,
        settings: GatewaySettings,
        pipeline: Pipeline,
        router: Router,
        serving: Callable[[], bool],
    ) -> None:
        """`serving()` is the gateway's readiness (GET /health)."""
        self._settings = settings
        self._router = router
        self._serving = serving
        chat = Completions(True, settings, pipeline, router)
        text = Completions(False, settings, pipeline, router)
        messages = Messages(settings, pipeline, router)
        count = CountTokens(settings, pipeline, router)
        store = ResponseStore(settings.responses_store_ttl_s, settings.responses_store_bytes)
        responses = Responses(settings, pipeline, router, store)
        stored = StoredResponses(store)
        adapters = AdapterEndpoints(settings, router)
        routes = Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/completions", text, methods=["POST"]),
                Route("/v1/messages", messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", count, methods=["POST"]),
                Route("/v1/responses", responses, methods=["POST"]),
                Route("/v1/responses/{response_id}", stored.answer, methods=["GET", "DELETE"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/load_lora_adapter", adapters.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", adapters.unload, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
            ]
        )
        endpoints = {
            "/v1/chat/completions": chat.endpoint,
            "/v1/completions": text.endpoint,
            "/v1/messages": messages.endpoint,
            "/v1/messages/count_tokens": count.endpoint,
            "/v1/responses": responses.endpoint,
            "/v1/responses/": stored.endpoint,
            "/v1/models": "models",
            "/v1/load_lora_adapter": "load_lora_adapter",
            "/v1/unload_lora_adapter": "unload_lora_adapter",
        }
        anthropic = dict.fromkeys(("/v1/messages", "/v1/messages/count_tokens"), anthropic_error)
        # Readiness answers probes, which carry no key; the adapter endpoints check admin keys themselves.
        open_paths = frozenset({"/health", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
        self.app = ApiKeys(routes, settings.tenant_keys(), endpoints, open_paths=open_paths, shapes=anthropic)
        self.address = ""
        """host:port the HTTP API is bound to."""
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Bind and serve; returns the bound host:port."""
        host, port = self._settings.http_listen.rsplit(":", 1)
        sock = _bind(host.strip("[]"), int(port))
        tls = self._settings.tls
        config = uvicorn.Config(
            self.app,
            loop="none",
            http=guarded_protocol(self._settings),
            ws="none",
            lifespan="off",
            log_config=None,  # the service's logging (JSON lines) stays as strata.telemetry set it
            access_log=False,  # the pipeline logs one line per request
            server_header=False,
            timeout_keep_alive=self._settings.http_keep_alive_s,
            timeout_graceful_shutdown=max(1, round(self._settings.shutdown_grace_s)),
            ssl_certfile=tls.cert_file if tls else None,
            ssl_keyfile=tls.key_file if tls else None,
            ssl_ca_certs=str(tls.client_ca_file) if tls and tls.client_ca_file else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.client_ca_file else ssl.CERT_NONE,
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="gateway-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise OSError(f"the HTTP API on {self._settings.http_listen} stopped while starting")
            await asyncio.sleep(STARTED_POLL_S)
        bound = sock.getsockname()
        self.address = f"{host}:{bound[1]}"
        return self.address

    async def stop(self, grace: float) -> None:
        """No new connections; requests running finish within `grace` seconds, then are cancelled."""
        if self._server is None or self._task is None:
            return
        # uvicorn declares whole seconds but only passes the value to asyncio.wait_for: a fraction works.
        self._server.config.timeout_graceful_shutdown = max(grace, 0.001)  # type: ignore[assignment]
        self._server.should_exit = True
        await self._task

    async def _models(self, request: Request) -> JSONResponse:
        data: list[dict[str, Any]] = []
        for route in self._router.routes():
            status = route.status()
            data.append(
                {
                    "id": route.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "strata",
                    "max_model_len": status.max_model_len,
                    "ready_workers": status.ready_workers,
                    "fallback_model": route.fallback,
                }
            )
        for route, adapter in await served_adapters(self._router):
            # vLLM's shape for an adapter: its own id, the base model as its parent.
            entry = {
                "id": f"{route.name}:{adapter.name}",
                "object": "model",
                "created": 0,
                "owned_by": "strata",
            }
            data.append(entry | {"parent": route.name, "root": adapter.path, "lora_rank": adapter.rank})
        return JSONResponse({"object": "list", "data": data})

    async def _health(self, request: Request) -> JSONResponse:
        """Readiness: 200 while the gateway serves, 503 while it cannot (starting, draining)."""
        if self._serving():
            return JSONResponse({"status": "serving"})
        return JSONResponse({"status": "not_serving"}, status_code=503)


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (SO_REUSEPORT off, as on every Strata port).

    The protocol is named (IPPROTO_TCP, not 0) because asyncio turns Nagle's algorithm off only on
    sockets that say they are TCP: without it, each stream's first event waited for the client's
    delayed ACK of the headers (40 ms on Linux) before it left.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(
            f"could not bind http_listen {host}:{port}: {exc.strerror}; choose a free port "
            "(port 0 lets the OS choose) or an empty http_listen to turn the HTTP API off"
        ) from exc
    return sock
