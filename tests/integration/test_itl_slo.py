"""A route's inter-token SLO reaches its worker, and the worker sizes its steps by it.

The worker side runs the real default model (SmolLM2-135M) in-process, because the caps come from the
engine's fit of its own steps' cadence, and only a real model makes a prefill token cost something
to fit: a long prompt arriving while 8 streams with an SLO decode is prefilled in chunks that keep each
step within the SLO's headroom, where without one it goes in the token budget's two. The gateway side
runs the tiny model: a route's itl_slo_ms is what the worker's sequences carry, and a route without
one leaves them none.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from services.worker.engine.step_limits import ITL_HEADROOM
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.admission_harness import Stack
from tests.integration.worker_harness import connect, running_worker, submission, wait_idle

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.server import WorkerServer
    from tests.integration.worker_harness import GatewaySide

ENGINE = {"num_blocks": 512, "max_num_seqs": 16, "max_num_batched_tokens": 512, "decode_cost_tokens": 2.0}
DECODERS = [f"d{i}" for i in range(8)]
LONG_PROMPT = 600
WAIT_S = 120.0


def prompt(length: int, salt: int) -> list[int]:
    return [100 + (salt * 7919 + i * 31) % 20000 for i in range(length)]


async def fit_the_cadence(server: WorkerServer, side: GatewaySide) -> tuple[float, float, float]:
    """Steps of mixed sizes, without an SLO, until the engine's step-time line is fitted."""
    engine = server.host.engine.engine
    for round_index in range(6):
        batch = [submission(f"fit{round_index}-{n}", prompt(n, round_index), 12) for n in (24, 90, 250, 400)]
        await side.send(*batch)
        await side.read_until(lambda s, b=batch: all(x.request_id in s.finals for x in b), WAIT_S)
        if engine.step_cost.coefficients is not None:
            return engine.step_cost.coefficients
    raise AssertionError("the engine's step-time line was not fitted after 24 requests of mixed sizes")


def prefill_chunks(model_dir: Path, itl_slo_ms: float | None) -> tuple[list[int], list[int]]:
    """(the long prompt's prefill steps, the prefill budgets reported beside them) while 8 streams
    decode; with itl_slo_ms None the SLO is chosen from the fit so that about 128 prompt tokens fit
    beside 8 decodes."""

    async def main() -> tuple[list[int], list[int]]:
        async with running_worker(model_dir, engine=ENGINE, max_requests=16) as (server, stub):
            side = await connect(stub, model_dir)
            fixed, per_decode, per_token = await fit_the_cadence(server, side)
            slo_ms = 0.0
            if itl_slo_ms is None:
                slo_ms = 1000.0 * (fixed + per_decode * len(DECODERS) + per_token * 128) / ITL_HEADROOM
            extra = {"itl_slo_ms": slo_ms}
            await side.send(*(submission(n, prompt(8, i), 40, **extra) for i, n in enumerate(DECODERS)))
            await side.read_until(lambda s: all(n in s.tokens for n in DECODERS), WAIT_S)
            side.messages.clear()
            await side.send(submission("long", prompt(LONG_PROMPT, 99), 2, **extra))
            await side.read_until(lambda s: "long" in s.tokens, WAIT_S)
            steps = [m.step for m in side.messages if m.HasField("step")]
            await side.read_until(lambda s: all(n in s.finals for n in [*DECODERS, "long"]), WAIT_S)
            await wait_idle(stub)
        chunks = [step.prefill_tokens for step in steps if step.prefill_tokens]
        return chunks, [step.prefill_budget for step in steps if step.decodes]

    return asyncio.run(main())


@pytest.mark.slow
@pytest.mark.real_model
def test_a_long_prompt_goes_in_smaller_chunks_beside_streams_with_an_itl_slo(real_model_dir: Path) -> None:
    """Without an SLO the 600-token prompt takes two steps (496 tokens beside 8 decodes, then the
    rest); with one fitted to about 128 tokens beside 8 decodes, every chunk and every reported budget
    stays well under the token budget's, and the prefill takes several more steps."""
    plain, plain_budgets = prefill_chunks(real_model_dir, itl_slo_ms=0.0)
    assert sum(plain) == LONG_PROMPT and len(plain) == 2, plain
    # The budget reported after a step counts its running sequences: the 8 and the long one.
    assert plain_budgets and min(plain_budgets) >= 512 - 2 * (len(DECODERS) + 1), plain_budgets
    capped, budgets = prefill_chunks(real_model_dir, itl_slo_ms=None)
    assert sum(capped) == LONG_PROMPT, capped
    assert len(capped) >= 3 and max(capped) < 494, capped
    assert budgets and max(budgets) < 494, budgets


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
