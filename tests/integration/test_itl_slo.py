"""A route's inter-token SLO reaches its worker, and the worker sizes its steps by it.

The worker side runs the real default model (SmolLM2-135M) in-process, because the caps are steered
by what the steps measure, and only a real model makes a step with prefill slower than one without:
while 8 streams with an SLO decode, long prompts arriving one after another are prefilled in ever
smaller chunks once a chunk's step runs past the SLO's plan, where without an SLO each goes in the
token budget's two. The gateway side runs the tiny model: a route's itl_slo_ms is what the worker's
sequences carry, and a route without one leaves them none.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import TYPE_CHECKING, Any

import pytest

from services.worker.engine.step_limits import ITL_HEADROOM
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.admission_harness import Stack
from tests.integration.worker_harness import connect, running_worker, slow_steps, submission, wait_idle

if TYPE_CHECKING:
    from pathlib import Path

ENGINE = {
    "num_blocks": 512,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "decode_cost_tokens": 2.0,
    "enable_fault_injection": True,
}
DECODERS = [f"d{i}" for i in range(8)]
LONG_PROMPT = 600
LONG_PROMPTS = 3
WAIT_S = 120.0


def prompt(length: int, salt: int) -> list[int]:
    return [100 + (salt * 7919 + i * 31) % 20000 for i in range(length)]


def last_prompts_chunks(model_dir: Path, *, with_slo: bool) -> list[int]:
    """The prefill steps of the last of LONG_PROMPTS long prompts, sent one after another's first token
    while 8 streams decode; with_slo: every request promises 3 decode-only steps of the 8 (measured
    first) over ITL_HEADROOM, so a step with a big chunk of prefill runs past the plan."""

    async def main() -> list[int]:
        async with running_worker(model_dir, engine=ENGINE, max_requests=16) as (server, stub):
            slow_steps(server, 0.02)  # the reader keeps up: one message per step
            side = await connect(stub, model_dir)
            await side.send(*(submission(f"warm-{n}", prompt(8, i), 20) for i, n in enumerate(DECODERS)))
            await side.read_until(lambda s: all(f"warm-{n}" in s.finals for n in DECODERS), WAIT_S)
            decode_only = [
                m.step.duration_ms for m in side.messages if m.step.decodes == 8 and not m.step.prefill_tokens
            ]
            slo_ms = 3 * statistics.median(decode_only) / ITL_HEADROOM if with_slo else 0.0
            extra: dict[str, Any] = {"itl_slo_ms": slo_ms, "sampling": {"ignore_eos": True}}
            await side.send(*(submission(n, prompt(8, i), 300, **extra) for i, n in enumerate(DECODERS)))
            await side.read_until(lambda s: all(n in s.tokens for n in DECODERS), WAIT_S)
            for k in range(LONG_PROMPTS):
                side.messages.clear()
                await side.send(submission(f"long{k}", prompt(LONG_PROMPT, k), 2, **extra))
                await side.read_until(lambda s, name=f"long{k}": name in s.tokens, WAIT_S)
                assert not any(side.finals.get(n) for n in DECODERS), (
                    "a decoder ended before the long prompts"
                )
            chunks = [m.step.prefill_tokens for m in side.messages if m.step.prefill_tokens]
            await side.send(cancel=tuple(DECODERS))
            await wait_idle(stub)
        return chunks

    return asyncio.run(main())


@pytest.mark.slow
@pytest.mark.real_model
def test_long_prompts_go_in_smaller_chunks_beside_streams_with_an_itl_slo(real_model_dir: Path) -> None:
    """Without an SLO each 600-token prompt takes two steps (496 tokens beside 8 decodes, then the
    rest); with one, the steps of the first prompts' big chunks run past the plan and halve the
    prefill cap, so the last prompt goes in several chunks, none near the token budget's."""
    plain = last_prompts_chunks(real_model_dir, with_slo=False)
    assert plain == [512 - 2 * len(DECODERS), LONG_PROMPT - 496], plain
    capped = last_prompts_chunks(real_model_dir, with_slo=True)
    assert sum(capped) == LONG_PROMPT, capped
    assert len(capped) >= 3 and max(capped) <= 256, capped


def test_a_routes_itl_slo_is_what_its_requests_carry_on_the_worker(tiny_long_serving_dir: Path) -> None:
    """Two gateways on one worker, one route promising 150 ms between tokens: the worker's sequence
    of a request through it carries 0.15 s, one through the other route carries none."""
    with Stack(tiny_long_serving_dir) as stack:
        worker = stack.start_worker("cached", max_requests=4, step_delay_s=0.05)
        route = {"model": "cached", "workers": [worker.address]}
        promising = stack.start_gateway({**route, "itl_slo_ms": 150.0})
        plain = stack.start_gateway(route)
        scheduler = worker.host.engine.engine.scheduler
        carried = []
        for gateway in (promising, plain):
            stub = gateway_pb2_grpc.GatewayStub(stack.channel(gateway.address))
            sampling = common_pb2.SamplingParams(max_new_tokens=30, ignore_eos=True)
            stream = stub.GenerateStream(
                gateway_pb2.GenerateRequest(model="cached", prompt="tell me more", sampling=sampling),
                timeout=WAIT_S,
            )
            next(stream)  # its first token came: its sequence runs on the worker now
            (running,) = scheduler.running
            carried.append(running.itl_slo_s)
            stream.cancel()
            stack.worker_stats(worker)
            while scheduler.has_work:  # the cancel reaches the engine within a step
                stack.worker_stats(worker)
    assert carried == [0.15, None]
