"""The HTTP API's LoRA adapter endpoints, in vLLM's shape: `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter`.

A body names the adapter (`lora_name`), the route whose workers serve it (`model`, the default route
when absent) and, to load, its folder on the workers (`lora_path`). The caller must send one of the
gateway's `admin_keys` (`authorization: Bearer <key>`): tenants' keys do not manage adapters, and
without admin_keys these paths answer 404. The call is forwarded to every ready worker of the route
(gateway/adapter_admin.py); the answer lists each worker's outcome, 200 when every one succeeded and
otherwise the first failure's status (400 for an adapter unfit for the base, 409 for a name loaded
already, 404 for an unknown one), 503 when the route has no ready worker. This module owns the
endpoints' bodies and the admin check; it must not call workers itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.responses import JSONResponse

from gateway import adapter_admin
from gateway.auth import key_matches
from gateway.errors import GatewayError
from gateway.http_exchange import read_body
from gateway.openai_errors import HttpError, from_gateway, from_validation

if TYPE_CHECKING:
    from starlette.requests import Request

    from gateway.adapter_admin import Outcome
    from gateway.router import Router
    from gateway.settings import GatewaySettings

_MAX_BODY_BYTES = 64 * 1024
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 502,  # the gateway's worker_admin_token is wrong: its own fault
    grpc.StatusCode.PERMISSION_DENIED: 502,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
}


class AdapterBody(BaseModel):
    """The body of both endpoints (lora_path for a load only)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str = ""
    model: str = ""


class AdapterEndpoints:
    """POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter."""

    def __init__(self, settings: GatewaySettings, router: Router) -> None:
        self._settings = settings
        self._router = router
        self._keys = tuple(key.get_secret_value().encode() for key in settings.admin_keys)

    async def load(self, request: Request) -> JSONResponse:
        return await self._answer(request, load=True)

    async def unload(self, request: Request) -> JSONResponse:
        return await self._answer(request, load=False)

    async def _answer(self, request: Request, load: bool) -> JSONResponse:
        try:
            body = await self._body(request, load)
            route = self._router.route(body.model or self._settings.default_route)
            token = self._settings.worker_admin_token
            if token is None:
                raise HttpError(
                    400, "the gateway has no worker_admin_token to forward adapter calls with: set it"
                )
            if not any(link.ready for link in route.links):
                raise HttpError(503, f"model {route.name!r} has no ready worker to load the adapter on")
            secret = token.get_secret_value()
            outcomes = await (
                adapter_admin.load(route, body.lora_name, body.lora_path, secret)
                if load
                else adapter_admin.unload(route, body.lora_name, secret)
            )
        except GatewayError as error:
            return from_gateway(error).response()
        except HttpError as error:
            return error.response()
        return _report(f"{route.name}:{body.lora_name}", outcomes)

    async def _body(self, request: Request, load: bool) -> AdapterBody:
        if not self._keys:
            raise HttpError(
                404, f"{request.url.path}: not found (the gateway has no admin_keys)", code="not_found"
            )
        if not key_matches(request.headers.get("authorization"), self._keys):
            raise HttpError(
                401,
                "adapter calls need one of the gateway's admin_keys as `Authorization: Bearer <key>`",
                "authentication_error",
            )
        raw = await read_body(request, _MAX_BODY_BYTES, self._settings.http_body_timeout_s)
        try:
            body = AdapterBody.model_validate_json(raw)
        except ValidationError as error:
            raise from_validation(error) from error
        if load and not body.lora_path:
            raise HttpError(400, "lora_path: is required to load an adapter", param="lora_path")
        return body


def _report(model: str, outcomes: list[Outcome]) -> JSONResponse:
    workers: list[dict[str, Any]] = [
        {"address": o.address, "status": "ok" if o.ok else o.code.name.lower(), "message": o.message}
        for o in outcomes
    ]
    failed = next((o for o in outcomes if not o.ok), None)
    status = 200 if failed is None else _STATUS.get(failed.code, 502)
    return JSONResponse({"model": model, "workers": workers}, status_code=status)
