"""A request's id in the gateway and every form of it, made and converted here alone.

A request has one id, its `request_id`: the caller's (validation.py checks its length and characters)
or, when the caller gave none, a uuid4 hex made here. The front door that needs it before validation
(the HTTP API names every chunk with it) makes it first; later steps keep what they are given, so a
request's samples and attempts all carry the same id. Two forms derive from it and never travel back:

- the **wire id** of each attempt on a worker stream, `<request_id>#<n>`, n counting every submission
  this process sends: unique on the stream even when two callers choose the same id, and for each
  attempt of one request, so a retry on the same worker is never confused with the attempt it
  replaces (its late updates, its cancellation); the worker knows a request by it alone;
- the HTTP API's **response id**, `chatcmpl-<request_id>` or `cmpl-<request_id>`, as OpenAI names them.

This module must not check ids (validation.py does) nor hold any request's state.
"""

from __future__ import annotations

import itertools
import uuid

_SUBMISSIONS = itertools.count(1)


def new_request_id() -> str:
    """An id for a request whose caller gave none."""
    return uuid.uuid4().hex


def or_new(request_id: str) -> str:
    """The caller's id, or a new one when it is empty."""
    return request_id or new_request_id()


def wire_id(request_id: str) -> str:
    """The id of one new submission of the request on a worker stream."""
    return f"{request_id}#{next(_SUBMISSIONS)}"


def response_id(request_id: str, *, chat: bool) -> str:
    """The HTTP API's id of the request's response: a chat completion's, or a completion's."""
    return ("chatcmpl-" if chat else "cmpl-") + request_id
