"""The HTTP API's one map from failures to HTTP statuses and OpenAI error bodies.

Every error a client of the HTTP API sees is `{"error": {"message", "type", "param", "code"}}` with
`param` in the HTTP API's names. A pipeline error (GatewayError) maps one to one from its gRPC code
(INVALID_ARGUMENT 400, PERMISSION_DENIED 403, NOT_FOUND 404, RESOURCE_EXHAUSTED 429 with Retry-After
and retry-after-ms from the same estimate as the gRPC RetryInfo, UNAVAILABLE 503, DEADLINE_EXCEEDED
504); a body that is not
JSON, has a wrong type or asks for an unsupported feature is 400 naming the field; 401, 408, 413 and
the 503 of a full front door (http_guard.py) are the HTTP front door's own. This module must not
decide when something fails: callers raise, the front door answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from starlette.responses import JSONResponse

from gateway.errors import ResourceExhausted
from gateway.openai_mapping import http_message, http_param
from strata.status import QuotaExceeded

if TYPE_CHECKING:
    from pydantic import ValidationError

    from gateway.errors import GatewayError

# gRPC code -> (HTTP status, OpenAI error type, code).
_BY_CODE: dict[grpc.StatusCode, tuple[int, str, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "failed_precondition"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", "cancelled"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
}
UNAUTHENTICATED = "missing or unknown API key: send the header `Authorization: Bearer <key>`"


@dataclass(frozen=True)
class HttpError(Exception):
    """An answer that is an error: its status, OpenAI error body and extra headers."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The answer: its status, body and headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_gateway(error: GatewayError, token_field: str = "max_tokens") -> HttpError:
    """The HTTP answer for a pipeline error; `token_field` is the field the client set max tokens by."""
    status, kind, code = _BY_CODE.get(error.code, (500, "internal_error", error.code.name.lower()))
    headers: dict[str, str] = {}
    if isinstance(error, ResourceExhausted):
        headers = retry_headers(error.retry_after_s)
        if isinstance(error, QuotaExceeded):
            code = "quota_exceeded"
    param = http_param(error.message, token_field) if status in (400, 404) else None
    return HttpError(status, http_message(error.message, token_field), kind, param, code, headers)


def from_validation(error: ValidationError) -> HttpError:
    """A body that is not JSON, or whose field has a wrong type or an unsupported value: 400."""
    # Of a union's failed members, the deepest says most (messages[0].content[0].type over "not a string").
    first = max(error.errors(include_url=False), key=lambda item: len(item["loc"]))
    kind, loc, message = first["type"], first["loc"], str(first["msg"])
    if kind == "json_invalid":
        return HttpError(400, f"the body is not valid JSON: {first['ctx']['error']}", code="invalid_json")
    if kind == "model_type" and not loc:
        return HttpError(400, "the body must be a JSON object", code="invalid_json")
    if not loc:  # a check across fields: its message starts with the field it names
        text = message.removeprefix("Value error, ")
        field_name, sep, _ = text.partition(":")
        return HttpError(400, text, param=field_name if sep else None, code="unsupported_value")
    param = _path(loc)
    if kind == "extra_forbidden":
        message = "not a field of this request; remove it"
    elif kind == "missing":
        message = "is required"
    return HttpError(400, f"{param}: {message}", param=param, code="invalid_value")


def _path(loc: tuple[int | str, ...]) -> str:
    """A pydantic location as a field path (messages[0].content), without the names pydantic gives a
    union's members (`str`, `list[TextPart]`)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_NAMES:
            path += f".{part}" if path else part
    return path


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "TextPart", "StreamOptions", "ResponseFormat"})


def unauthenticated() -> HttpError:
    return HttpError(401, UNAUTHENTICATED, "authentication_error", None, "invalid_api_key")


def retry_headers(delay_s: float) -> dict[str, str]:
    """Retry-After in whole seconds (rounded up, so a client never comes back early) and
    retry-after-ms, which the openai SDK reads first, with the estimate's precision."""
    delay = max(0.0, delay_s)
    return {"retry-after": str(math.ceil(delay)), "retry-after-ms": str(round(delay * 1000))}


def over_connections(limit: int, retry_after_s: float) -> HttpError:
    """503; the connection closes with it (it is over the cap for as long as it stays open)."""
    return HttpError(
        503,
        f"this gateway holds {limit} HTTP connections, its limit (http_max_connections); retry later",
        "service_unavailable",
        code="too_many_connections",
        headers={**retry_headers(retry_after_s), "connection": "close"},
    )


def too_slow(part: str, setting: str, limit_s: float) -> HttpError:
    """408; the connection closes with it (what is left of the request would be read as the next)."""
    return HttpError(
        408,
        f"the {part} did not arrive within {limit_s:g} s ({setting}); send it at once",
        "timeout",
        code="request_timeout",
        headers={"connection": "close"},
    )


def too_large(limit: int) -> HttpError:
    return HttpError(
        413,
        f"the body is over this gateway's limit of {limit} bytes (max_message_bytes); send a smaller one",
        code="request_too_large",
    )
