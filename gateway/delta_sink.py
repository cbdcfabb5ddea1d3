"""Where a request's worker updates land: the detokenization state and the queue of deltas.

The worker link of the request's current attempt turns each of the request's updates into one
Detokenize entry (`entry`) and, once the tokenizer has answered, into one Delta (`deliver`); an
attempt that fails is told with `fail`. The state the stateless tokenizer service needs (the window
of recent ids, the read offset inside it, the text held back as a possible stop-string prefix, the
ids detokenized so far) is kept here across attempts, so that a failover's text continues exactly
where the client's copy ends. The pipeline takes the deltas out (`next_deltas`). This module must not
build chunks or responses (request.py does) nor know which worker or attempt an update came from.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from gateway.logprobs import named, piece_ids
from gateway.request_values import Delta
from strata.v1 import common_pb2, tokenizer_pb2

if TYPE_CHECKING:
    from gateway.errors import GatewayError
    from gateway.stage_clock import Call
    from strata.v1 import worker_pb2


class DeltaSink:
    """One request's detokenization state and pending deltas. Used from the event loop only."""

    def __init__(self, stop: tuple[str, ...], min_tokens: int) -> None:
        """`stop`: the request's stop strings, matched once `min_tokens` ids were generated."""
        self._stop = stop
        self._min_tokens = min_tokens
        self._deltas: asyncio.Queue[Delta] = asyncio.Queue()
        self.window: list[int] = []
        self.read_offset = 0
        self.pending_text = ""
        self.detokenized_tokens = 0
        """Ids sent to the detokenizer so far: min_tokens holds stop strings back until it is reached."""

    def entry(self, update: worker_pb2.TokenUpdate, model: str) -> tokenizer_pb2.DetokenizeEntry:
        """The Detokenize entry for this update's new ids (and the ids its log probabilities name),
        in the vocabulary of `model`, the one that generated them."""
        reached = self.detokenized_tokens + len(update.token_ids) >= self._min_tokens
        return tokenizer_pb2.DetokenizeEntry(
            model=model,
            window=self.window,
            read_offset=self.read_offset,
            new_ids=update.token_ids,
            pending_text=self.pending_text,
            stop=self._stop if reached else (),
            final=update.finished,
            piece_ids=piece_ids([*update.logprobs, *update.prompt_logprobs]),
        )

    def deliver(
        self,
        update: worker_pb2.TokenUpdate,
        result: tokenizer_pb2.DetokenizeResult,
        received: float,
        detokenize: Call,
    ) -> None:
        """Keep the result's state for the next entry and queue the client's delta.

        A stop string ends the request with FINISH_REASON_STOP even if the worker has not finished it,
        and the delta names it; the text stops where the stop string begins, while token_ids keep
        every id of this update.
        """
        self.window = list(result.window)
        self.read_offset = result.read_offset
        self.pending_text = result.pending_text
        self.detokenized_tokens += len(update.token_ids)
        pieces = iter(result.pieces)
        finish = update.finish_reason if update.finished else common_pb2.FINISH_REASON_UNSPECIFIED
        if result.stopped:
            finish = common_pb2.FINISH_REASON_STOP
        self._deltas.put_nowait(
            Delta(
                text=result.text,
                token_ids=list(update.token_ids),
                finish_reason=finish,
                stop_sequence=result.stop_sequence,
                queue_ms=update.queue_ms,
                forward_ms=update.forward_ms,
                received=received,
                detokenize=detokenize,
                device_memory_bytes=update.device_memory_bytes,
                cached_prompt_tokens=update.cached_prompt_tokens,
                draft_tokens=update.draft_tokens,
                accepted_draft_tokens=update.accepted_draft_tokens,
                logprobs=named(update.logprobs, pieces),
                prompt_logprobs=named(update.prompt_logprobs, pieces),
            )
        )

    def fail(self, error: GatewayError) -> None:
        """The current attempt failed; nothing of it follows."""
        self._deltas.put_nowait(Delta(error=error))

    async def next_deltas(self) -> list[Delta]:
        """The next delta, and every other one already queued (coalesced into one chunk)."""
        deltas = [await self._deltas.get()]
        while not self._deltas.empty():
            deltas.append(self._deltas.get_nowait())
        return deltas
