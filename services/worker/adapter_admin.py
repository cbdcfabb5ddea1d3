"""The worker's LoRA adapter calls: ListAdapters for anyone, LoadAdapter and UnloadAdapter for its admin.

An admin call must carry `authorization: Bearer <admin_token>`, compared in constant time; a worker
without an admin_token refuses them all. Loading reads the adapter's files on the engine's own thread
between two steps (AsyncEngine.call), where every other change to the engine's adapters happens, so
no step ever sees half an adapter. This module owns the admin check and the calls' messages; it must
not pick status codes (errors.py does) nor decide slots (the engine's adapter table does).
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import TYPE_CHECKING

from strata.v1 import worker_pb2

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pydantic import SecretStr

    from services.worker.engine.async_engine import AsyncEngine
    from services.worker.engine.engine import LLMEngine


class AdminTokenError(PermissionError):
    """An admin call without the worker's admin token."""


class AdminOffError(PermissionError):
    """An admin call to a worker that has no admin_token."""


def authorize(token: SecretStr | None, metadata: Iterable[tuple[str, str | bytes]]) -> None:
    """Raise unless `metadata` carries `authorization: Bearer <token>`."""
    if token is None:
        raise AdminOffError("this worker takes no admin calls: set its admin_token to enable them")
    sent = next((value for key, value in metadata if key == "authorization"), "")
    given = sent.encode() if isinstance(sent, str) else sent
    expected = f"Bearer {token.get_secret_value()}".encode()
    if not hmac.compare_digest(given, expected):
        raise AdminTokenError("admin calls need `authorization: Bearer <admin_token>` metadata")


def _listing(engine: LLMEngine) -> worker_pb2.ListAdaptersResponse:
    lora = engine.lora
    if lora is None:
        return worker_pb2.ListAdaptersResponse()
    return worker_pb2.ListAdaptersResponse(
        adapters=[
            worker_pb2.Adapter(name=name, path=str(path), rank=rank, resident=resident)
            for name, path, rank, resident in lora.table.describe()
        ],
        max_loras=lora.config.max_loras,
        max_lora_rank=lora.config.max_lora_rank,
    )


async def list_adapters(engine: AsyncEngine) -> worker_pb2.ListAdaptersResponse:
    return await engine.call(_listing)


async def load_adapter(engine: AsyncEngine, request: worker_pb2.LoadAdapterRequest) -> worker_pb2.Adapter:
    """Serve the adapter in request.path as request.name; raises what refuses it (errors.py maps it)."""
    path = Path(request.path)
    rank = await engine.call(lambda e: e.load_adapter(request.name, path))
    return worker_pb2.Adapter(name=request.name, path=str(path), rank=rank, resident=False)


async def unload_adapter(engine: AsyncEngine, name: str) -> None:
    await engine.call(lambda e: e.unload_adapter(name))
