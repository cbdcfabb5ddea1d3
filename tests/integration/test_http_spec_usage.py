"""Each request's own speculative-decoding counts through a real stack (http_harness: tokenizer service,
worker speculating by prompt lookup, gateway with its HTTP API, the tiny model): the HTTP API's
`usage.completion_tokens_details` (accepted and rejected prediction tokens, read by the official openai
SDK) and the gRPC API's final Usage equal what the worker's GetWorkerStats counted for that request,
whole and streamed; n = 2 adds both samples'; a request that opts out reports none.

The draft rule's step-cost model is pinned to free drafts (tests/engine_runs.py), so whether a step
drafts does not hang on how busy this machine is; the prompt repeats itself, so prompt lookup always
finds something to draft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc
import openai
import pytest

from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.engine_runs import pin_draft_cost
from tests.integration.http_harness import KEY, MODEL, HttpStack

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from openai.types import CompletionUsage

PROMPT = "one two three four five six seven eight " * 4
TOKENS = 32


@pytest.fixture(scope="module")
def speculating(tiny_serving_dir: Path) -> Iterator[HttpStack]:
    with HttpStack(tiny_serving_dir, engine={"speculative": {"method": "ngram"}}) as stack:
        pin_draft_cost(stack.worker.host.engine.engine)
        yield stack


def drafted_by_worker(stack: HttpStack, ask: Any) -> tuple[Any, int, int]:
    """ask()'s answer, and the drafts the worker scored and kept meanwhile (its stats' difference)."""
    before = stack.worker_stats()
    answer = ask()
    after = stack.worker_stats()
    drafted = after.draft_tokens - before.draft_tokens
    return answer, drafted, after.accepted_draft_tokens - before.accepted_draft_tokens


def counts(usage: CompletionUsage | None) -> tuple[int, int]:
    """(drafted, kept) from the HTTP usage, whose details must be there."""
    assert usage is not None and usage.completion_tokens_details is not None, usage
    kept = usage.completion_tokens_details.accepted_prediction_tokens
    thrown = usage.completion_tokens_details.rejected_prediction_tokens
    assert kept is not None and thrown is not None
    return kept + thrown, kept


def client(stack: HttpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_usage_counts_the_drafts_as_the_worker_did(speculating: HttpStack, stream: bool) -> None:
    def ask() -> CompletionUsage | None:
        answer: Any = client(speculating).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=TOKENS,
            temperature=0,
            stream=stream,
            stream_options={"include_usage": True} if stream else openai.omit,
            extra_body={"ignore_eos": True},
        )
        if not stream:
            return answer.usage  # type: ignore[no-any-return]
        usage: CompletionUsage | None = list(answer)[-1].usage
        return usage

    usage, drafted, kept = drafted_by_worker(speculating, ask)
    assert drafted > 0 and 0 < kept <= drafted
    assert counts(usage) == (drafted, kept)


def test_n_samples_add_up_and_an_opted_out_request_reports_none(speculating: HttpStack) -> None:
    def ask(n: int, speculate: bool) -> Any:
        return client(speculating).completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=TOKENS,
            temperature=0,
            n=n,
            extra_body={"ignore_eos": True, "speculate": speculate},
        )

    both, drafted, kept = drafted_by_worker(speculating, lambda: ask(2, True))
    assert drafted > 0 and counts(both.usage) == (drafted, kept)
    alone, drafted, _ = drafted_by_worker(speculating, lambda: ask(1, False))
    assert drafted == 0 and counts(alone.usage) == (0, 0)


def test_the_grpc_api_final_usage_carries_the_same_counts(speculating: HttpStack) -> None:
    stub = gateway_pb2_grpc.GatewayStub(speculating.channel(speculating.gateway_address))
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPT,
        model=MODEL,
        sampling=common_pb2.SamplingParams(max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True),
    )
    metadata = [("authorization", f"Bearer {KEY}")]

    def ask() -> gateway_pb2.GenerateResponse:
        try:
            return stub.Generate(request, metadata=metadata, timeout=60)  # type: ignore[no-any-return]
        except grpc.RpcError as exc:
            pytest.fail(f"Generate failed: {exc}")

    final, drafted, kept = drafted_by_worker(speculating, ask)
    assert drafted > 0 and 0 < kept <= drafted
    assert (final.usage.draft_tokens, final.usage.accepted_draft_tokens) == (drafted, kept)
