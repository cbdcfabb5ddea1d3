"""The values a request's path hands from module to module: what a front door brings (Incoming), what
one worker update means for the request (Delta), what the client gets (Chunk) and why an attempt
ended without an answer (Failure).

They sit below every module of the path, so that the front doors, the worker links, the attempts
and the request can all name them without naming each other. This module must not hold any state
nor import another gateway module that does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.tenant_settings import DEFAULT_TENANT
from strata.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gateway.errors import GatewayError
    from gateway.stage_clock import Call


@dataclass(frozen=True, slots=True)
class Incoming:
    """A request as a front door (gRPC, HTTP) hands it to the pipeline; cancelling is closing the
    pipeline's generator."""

    request: gateway_pb2.GenerateRequest
    protocol: str = "grpc"
    tenant: str = DEFAULT_TENANT
    deadline_unix_ms: int = 0
    """Absolute deadline; 0 is none."""
    trace_context: Mapping[str, str] = field(default_factory=dict)
    """The caller's W3C trace context (traceparent, tracestate)."""


@dataclass(slots=True)
class Delta:
    """What one worker message meant for the request: new text and ids, and how it ended, if it did."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: common_pb2.FinishReason.ValueType = common_pb2.FINISH_REASON_UNSPECIFIED
    """Set on the attempt's last delta."""
    stop_sequence: str = ""
    """The stop string that ended the text (finish_reason is then FINISH_REASON_STOP); empty when
    the model ended it, or the text has not ended."""
    error: GatewayError | None = None
    """Set instead when the attempt failed; nothing follows it."""
    queue_ms: float = 0.0
    """The worker's queue time; on the attempt's first update."""
    forward_ms: float = 0.0
    """The worker's time from first scheduling to this update."""
    received: float = 0.0
    """time.perf_counter() when the worker's message with this update arrived."""
    detokenize: Call | None = None
    """The Detokenize call that turned this update into text."""
    device_memory_bytes: int = 0
    """The worker's device memory; on the last update."""
    cached_prompt_tokens: int = 0
    """Prompt tokens the worker's prefix cache served for this attempt."""
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    """Speculative decoding's drafts in the steps of this update, and those the model kept."""
    logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    """With sampling.logprobs: one entry per token of token_ids, tokens named."""
    prompt_logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    """With sampling.prompt_logprobs: on the attempt's first update."""

    @property
    def finished(self) -> bool:
        return self.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED

    @property
    def from_worker(self) -> bool:
        """It reports a worker step (new ids, or the end): the worker's times and counts are in it."""
        return bool(self.token_ids) or self.finished


@dataclass(frozen=True, slots=True)
class Chunk:
    """New text and ids for the client; `final` on the last chunk only."""

    text: str
    token_ids: list[int]
    final: gateway_pb2.GenerateResponse | None = None
    model: str = ""
    """The model serving the request when this chunk was made (a failover changes it mid-stream)."""
    logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    """With sampling.logprobs: one entry per token of token_ids."""
    index: int = 0
    """The sample this chunk belongs to (GenerateRequest.n; samples.py)."""
    sample_final: gateway_pb2.GenerateResponse | None = None
    """With n > 1: on each sample's last chunk, that sample's own final (`final` ends the request)."""
    input_tokens: int = 0
    """The prompt's tokens as the model reads them: known from a request's first chunk on."""
    cached_input_tokens: int = 0
    """Of those, the ones the worker's prefix cache served (as its latest update said)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """A worker failed the request: the attempt is over, the request may not be."""

    reason: str
    worker_lost: bool = False
    """The worker went away or refused (UNAVAILABLE), rather than its engine failing the request."""
