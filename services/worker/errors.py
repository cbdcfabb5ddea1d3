"""The worker's one map from failures to gRPC status codes.

Everything the worker refuses or fails is raised as a typed exception (the engine's own, or one of
those below) and turned into a (code, message) pair here, whether it becomes a stream's final status
or a Rejection on the stream. This module must not decide *when* to refuse; connection.py and host.py
do that, and never pick a status code themselves.
"""

from __future__ import annotations

import grpc

from services.worker.adapter_admin import AdminOffError, AdminTokenError
from services.worker.engine.adapters import AdapterExistsError, NoAdapterSlotsError, UnknownAdapterError
from services.worker.engine.async_engine import EngineDeadError
from services.worker.model.config import ModelLoadError
from services.worker.model.lora_file import AdapterError
from strata.sampling import InvalidRequestError


class NotReadyError(RuntimeError):
    """The model is still loading (or failed to load): nothing can run yet."""


class DrainingError(RuntimeError):
    """The worker is shutting down and takes no new work."""


class HelloMismatchError(RuntimeError):
    """The gateway routes another model, or tokenizes with another tokenizer, than this worker's."""


class ProtocolError(ValueError):
    """A ConnectRequest that breaks the stream's rules (no hello first, hello twice, an empty id)."""


class NoCreditError(RuntimeError):
    """The worker holds as many requests as its credits allow."""


class DeadlinePassedError(RuntimeError):
    """The submission's deadline was already over when it arrived."""


class TooManySubmissionsError(RuntimeError):
    """One ConnectRequest carried more submissions than the worker accepts in one message."""


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ProtocolError, grpc.StatusCode.INVALID_ARGUMENT),
    (HelloMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (NoCreditError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TooManySubmissionsError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlinePassedError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (NotReadyError, grpc.StatusCode.UNAVAILABLE),
    (DrainingError, grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (ModelLoadError, grpc.StatusCode.UNAVAILABLE),
    (UnknownAdapterError, grpc.StatusCode.NOT_FOUND),
    (AdapterError, grpc.StatusCode.INVALID_ARGUMENT),
    (AdapterExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (NoAdapterSlotsError, grpc.StatusCode.FAILED_PRECONDITION),
    (AdminTokenError, grpc.StatusCode.UNAUTHENTICATED),
    (AdminOffError, grpc.StatusCode.PERMISSION_DENIED),
)

REFUSALS: tuple[type[Exception], ...] = tuple(kind for kind, _ in _CODES if issubclass(kind, Exception))
"""Everything the worker refuses a client with; anything else is a worker bug."""


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for `error`; INTERNAL only for the worker's own bugs."""
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code, str(error)
    return grpc.StatusCode.INTERNAL, f"the worker failed: {error!r}"


def rejection_code(error: BaseException) -> int:
    """The numeric grpc.StatusCode a Rejection carries (3, 4, 5, 8 or 14)."""
    code, _ = status_of(error)
    return int(code.value[0])
