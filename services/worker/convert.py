"""Translation between the worker's wire types and the engine's: sampling parameters, finish reasons,
token updates (with their log probabilities), priorities, inter-token SLOs, the continuation of a
request another worker started, and the memory budget.

The proto leaves some sampling fields unset to mean "off"; this module fills the engine's defaults
for them and rejects what the gateway must always fill. A scalar the engine names as the proto does
and takes as it comes (`_AS_SENT`) is copied by name, so a new one needs no line here. A submission
with `prior_output_ids` (a failover) runs in the engine as prompt + prior ids with max_new_tokens
shortened by the prior count; token updates then count the prior ids as output, not prompt, and
never carry them. It must not validate ranges (the engine's SamplingParams.validate does) nor hold
any state. An output constraint becomes a GrammarSpec here; compiling it is the grammar compiler's
job.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING

from services.worker.engine.grammar_spec import GrammarKind, GrammarSpec
from services.worker.engine.sequence import FinishReason
from services.worker.errors import DeadlinePassedError
from strata.sampling import InvalidRequestError, SamplingParams, as_sent
from strata.v1 import common_pb2, worker_pb2

if TYPE_CHECKING:
    from collections.abc import Iterable

    from services.worker.engine.sequence import StepOutput, TokenLogprobs
    from services.worker.memory_budget import MemoryBudget

_CONVERTED = frozenset({"max_new_tokens", "min_tokens", "stop_token_ids", "logit_bias", "logprobs"})
"""The engine's fields that sampling_params computes from the submission rather than copying: the
prior output shortens two, two merge or reshape a list, and `logprobs` is the proto's top_logprobs."""
_PROTO_FIELDS = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
_AS_SENT = tuple(
    field.name
    for field in dataclasses.fields(SamplingParams)
    if field.name in _PROTO_FIELDS and field.name not in _CONVERTED
)
"""The engine's fields the proto carries under the same name, copied as sent (an optional one left
unset keeps the engine's default)."""


FINISH_REASONS: dict[FinishReason, common_pb2.FinishReason.ValueType] = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORTED: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


def sampling_params(submission: worker_pb2.Submission) -> SamplingParams:
    """The engine's parameters for a submission; range checks are left to SamplingParams.validate."""
    wire = submission.sampling
    if wire.max_new_tokens == 0:
        raise InvalidRequestError(
            "sampling.max_new_tokens", 0, "must be >= 1: the gateway fills its default before submitting"
        )
    prior = len(submission.prior_output_ids)
    if prior >= wire.max_new_tokens:
        raise InvalidRequestError(
            "prior_output_ids",
            f"{prior} tokens",
            f"must be fewer than sampling.max_new_tokens={wire.max_new_tokens}: "
            "a request with every token generated has nothing left to continue",
        )
    if wire.top_logprobs and not wire.logprobs:
        raise InvalidRequestError(
            "sampling.top_logprobs", wire.top_logprobs, "needs sampling.logprobs set (or send 0)"
        )
    return SamplingParams(
        **as_sent(wire, _AS_SENT),
        max_new_tokens=wire.max_new_tokens - prior,
        stop_token_ids=tuple(dict.fromkeys([*submission.stop_token_ids, *wire.stop_token_ids])),
        logit_bias=tuple(sorted(wire.logit_bias.items())),
        # A failover's prior tokens count toward min_tokens as the tokens it already generated.
        min_tokens=max(0, wire.min_tokens - prior),
        logprobs=wire.top_logprobs if wire.logprobs else None,
        prior_output_tokens=prior,
        speculate=not wire.no_speculation,
    )


def constraint_spec(submission: worker_pb2.Submission) -> GrammarSpec | None:
    """The submission's output constraint, checked for shape (the compiler judges the rest); None
    when it has none."""
    wire = submission.sampling
    if not wire.HasField("constraint"):
        return None
    kind = wire.constraint.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError(
            "sampling.constraint", "<empty>", f"must set one of {', '.join(k.value for k in GrammarKind)}"
        )
    return GrammarSpec.of(kind, getattr(wire.constraint, kind))


def engine_prompt(submission: worker_pb2.Submission) -> list[int]:
    """What the engine prefills: the prompt, then the tokens a failed worker already generated."""
    return [*submission.prompt_ids, *submission.prior_output_ids]


