"""One submitted request's state on a worker link: its delta queue and its incremental-decode state.

The tokenizer service is stateless, so the caller keeps, per request, the window of recent ids, the
read offset inside it and the text held back as a possible stop-string prefix (see DetokenizeEntry).
An OpenRequest builds its entry for one worker update and applies the result, producing the Delta its
client receives. When a request fails over to another worker mid-stream, the new OpenRequest takes
over that state, so the text continues exactly where the client's copy ends. This module must not do
I/O: worker_link.py makes the one batched call per message.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from strata.v1 import common_pb2, tokenizer_pb2

if TYPE_CHECKING:
    from gateway.errors import GatewayError
    from gateway.stage_clock import Call
    from strata.v1 import worker_pb2


@dataclass(slots=True)
class Delta:
    """What one worker message meant for one request: new text and ids, and how it ended, if it did."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: common_pb2.FinishReason.ValueType = common_pb2.FINISH_REASON_UNSPECIFIED
    """Set on the request's last delta."""
    error: GatewayError | None = None
    """Set instead when the request failed; nothing follows it."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    queue_ms: float = 0.0
    """The worker's queue time; on the request's first update."""
    forward_ms: float = 0.0
    """The worker's time from first scheduling to this update."""
    received: float = 0.0
    """time.perf_counter() when the worker's message with this update arrived."""
    detokenize: Call | None = None
    """The Detokenize call that turned this update into text."""
    device_memory_bytes: int = 0
    """The worker's device memory; on the last update."""


@dataclass(slots=True, eq=False)
class OpenRequest:
    """A submitted request: where its deltas go and what its next Detokenize entry must carry."""

    wire_id: str
    """The request's id on the worker stream."""
    model: str
    stop: tuple[str, ...]
    deltas: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    window: list[int] = field(default_factory=list)
    read_offset: int = 0
    pending_text: str = ""
    submitted: float = field(default_factory=time.perf_counter)
    """time.perf_counter() when the submission was queued for the worker."""
    worker: str = ""
    """The worker's address."""

    def resume(self, previous: OpenRequest) -> None:
        """Continue the detokenization of `previous` (a failover): its first new ids extend that text."""
        self.window = list(previous.window)
        self.read_offset = previous.read_offset
        self.pending_text = previous.pending_text

    def entry(self, update: worker_pb2.TokenUpdate) -> tokenizer_pb2.DetokenizeEntry:
        """The Detokenize entry for this update's new ids."""
        return tokenizer_pb2.DetokenizeEntry(
            model=self.model,
            window=self.window,
            read_offset=self.read_offset,
            new_ids=update.token_ids,
            pending_text=self.pending_text,
            stop=self.stop,
            final=update.finished,
        )

    def advance(
        self,
        update: worker_pb2.TokenUpdate,
        result: tokenizer_pb2.DetokenizeResult,
        received: float,
        detokenize: Call,
    ) -> Delta:
        """Keep the result's state for the next entry and return the client's delta.

        A stop string ends the request with FINISH_REASON_STOP even if the worker has not finished it;
        the text stops where the stop string begins, while token_ids keep every id of this update.
        """
        self.window = list(result.window)
        self.read_offset = result.read_offset
        self.pending_text = result.pending_text
        finish = update.finish_reason if update.finished else common_pb2.FINISH_REASON_UNSPECIFIED
        if result.stopped:
            finish = common_pb2.FINISH_REASON_STOP
        return Delta(
            text=result.text,
            token_ids=list(update.token_ids),
            finish_reason=finish,
            prompt_tokens=update.prompt_tokens,
            output_tokens=update.output_tokens,
            queue_ms=update.queue_ms,
            forward_ms=update.forward_ms,
            received=received,
            detokenize=detokenize,
            device_memory_bytes=update.device_memory_bytes,
        )
