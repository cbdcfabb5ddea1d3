"""The Messages API's errors: Anthropic's error body and status codes for what the HTTP API answers.

Every error a client of POST /v1/messages sees is `{"type": "error", "error": {"type", "message"}}`.
The HTTP front door decides the failure once, as an HttpError (openai_errors.py: the message names the
field as the client sent it); `anthropic_error` gives it Anthropic's type and status: 400
invalid_request_error, 401 authentication_error, 403 permission_error, 404 not_found_error, 408 and
504 timeout_error, 413 request_too_large, 429 rate_limit_error for a tenant's quota (with
retry-after), 529 overloaded_error when admission refuses for load (with retry-after, which Anthropic's
SDKs honour) or no worker can take the request, and 500 api_error for anything else. This module
must not decide when something fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.openai_errors import HttpError

OVERLOADED = 529
"""Anthropic's status for an overloaded service."""
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    504: "timeout_error",
}
UNAUTHENTICATED = "missing or unknown API key: send the header `x-api-key: <key>`"


@dataclass(frozen=True)
class AnthropicError(HttpError):
    """An HttpError answered in Anthropic's shape."""

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def anthropic_error(error: HttpError) -> AnthropicError:
    """`error` as the Messages API answers it."""
    if error.status == 401:
        return AnthropicError(401, UNAUTHENTICATED, "authentication_error", headers=error.headers)
    if error.status == 429 and error.code == "quota_exceeded":
        return AnthropicError(429, error.message, "rate_limit_error", headers=error.headers)
    if error.status in (429, 503):
        return AnthropicError(OVERLOADED, error.message, "overloaded_error", headers=error.headers)
    kind = _TYPES.get(error.status)
    if kind is None:
        return AnthropicError(500, error.message, "api_error", headers=error.headers)
    return AnthropicError(error.status, error.message, kind, error.param, error.code, error.headers)
