"""The worker's step reports on its Connect stream, and the bound its scheduler keeps on a step.

Every message the worker sends carries the step it reports (StepInfo), which the gateway forecasts
time to first token from: the fields must agree with the step spans the worker traces. A long prompt
arriving while 16 requests decode is prefilled in chunks that leave room for every decode in every
step (decodes cost decode_cost_tokens of the token budget), so no step grows past the budget. A real
worker in-process, the tiny model, a real Connect stream.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

import grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.worker.server import start
from strata.tracing import Tracing
from tests.integration.worker_harness import (
    ENGINE,
    WAIT_S,
    async_stub,
    connect,
    running_worker,
    slow_steps,
    submission,
    wait_idle,
    worker_settings,
)

if TYPE_CHECKING:
    from pathlib import Path

    from tests.integration.worker_harness import GatewaySide


def test_every_message_reports_its_step_as_the_step_span_has_it(tiny_serving_dir: Path) -> None:
    spans = InMemorySpanExporter()

    async def main() -> GatewaySide:
        tracing = Tracing.with_exporter("w", spans, 1.0, batch=False)
        server = await start(worker_settings(tiny_serving_dir), tracing=tracing)
        try:
            await asyncio.wait_for(server.wait_ready(), WAIT_S)
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = async_stub(channel)
                side = await connect(stub, tiny_serving_dir)
                await side.send(submission("a", [5, 6, 7] * 10, 6), submission("b", [9, 8], 4))
                await side.read_until(lambda s: len(s.finals) == 2)
                await wait_idle(stub)
                return side
        finally:
            await server.stop(grace=0)

    side = asyncio.run(main())
    steps = {}
    for span in spans.get_finished_spans():
        if span.name == "step" and span.attributes is not None:
            steps[span.attributes["strata.step"]] = span
    reported = [message.step for message in side.messages if message.updates]
    assert reported and all(message.HasField("step") for message in side.messages if message.updates)
    numbers = [step.step for step in reported]
    assert numbers == sorted(set(numbers))  # at most one report per step, in order
    for step in reported:
        span = steps[step.step]
        attributes = span.attributes or {}
        assert span.end_time is not None and span.start_time is not None
        assert math.isclose(step.duration_ms, (span.end_time - span.start_time) / 1e6, abs_tol=0.01)
        assert step.decodes == attributes["strata.decode_tokens"]
        assert step.prefill_tokens == attributes["strata.prefill_tokens"]
        assert (step.running, step.waiting) == (attributes["strata.running"], attributes["strata.waiting"])
        assert step.max_running == ENGINE["max_num_seqs"]
        assert step.prefill_budget == 512 - round(2 * step.running)
    # Both requests decoded together in some step; messages merged while a write was in flight report
    # their newest step, so which steps are reported depends on timing, but decodes are among them.
    assert any((span.attributes or {})["strata.decode_tokens"] == 2 for span in steps.values())
    assert any(step.decodes > 0 for step in reported)


def test_a_long_prompt_is_prefilled_in_chunks_that_leave_every_decode_its_token(
    tiny_long_serving_dir: Path,
) -> None:
    """16 requests decode when a 600-token prompt arrives; budget 128 tokens, decodes at 2 each: every
    step takes at most 96 prompt tokens and decodes all 16, so the prefill takes 7 steps."""
    engine = {
        **ENGINE,
        "num_blocks": 256,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 128,
        "decode_cost_tokens": 2.0,
    }
    decoders = [f"d{i}" for i in range(16)]

    async def main() -> GatewaySide:
        async with running_worker(tiny_long_serving_dir, engine=engine, max_requests=32) as (server, stub):
            slow_steps(server, 0.05)  # the reader keeps up: one message per step
            side = await connect(stub, tiny_long_serving_dir)
            await side.send(*(submission(name, [7, 8, 9, 10], 60) for name in decoders))
            await side.read_until(lambda s: all(name in s.tokens for name in decoders))
            side.messages.clear()
            await side.send(submission("long", [11 + i % 200 for i in range(600)], 2))
            await side.read_until(lambda s: "long" in s.tokens)
            slow_steps(server, 0.0)
            await side.read_until(lambda s: len(s.finals) == 17)
            await wait_idle(stub)
            return side

    side = asyncio.run(main())
    prefilling = []
    for message in side.messages:
        step = message.step
        if step.prefill_tokens:
            prefilling.append(step)
            assert step.decodes == 16, step
            assert step.prefill_tokens <= 96 and step.prefill_tokens + 2 * step.decodes <= 128, step
            assert {u.request_id for u in message.updates} >= set(decoders)  # each decoded in it
        if "long" in {u.request_id for u in message.updates}:
            break
    assert sum(step.prefill_tokens for step in prefilling) == 600
    assert len(prefilling) == 7
    assert side.tokens["long"] and len(side.finals) == 17
