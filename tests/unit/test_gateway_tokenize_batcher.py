"""The tokenize micro-batcher against the real tokenizer service: shared calls, per-entry results, errors."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import pytest

from gateway.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable
from gateway.settings import GatewaySettings
from gateway.tokenize_batcher import TokenizeBatcher
from gateway.tokenizer_client import TokenizerClient
from services.tokenizer.server import start as start_tokenizer
from services.tokenizer.settings import TokenizerSettings
from strata.v1 import gateway_pb2, tokenizer_pb2

if TYPE_CHECKING:
    from pathlib import Path


class CountingClient(TokenizerClient):
    """The real client, recording the size and timeout of every Tokenize call it makes."""

    calls: list[int]
    timeouts: list[float | None]

    async def tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, timeout: float | None = None
    ) -> tokenizer_pb2.TokenizeResponse:
        self.calls.append(len(request.entries))
        self.timeouts.append(timeout)
        return await super().tokenize(request, timeout)


def _settings(address: str) -> GatewaySettings:
    return GatewaySettings.build(
        {"tokenizer_address": address, "routes": [{"model": "tiny", "workers": ["127.0.0.1:1"]}]}
    )


def _entry(
    prompt: str, model: str = "tiny", limit: int = 200, **fields: object
) -> tokenizer_pb2.TokenizeEntry:
    return tokenizer_pb2.TokenizeEntry(model=model, prompt=prompt, max_input_tokens=limit, **fields)  # type: ignore[arg-type]


async def _with_tokenizer(model_dir: Path, window_ms: float, max_batch: int) -> dict[str, Any]:
    server = await start_tokenizer(
        TokenizerSettings.build({"listen": "127.0.0.1:0", "models": {"tiny": model_dir}})
    )
    client = CountingClient(_settings(server.address), lambda: None)
    client.calls = []
    client.timeouts = []
    batcher = TokenizeBatcher(client, window_ms, max_batch)
    try:
        prompts = [f"Hello world number {i}" for i in range(10)]
        alone = [list((await batcher.tokenize(_entry(p))).token_ids) for p in prompts]
        client.calls.clear()
        together = await asyncio.gather(*(batcher.tokenize(_entry(p)) for p in prompts))
        calls_together = list(client.calls)
        client.calls.clear()
        mixed = await asyncio.gather(
            batcher.tokenize(_entry("fine")),
            batcher.tokenize(_entry("x", model="nope")),
            batcher.tokenize(_entry("word " * 50, limit=5)),
            batcher.tokenize(_entry("word " * 50, limit=5, truncation=gateway_pb2.TRUNCATION_LEFT)),
            return_exceptions=True,
        )
        calls_mixed = list(client.calls)
    finally:
        await batcher.close()
        await client.close()
        await server.stop(0)
    await client_after_stop(server.address)
    return {
        "alone": alone,
        "together": [list(r.token_ids) for r in together],
        "calls_together": calls_together,
        "mixed": mixed,
        "calls_mixed": calls_mixed,
    }


async def client_after_stop(address: str) -> None:
    """With the service gone, every caller gets UNAVAILABLE rather than hanging."""
    client = TokenizerClient(_settings(address), lambda: None)
    batcher = TokenizeBatcher(client, 1.0, 8)
    try:
        results = await asyncio.gather(
            *(batcher.tokenize(_entry("a")) for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(r, Unavailable) for r in results), results
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("window_ms", "max_batch", "expected_calls"), [(50.0, 64, [1, 9]), (50.0, 4, [1, 4, 4, 1])]
)
def test_arrivals_share_calls_and_get_their_own_results(
    tiny_serving_dir: Path, window_ms: float, max_batch: int, expected_calls: list[int]
) -> None:
    out = asyncio.run(_with_tokenizer(tiny_serving_dir, window_ms, max_batch))
    assert out["together"] == out["alone"]
    assert all(out["alone"]) and len({tuple(ids) for ids in out["alone"]}) == 10
    assert out["calls_together"] == expected_calls
    fine, unknown, too_long, truncated = out["mixed"]
    # An arrival at an idle batcher goes at once (no added latency); the rest share the next call.
    assert out["calls_mixed"] == [1, 3]
    assert isinstance(fine, tokenizer_pb2.TokenizeResult) and len(fine.token_ids) > 0
    assert isinstance(unknown, NotFound) and "nope" in unknown.message
    assert isinstance(too_long, InvalidArgument) and "5" in too_long.message
    assert isinstance(truncated, tokenizer_pb2.TokenizeResult)
    assert len(truncated.token_ids) == 5 and truncated.truncated_tokens > 0


def test_the_callers_deadline_bounds_the_tokenize_call(tiny_serving_dir: Path) -> None:
    async def main() -> tuple[list[int], list[float | None], list[BaseException | object]]:
        server = await start_tokenizer(
            TokenizerSettings.build({"listen": "127.0.0.1:0", "models": {"tiny": tiny_serving_dir}})
        )
        client = CountingClient(_settings(server.address), lambda: None)
        client.calls, client.timeouts = [], []
        batcher = TokenizeBatcher(client, 20.0, 64)
        try:
            now = time.monotonic()
            await batcher.tokenize(_entry("no deadline"))
            await batcher.tokenize(_entry("a deadline"), deadline=now + 5.0)
            # The opener goes alone; the two behind it share a call that waits as long as the more
            # patient one may.
            await asyncio.gather(
                batcher.tokenize(_entry("opener")),
                batcher.tokenize(_entry("soon"), deadline=now + 3.0),
                batcher.tokenize(_entry("later"), deadline=now + 4.0),
            )
            expired = await asyncio.gather(
                batcher.tokenize(_entry("too late"), deadline=time.monotonic() - 1.0), return_exceptions=True
            )
            return list(client.calls), list(client.timeouts), list(expired)
        finally:
            await batcher.close()
            await client.close()
            await server.stop(0)

    calls, timeouts, expired = asyncio.run(main())
    assert calls == [1, 1, 1, 2]  # the expired entry never reaches the tokenizer
    assert timeouts[0] is None and timeouts[2] is None
    assert timeouts[1] is not None and 3.0 < timeouts[1] <= 5.0
    assert timeouts[3] is not None and 3.0 < timeouts[3] <= 4.0
    (error,) = expired
    assert isinstance(error, DeadlineExceeded), error
