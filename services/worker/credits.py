"""The worker's credits: how many more requests it accepts, shared by every connected stream.

Several gateways may share one worker, so the worker alone judges whether a submission fits: a
request takes one credit when accepted and gives it back when it finishes, fails or is aborted. This
module only counts; it must not know about streams, the engine or gRPC.
"""

from __future__ import annotations

from services.worker.errors import NoCreditError


class CreditPool:
    """Open requests against a fixed limit. Used from the event loop only, so it needs no lock."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"credit limit {limit} must be >= 1")
        self.limit = limit
        self._open = 0

    @property
    def open(self) -> int:
        """Requests accepted and not yet finished, over all streams."""
        return self._open

    @property
    def available(self) -> int:
        """Requests the worker accepts now."""
        return self.limit - self._open

    def acquire(self) -> None:
        """Take one credit, or raise NoCreditError with a retry hint when none is left."""
        if self._open >= self.limit:
            raise NoCreditError(
                f"the worker holds its limit of {self.limit} open requests (max_requests); "
                "retry when its credits show room, or send the request to another worker"
            )
        self._open += 1

    def release(self) -> None:
        """Give back one credit taken by acquire."""
        if self._open <= 0:
            raise RuntimeError("credit released more often than acquired")
        self._open -= 1
