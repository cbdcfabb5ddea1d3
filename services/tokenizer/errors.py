"""The tokenizer service's one map from failures to gRPC status codes.

Every refusal is a TokenizerError whose class fixes the status code; its message names the field and
the limit. A failed entry of a batch becomes an EntryError in that entry's result, a failed call is
aborted with the same code. This module must not decide *when* something fails: callers raise, the
servicer reports.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from strata.v1 import tokenizer_pb2


class TokenizerError(Exception):
    """A refusal, with the status code the caller must see."""

    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(TokenizerError):
    """The entry or call is malformed or over a limit; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownModel(TokenizerError):
    """The entry names a model this service has no tokenizer for."""

    code = grpc.StatusCode.NOT_FOUND


class NoChatTemplate(TokenizerError):
    """Messages were sent for a model whose tokenizer has no chat template."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotReady(TokenizerError):
    """The tokenizers are still loading, or the service is stopping."""

    code = grpc.StatusCode.UNAVAILABLE


def entry_error(error: TokenizerError) -> tokenizer_pb2.EntryError:
    """The EntryError carried by the result of one failed entry."""
    return tokenizer_pb2.EntryError(code=error.code.value[0], message=error.message)


async def abort(context: grpc.aio.ServicerContext[object, object], error: TokenizerError) -> NoReturn:
    """End the whole call with the error's status and message."""
    await context.abort(error.code, error.message)
    raise AssertionError("context.abort returned")  # grpc raises; this keeps NoReturn honest
