"""A phase's stack for a benchmark whose subject is one route setting: the config's tokenizer and
workers as processes, freshly started (a cold prefix cache), and a gateway in this process on them.

The gateway runs here so that a benchmark can set its one route as it likes per phase (and, for an
oracle, replace a part of it: `prepare` gets the server before the first request), the rest of the
stack being the product's processes. A route is the config's first, its fallback left out (no request
may use it). bench/cached_admission.py and bench/itl_admission.py use this; it must not send a
request nor reduce a figure.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from bench.session import gateway
from gateway.server import start as start_gateway
from gateway.settings import GatewaySettings
from strata.cli.launcher import Stack, start_stack
from strata.settings import read_config

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator
    from pathlib import Path

    from bench.driver import Stub
    from gateway.server import GatewayServer

READY_S = 120.0


def first_route(config: Path) -> dict[str, Any]:
    """The config's first gateway route, its fallback left out."""
    routes = (read_config(config.resolve()).get("gateway") or {}).get("routes") or []
    if not routes:
        raise SystemExit(f"{config}: no gateway route to drive")
    return {key: value for key, value in routes[0].items() if key != "fallback"}


def model_dir(config: Path, model: str) -> Path:
    """The folder the config's tokenizer loads `model` from."""
    config = config.resolve()
    models = (read_config(config).get("tokenizer") or {}).get("models") or {}
    return (config.parent / str(models[model])).resolve()


@contextlib.contextmanager
def services(config: Path, log_dir: Path) -> Iterator[Stack]:
    """The config's tokenizer and workers (and its own gateway, left idle) as processes."""
    env = {"STRATA_GATEWAY_LISTEN": "127.0.0.1:0", "STRATA_GATEWAY_HTTP_LISTEN": ""}
    stack = start_stack(config, env=env, log_dir=log_dir)
    try:
        yield stack
    finally:
        stack.stop()


@contextlib.asynccontextmanager
async def in_process_gateway(
    stack: Stack, route: dict[str, Any], prepare: Callable[[GatewayServer], None] | None = None
) -> AsyncIterator[Stub]:
    """A gateway in this process on `stack`'s tokenizer and on the workers of `route`'s model, its one
    route `route`; `prepare` sees the server once it is ready."""
    workers = [
        address
        for address, name in zip(stack.addresses.workers, stack.worker_models, strict=True)
        if name == route["model"]
    ]
    settings = GatewaySettings.build(
        {
            "listen": "127.0.0.1:0",
            "tokenizer_address": stack.addresses.tokenizer,
            "routes": [{**route, "workers": workers}],
        }
    )
    server = await start_gateway(settings)
    try:
        if not await server.wait_ready(READY_S):
            raise SystemExit(f"the in-process gateway did not become ready in {READY_S:.0f} s")
        if prepare is not None:
            prepare(server)
        async with gateway(server.address) as (stub, _):
            yield stub
    finally:
        await server.stop(0)
