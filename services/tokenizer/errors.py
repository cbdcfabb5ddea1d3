"""The tokenizer service's one map from failures to gRPC status codes.

Every refusal is a TokenizerError (strata.status's StatusError) whose class fixes the status code; its
message names the field and the limit. A failed entry of a batch becomes an EntryError in that entry's
result, a failed call is aborted with the same code. This module must not decide *when* something
fails: callers raise, the servicer reports.
"""

from __future__ import annotations

from strata.status import FailedPrecondition, InvalidArgument, NotFound, Unavailable, abort
from strata.status import StatusError as TokenizerError
from strata.v1 import tokenizer_pb2

__all__ = [
    "InvalidArgument",
    "NoChatTemplate",
    "NotReady",
    "TokenizerError",
    "UnknownModel",
    "abort",
    "entry_error",
]


class UnknownModel(NotFound):
    """The entry names a model this service has no tokenizer for."""


class NoChatTemplate(FailedPrecondition):
    """Messages were sent for a model whose tokenizer has no chat template."""


class NotReady(Unavailable):
    """The tokenizers are still loading, or the service is stopping."""


def entry_error(error: TokenizerError) -> tokenizer_pb2.EntryError:
    """The EntryError carried by the result of one failed entry."""
    return tokenizer_pb2.EntryError(code=error.code.value[0], message=error.message)
