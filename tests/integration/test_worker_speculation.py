"""A speculating worker over real gRPC, driven the way a gateway drives it: its tokens, the opt-out,
and the drafts it counts in GetWorkerStats, the metrics and each request's updates.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tests.engine_runs import pin_draft_cost
from tests.integration.worker_harness import (
    GatewaySide,
    connect,
    expected_tokens,
    running_worker,
    submission,
    wait_idle,
)

if TYPE_CHECKING:
    from pathlib import Path

    from strata.v1 import worker_pb2


def test_speculating_worker_gives_the_same_tokens_and_counts_its_drafts(tiny_serving_dir: Path) -> None:
    """With engine.speculative on, a request gets the greedy tokens of a worker without it; one that
    opts out (sampling.no_speculation) drafts nothing; GetWorkerStats and the metrics count the drafts
    scored and kept, and so do the request's own updates (TokenUpdate.draft_tokens, per step)."""
    from prometheus_client import REGISTRY

    prompt = [40, 41, 42, 43, 44, 45, 46, 47] * 4
    expected = expected_tokens(tiny_serving_dir, prompt, 40)
    engine = {"num_blocks": 64, "max_num_seqs": 8, "speculative": {"method": "ngram"}}

    def accepted_metric() -> float:
        labels = {"model": "tiny", "verdict": "accepted"}
        return REGISTRY.get_sample_value("strata_spec_draft_tokens_total", labels) or 0.0

    async def main() -> tuple[
        GatewaySide, worker_pb2.GetWorkerStatsResponse, worker_pb2.GetWorkerStatsResponse
    ]:
        async with running_worker(tiny_serving_dir, engine=engine) as (server, stub):
            # Before any step: whether the rule drafts must not hang on how busy the machine is.
            pin_draft_cost(server.host.engine.engine)
            side = await connect(stub, tiny_serving_dir)
            await side.send(submission("plain", prompt, 40, sampling={"no_speculation": True}))
            await side.read_until(lambda s: "plain" in s.finals)
            opted_out = await wait_idle(stub)
            await side.send(submission("fast", prompt, 40))
            await side.read_until(lambda s: "fast" in s.finals)
            return side, opted_out, await wait_idle(stub)

    before = accepted_metric()
    side, opted_out, after = asyncio.run(main())
    assert side.tokens == {"plain": expected, "fast": expected}
    assert opted_out.draft_tokens == 0
    assert 0 < after.accepted_draft_tokens <= after.draft_tokens
    assert after.speculative_decodes > 0
    assert accepted_metric() - before == after.accepted_draft_tokens

    def summed(request_id: str, field: str) -> int:
        return sum(
            getattr(update, field)
            for message in side.messages
            for update in message.updates
            if update.request_id == request_id
        )

    assert (summed("plain", "draft_tokens"), summed("plain", "accepted_draft_tokens")) == (0, 0)
    assert summed("fast", "draft_tokens") == after.draft_tokens
    assert summed("fast", "accepted_draft_tokens") == after.accepted_draft_tokens