def itl_slo(submission: worker_pb2.Submission) -> float | None:
    """The submission's inter-token SLO in seconds; None when it has none (0)."""
    value = submission.itl_slo_ms
    if not value >= 0 or math.isinf(value):
        raise InvalidRequestError(
            "itl_slo_ms", value, "must be a finite number of milliseconds >= 0 (0 is none)"
        )
    return value / 1000.0 if value else None


def engine_priority(wire_priority: int) -> int:
    """The proto runs higher priorities first; the engine runs lower values first."""
    return -wire_priority


def token_update(
    request_id: str, output: StepOutput, *, queue_ms: float, forward_ms: float, prior_tokens: int = 0
) -> worker_pb2.TokenUpdate:
    """One request's share of an engine step, under the id the gateway gave it.

    `prior_tokens` ids of the engine's prompt were output of a failed worker: they count as output.
    """
    update = worker_pb2.TokenUpdate(
        request_id=request_id,
        token_ids=output.new_token_ids,
        finished=output.finished,
        prompt_tokens=output.num_prompt_tokens - prior_tokens,
        output_tokens=output.num_output_tokens + prior_tokens,
        queue_ms=queue_ms,
        forward_ms=forward_ms,
        # A failover's prior ids are prefilled as prompt: only the submission's prompt counts here.
        cached_prompt_tokens=min(output.num_cached_tokens, output.num_prompt_tokens - prior_tokens),
        draft_tokens=output.num_drafted,
        accepted_draft_tokens=output.num_accepted,
    )
    if output.finished and output.finish_reason is not None:
        update.finish_reason = FINISH_REASONS[output.finish_reason]
    if output.logprobs:
        update.logprobs.extend(position_logprobs(output.logprobs))
    if output.prompt_logprobs:
        update.prompt_logprobs.extend(position_logprobs(output.prompt_logprobs))
    return update


def position_logprobs(found: Iterable[TokenLogprobs]) -> list[common_pb2.PositionLogprobs]:
    """The engine's logprobs on the wire; the gateway fills each token's text."""
    return [
        common_pb2.PositionLogprobs(
            chosen=common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob),
            top=[common_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top],
            rank=lp.rank,
        )
        for lp in found
    ]


def ended_update(
    request_id: str,
    reason: FinishReason,
    *,
    prompt_tokens: int,
    output_tokens: int,
    queue_ms: float = 0.0,
    forward_ms: float = 0.0,
) -> worker_pb2.TokenUpdate:
    """The last update of a request the worker ended itself (cancelled, deadline, engine failure)."""
    return worker_pb2.TokenUpdate(
        request_id=request_id,
        finished=True,
        finish_reason=FINISH_REASONS[reason],
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        queue_ms=queue_ms,
        forward_ms=forward_ms,
    )


def memory_budget(budget: MemoryBudget) -> common_pb2.MemoryBudget:
    """The budget as GetWorkerInfo (and through the gateway, ListModels) reports it."""
    parts = budget.parts()
    return common_pb2.MemoryBudget(
        limit_bytes=parts["limit"],
        limit_source=budget.limit.source,
        memory_utilization=budget.memory_utilization,
        budget_bytes=parts["budget"],
        weights_bytes=parts["weights"],
        runtime_bytes=parts["runtime"],
        activation_peak_bytes=parts["activations"],
        kv_cache_bytes=parts["kv_cache"],
        kv_blocks=budget.num_blocks,
        kv_tokens=budget.kv_tokens,
        largest_context=budget.largest_context,
        sized_by=budget.sized_by,
        kv_cache_dtype=budget.kv_cache_dtype,
    )


def remaining_s(submission: worker_pb2.Submission) -> float:
    """Seconds left before the submission's deadline (0.0 when it has none); raises once it passed."""
    if not submission.deadline_unix_ms:
        return 0.0
    left = submission.deadline_unix_ms / 1000.0 - time.time()
    if left <= 0:
        raise DeadlinePassedError(
            f"deadline_unix_ms={submission.deadline_unix_ms} had passed {-left * 1000:.0f} ms "
            "before the worker could accept the request"
        )
    return left
