"""Micro-batching of prompts into shared Tokenize calls.

An arrival while no Tokenize call is in flight is sent at once, so an idle gateway adds no latency to
time to first token. Under load, an arrival while a call is in flight opens a batch and arms one timer
of `max_batch_delay_ms`; later arrivals join it, and it is sent when the timer fires, when it holds
`max_batch_size` entries, or when its prompts reach MAX_BATCH_BYTES. A call's timeout is the longest
time any of its callers has left (bounded by tokenizer_timeout_s), so a client's deadline travels to
the tokenizer. Each caller awaits its own future and gets its own TokenizeResult, or the GatewayError
its entry (or the whole call) failed with. Nothing polls: one timer handle per open batch, one task per
call in flight. This module must not know the request pipeline.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING

from gateway.errors import DeadlineExceeded, GatewayError, Unavailable, from_code
from gateway.metrics import TOKENIZE_BATCH_SIZE
from gateway.stage_clock import Call
from strata.rpc import MIB
from strata.v1 import tokenizer_pb2

if TYPE_CHECKING:
    from gateway.tokenizer_client import TokenizerClient

# Keeps one Tokenize call well inside the tokenizer service's default 16 MiB message bound.
MAX_BATCH_BYTES = 4 * MIB
MIN_TIMEOUT_S = 0.001

_Timed = tuple[tokenizer_pb2.TokenizeResult, Call]
_Pending = tuple[tokenizer_pb2.TokenizeEntry, "asyncio.Future[_Timed]", float | None]


class TokenizeBatcher:
    """Collects arrivals for a short window and tokenizes them in one call."""

    def __init__(self, client: TokenizerClient, window_ms: float, max_batch: int) -> None:
        self._client = client
        self._window_s = window_ms / 1000.0
        self._max_batch = max_batch
        self._pending: list[_Pending] = []
        self._pending_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._calls: set[asyncio.Task[None]] = set()

    async def tokenize(
        self, entry: tokenizer_pb2.TokenizeEntry, deadline: float | None = None
    ) -> tokenizer_pb2.TokenizeResult:
        """The entry's tokens; raises the GatewayError its entry failed with."""
        result, _ = await self.tokenize_timed(entry, deadline)
        return result

    async def tokenize_timed(
        self, entry: tokenizer_pb2.TokenizeEntry, deadline: float | None = None
    ) -> tuple[tokenizer_pb2.TokenizeResult, Call]:
        """The entry's tokens and the times of the call that carried it; raises like tokenize.

        `deadline` (time.monotonic(); None: none) is the caller's: the call waits no longer than the
        latest deadline among the entries sharing it.
        """
        if deadline is not None and deadline <= time.monotonic():
            raise DeadlineExceeded("the request's deadline passed before it could be tokenized")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_Timed] = loop.create_future()
        size = entry.ByteSize()
        if self._pending and self._pending_bytes + size > MAX_BATCH_BYTES:
            self._flush()
        self._pending.append((entry, future, deadline))
        self._pending_bytes += size
        if len(self._pending) >= self._max_batch or not self._calls:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self._window_s, self._flush)
        return await future

    async def close(self) -> None:
        """Wait for the calls in flight (their callers are waiting on them)."""
        self._flush()
        if self._calls:
            await asyncio.gather(*self._calls, return_exceptions=True)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch = [pending for pending in self._pending if not pending[1].done()]
        self._pending = []
        self._pending_bytes = 0
        if not batch:
            return
        task = asyncio.create_task(self._call(batch), name=f"tokenize-{len(batch)}")
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _call(self, batch: list[_Pending]) -> None:
        request = tokenizer_pb2.TokenizeRequest(entries=[entry for entry, _, _ in batch])
        deadlines = [deadline for _, _, deadline in batch]
        timeout = None
        if None not in deadlines:
            # grpc reads a zero timeout as none: a call whose callers all ran out still gets a bound.
            timeout = max(MIN_TIMEOUT_S, max(d for d in deadlines if d is not None) - time.monotonic())
        for model, count in Counter(entry.model for entry, _, _ in batch).items():
            TOKENIZE_BATCH_SIZE.labels(model).observe(count)
        started = time.perf_counter()
        try:
            response = await self._client.tokenize(request, timeout)
        except GatewayError as exc:
            for _, future, _ in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        if len(response.results) != len(batch):
            error = Unavailable(
                f"tokenizer service answered {len(response.results)} results for {len(batch)} prompts"
            )
            for _, future, _ in batch:
                if not future.done():
                    future.set_exception(error)
            return
        call = Call(started, time.perf_counter(), response.server_ms)
        for (_, future, _), result in zip(batch, response.results, strict=True):
            if future.done():  # the caller went away while the call was in flight
                continue
            if result.HasField("error"):
                future.set_exception(from_code(result.error.code, result.error.message))
            else:
                future.set_result((result, call))
