"""Admission prices what the worker will compute: a prompt whose long system prompt the worker's prefix
cache holds is forecast at its few uncached tokens, so it is admitted under an SLO that refuses the
same-sized prompt uncached, and refused again by a gateway whose route turns the guess off.

Real tokenizer service, worker and gateways in-process (admission_harness.py), the tiny byte-level
model with a 4,096-token context; the engine's test-only step delay (0.1 s) makes a step's cost
dominate, so the forecast counts steps: a 2,500-token prompt is 5 prefill chunks of 512.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import pytest

from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.admission_harness import Stack, metric

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

MODEL = "cached"
WAIT_S = 60.0
STEP_DELAY_S = 0.1
# Forecasts, in steps of about 0.1 s: an uncached 2,500-token prompt about 6 (the step in progress and
# 5 chunks), the same prompt with its 2,500-byte system prompt cached about 2. The route admits up to
# 0.75 x 600 ms = 4.5 steps: both sides are two steps or more from the bound.
TTFT_SLO_MS = 600.0
SYSTEM_ONE = "".join(f"Rule {i}: parcels over {i} kg ship by freight. " for i in range(60))[:2500]
SYSTEM_TWO = "".join(f"Clause {i}: refunds within {i} days of delivery. " for i in range(60))[:2500]


@pytest.fixture(scope="module")
def stack(tiny_long_serving_dir: Path) -> Iterator[Stack]:
    with Stack(tiny_long_serving_dir) as built:
        yield built


def chat(system: str, question: str, new_tokens: int = 2) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[
            common_pb2.ChatMessage(role="system", content=system),
            common_pb2.ChatMessage(role="user", content=question),
        ],
        sampling=common_pb2.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True),
    )


@pytest.mark.slow
def test_a_prompt_whose_system_prompt_is_cached_is_admitted_where_uncached_it_is_refused(
    stack: Stack,
) -> None:
    # Room for the cached system prompt and every request beside it (the harness's 128 blocks hold 2,048).
    worker = stack.start_worker(MODEL, max_requests=4, step_delay_s=STEP_DELAY_S, engine={"num_blocks": 1024})
    route = {"model": MODEL, "workers": [worker.address], "ttft_slo_ms": TTFT_SLO_MS}
    aware = stack.start_gateway(route)
    unaware = stack.start_gateway({**route, "forecast_cached_prompts": False})
    stub = gateway_pb2_grpc.GatewayStub(stack.channel(aware.address))
    blind = gateway_pb2_grpc.GatewayStub(stack.channel(unaware.address))
    for client in (stub, blind):  # each gateway's link learns the step time
        client.Generate(chat("warm-up", "hi"), timeout=WAIT_S)
    # An idle worker takes any request: the first with SYSTEM_ONE is served and cached there.
    first = stub.Generate(chat(SYSTEM_ONE, "Where is my parcel?"), timeout=WAIT_S)
    assert first.usage.cached_input_tokens == 0
    # A long request on each gateway keeps the worker busy in its eyes, so the SLO applies to what follows.
    busy = [
        client.GenerateStream(chat("busy", "keep going", 120), timeout=WAIT_S) for client in (stub, blind)
    ]
    for stream in busy:
        next(stream)

    second = stub.Generate(chat(SYSTEM_ONE, "How heavy may it be?"), timeout=WAIT_S)
    assert second.usage.cached_input_tokens >= 2000, second.usage
    assert second.timing.time_to_first_token_ms <= TTFT_SLO_MS, second.timing

    refused_before = metric("strata_rejections_total", model=MODEL, reason="ttft_slo")
    for client, system in ((stub, SYSTEM_TWO), (blind, SYSTEM_ONE)):
        with pytest.raises(grpc.RpcError) as refused:
            client.Generate(chat(system, "How heavy may it be?"), timeout=WAIT_S)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "forecast time to first token" in (refused.value.details() or "")
    assert metric("strata_rejections_total", model=MODEL, reason="ttft_slo") - refused_before == 2
    for stream in busy:
        stream.cancel()
