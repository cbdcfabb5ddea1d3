"""The worker's Connect stream over real gRPC, driven the way a gateway drives it.

An in-process worker on an ephemeral port serves a tiny random Llama; greedy tokens are compared with
an in-process LLMEngine built from the same folder and config, and freed KV blocks are read back
through GetWorkerStats.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc
import pytest

from strata.fingerprint import tokenizer_fingerprint
from strata.v1 import common_pb2, worker_pb2
from tests.integration.worker_harness import (
    DEADLINE_EXCEEDED,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    GatewaySide,
    async_stub,
    connect,
    expected_tokens,
    running_worker,
    slow_steps,
    submission,
    wait_idle,
)

if TYPE_CHECKING:
    from pathlib import Path


def test_a_gateway_with_another_model_or_tokenizer_is_refused(tiny_serving_dir: Path) -> None:
    async def main() -> None:
        async with running_worker(tiny_serving_dir) as (_, stub):
            mine = tokenizer_fingerprint(tiny_serving_dir)
            with pytest.raises(grpc.aio.AioRpcError) as wrong_fingerprint:
                await GatewaySide(stub).hello("tiny", "ab" * 32)
            details = wrong_fingerprint.value.details() or ""
            assert wrong_fingerprint.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "ab" * 32 in details and mine in details and "same model folder" in details
            with pytest.raises(grpc.aio.AioRpcError) as wrong_model:
                await GatewaySide(stub).hello("other-model", mine)
            assert wrong_model.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "'other-model'" in (wrong_model.value.details() or "")
            assert "'tiny'" in (wrong_model.value.details() or "")
            side = GatewaySide(stub)
            await side.call.write(worker_pb2.ConnectRequest(submissions=[submission("r", [1, 2], 3)]))
            with pytest.raises(grpc.aio.AioRpcError) as no_hello:
                await side.call.read()
            assert no_hello.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(main())


def test_requests_on_one_stream_get_exactly_their_greedy_tokens(tiny_serving_dir: Path) -> None:
    prompts = {"a": [5, 6, 7], "b": [40, 41, 42, 43, 44, 45] * 6, "c": [300], "d": [9, 200, 31, 7] * 3}
    lengths = {"a": 12, "b": 20, "c": 5, "d": 30}
    expected = {rid: expected_tokens(tiny_serving_dir, p, lengths[rid]) for rid, p in prompts.items()}

    async def main() -> GatewaySide:
        async with running_worker(tiny_serving_dir) as (_, stub):
            side = await connect(stub, tiny_serving_dir)
            assert side.credits == [16]
            await side.send(
                submission("a", prompts["a"], lengths["a"]), submission("b", prompts["b"], lengths["b"])
            )
            await side.send(
                submission("c", prompts["c"], lengths["c"]), submission("d", prompts["d"], lengths["d"])
            )
            await side.read_until(lambda s: len(s.finals) == 4)
            await wait_idle(stub)
            return side

    side = asyncio.run(main())
    assert side.tokens == expected
    assert not side.rejections
    for rid, final in side.finals.items():
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (final.prompt_tokens, final.output_tokens) == (len(prompts[rid]), lengths[rid])
        assert final.forward_ms > 0
        assert side.firsts[rid].queue_ms > 0
    assert side.credits[-1] == 16  # every credit came back


def test_prior_output_ids_continue_a_request_without_resending_them(tiny_serving_dir: Path) -> None:
    prompt, total = [11, 12, 13, 14, 15], 24
    whole = expected_tokens(tiny_serving_dir, prompt, total)
    prior = whole[:9]
    continuation = expected_tokens(tiny_serving_dir, prompt + prior, total - len(prior))

    async def main() -> GatewaySide:
        async with running_worker(tiny_serving_dir) as (_, stub):
            side = await connect(stub, tiny_serving_dir)
            await side.send(
                submission("cont", prompt, total, prior_output_ids=prior),
                submission("done", prompt, len(prior), prior_output_ids=prior),
            )
            await side.read_until(lambda s: "cont" in s.finals and "done" in s.rejections)
            await wait_idle(stub)
            return side

    side = asyncio.run(main())
    assert side.tokens["cont"] == continuation
    assert len(continuation) == total - len(prior)
    final = side.finals["cont"]
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (final.prompt_tokens, final.output_tokens) == (len(prompt), total)
    assert side.firsts["cont"].output_tokens == len(prior) + len(side.firsts["cont"].token_ids)
    rejection = side.rejections["done"]
    assert rejection.code == INVALID_ARGUMENT and "prior_output_ids" in rejection.message


def test_a_full_worker_rejects_with_resource_exhausted_while_others_run(tiny_serving_dir: Path) -> None:
    async def main() -> GatewaySide:
        async with running_worker(tiny_serving_dir, max_requests=2) as (server, stub):
            slow_steps(server, 0.01)
            side = await connect(stub, tiny_serving_dir)
            await side.send(*(submission(f"r{i}", [3 + i, 4, 5], 15) for i in range(3)))
            await side.read_until(lambda s: "r2" in s.rejections)
            assert side.credits[-1] == 0
            await side.read_until(lambda s: {"r0", "r1"} <= s.finals.keys())
            await side.send(submission("r2", [5, 4, 5], 4))  # room again
            await side.read_until(lambda s: "r2" in s.finals)
            return side

    side = asyncio.run(main())
    rejection = side.rejections["r2"]
    assert rejection.code == RESOURCE_EXHAUSTED and "limit of 2" in rejection.message
    assert [len(side.tokens[f"r{i}"]) for i in range(3)] == [15, 15, 4]
    assert side.credits[-1] == 2


def test_invalid_submissions_are_rejected_and_the_stream_keeps_serving(tiny_serving_dir: Path) -> None:
    async def main() -> GatewaySide:
        async with running_worker(tiny_serving_dir) as (server, stub):
            slow_steps(server, 0.01)
            side = await connect(stub, tiny_serving_dir)
            await side.send(
                submission("top_p", [1, 2], 4, sampling={"top_p": 2.0}),
                submission("zero", [1, 2], 0),
                submission("vocab", [1, 384], 4),
                submission("long", [7] * 250, 10),
                submission("", [1, 2], 4),
                submission("dup", [1, 2], 30),
                submission("dup", [1, 2], 4),
                submission("slo", [1, 2], 4, itl_slo_ms=-5.0),
            )
            await side.read_until(lambda s: len(s.rejections) == 7)
            await side.send(submission("ok", [1, 2, 3], 6))
            await side.read_until(lambda s: {"ok", "dup"} <= s.finals.keys())
            return side

    side = asyncio.run(main())
    assert {rid: r.code for rid, r in side.rejections.items()} == dict.fromkeys(
        ["top_p", "zero", "vocab", "long", "", "dup", "slo"], INVALID_ARGUMENT
    )
    assert "itl_slo_ms" in side.rejections["slo"].message
    assert "top_p" in side.rejections["top_p"].message
    assert "max_new_tokens" in side.rejections["zero"].message
    assert "prompt_ids" in side.rejections["vocab"].message
    assert "256" in side.rejections["long"].message
    assert "already" in side.rejections["dup"].message or "still open" in side.rejections["dup"].message
    # The first "dup" kept running; the rejected duplicate did not disturb it.
    assert len(side.tokens["dup"]) == 30 and len(side.tokens["ok"]) == 6


def test_deadlines_reject_late_arrivals_and_cancel_running_requests(tiny_serving_dir: Path) -> None:
    async def main() -> tuple[GatewaySide, float]:
        async with running_worker(tiny_serving_dir) as (server, stub):
            slow_steps(server, 0.02)
            side = await connect(stub, tiny_serving_dir)
            now_ms = int(time.time() * 1000)
            await side.send(
                submission("late", [1, 2], 4, deadline_unix_ms=now_ms - 1000),
                submission("timed", [1, 2, 3], 200, deadline_unix_ms=now_ms + 400),
                submission("free", [4, 5], 8, deadline_unix_ms=now_ms + 600_000),
            )
            await side.read_until(lambda s: {"timed", "free"} <= s.finals.keys() and "late" in s.rejections)
            ended_at = time.time() * 1000 - now_ms
            await wait_idle(stub)
            return side, ended_at

    side, ended_at = asyncio.run(main())
    assert side.rejections["late"].code == DEADLINE_EXCEEDED
    timed = side.finals["timed"]
    assert timed.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert 0 < timed.output_tokens < 200 and len(side.tokens["timed"]) == timed.output_tokens
    assert ended_at >= 400
    assert side.finals["free"].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_cancellations_end_requests_and_free_their_blocks(tiny_serving_dir: Path) -> None:
    async def main() -> GatewaySide:
        async with running_worker(tiny_serving_dir) as (server, stub):
            slow_steps(server, 0.02)
            side = await connect(stub, tiny_serving_dir)
            await side.send(submission("long", [8] * 40, 200), submission("short", [2, 3], 5))
            await side.read_until(lambda s: len(s.tokens.get("long", [])) >= 2)
            await side.send(cancel=("long", "unknown"))
            await side.read_until(lambda s: {"long", "short"} <= s.finals.keys())
            await wait_idle(stub)
            return side

    side = asyncio.run(main())
    long = side.finals["long"]
    assert long.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert (long.prompt_tokens, long.output_tokens) == (40, len(side.tokens["long"]))
    assert long.output_tokens < 200
    assert len(side.tokens["short"]) == 5


@pytest.mark.parametrize("how", ["cancel", "close_channel", "half_close"])
def test_a_broken_or_closed_stream_aborts_its_requests(tiny_serving_dir: Path, how: str) -> None:
    async def main() -> None:
        async with running_worker(tiny_serving_dir) as (server, stub):
            slow_steps(server, 0.02)
            channel = grpc.aio.insecure_channel(server.address)
            side = await connect(async_stub(channel), tiny_serving_dir)
            await side.send(submission("long", [8] * 30, 200), submission("other", [9] * 30, 200))
            await side.read_until(lambda s: len(s.tokens.get("long", [])) >= 2)
            stats = await stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest())
            assert stats.used_kv_blocks > 0 and stats.open_requests == 2
            if how == "cancel":
                side.call.cancel()
            elif how == "close_channel":
                await channel.close()
            else:
                await side.call.done_writing()
                await side.read_until(lambda s: s.ended)
                assert await side.call.code() == grpc.StatusCode.OK
            await wait_idle(stub)
            await channel.close()

    asyncio.run(main())


def test_two_streams_share_credits_and_may_use_the_same_ids(tiny_serving_dir: Path) -> None:
    prompt_a, prompt_b = [11, 12, 13], [200, 100, 50, 25]
    want_a = expected_tokens(tiny_serving_dir, prompt_a, 40)
    want_b = expected_tokens(tiny_serving_dir, prompt_b, 40)

    async def main() -> tuple[GatewaySide, GatewaySide]:
        async with running_worker(tiny_serving_dir, max_requests=2) as (server, stub):
            slow_steps(server, 0.01)
            a = await connect(stub, tiny_serving_dir)
            b = await connect(stub, tiny_serving_dir)
            await a.send(submission("r", prompt_a, 40))
            await a.read_until(lambda s: "r" in s.tokens)
            await b.send(submission("r", prompt_b, 40))
            await b.read_until(lambda s: "r" in s.tokens)
            await b.send(submission("s", [1, 2], 4))
            await b.read_until(lambda s: "s" in s.rejections)
            # When A's request ends, B hears of the freed credit without producing anything itself.
            await a.read_until(lambda s: "r" in s.finals)
            await b.read_until(lambda s: s.credits[-1] >= 1)
            await b.send(submission("s", [1, 2], 4))
            await b.read_until(lambda s: {"r", "s"} <= s.finals.keys())
            await wait_idle(stub)
            return a, b

    a, b = asyncio.run(main())
    assert a.tokens["r"] == want_a and b.tokens["r"] == want_b
    assert b.rejections["s"].code == RESOURCE_EXHAUSTED
    assert len(b.tokens["s"]) == 4


def test_a_cancellation_frees_its_credit_for_a_submission_in_the_same_message(tiny_serving_dir: Path) -> None:
    """The gateway counts a cancelled request's credit free at once, so its writer may merge the next
    submission into the cancellation's message; a request submitted and cancelled together ends."""

    async def main() -> GatewaySide:
        async with running_worker(tiny_serving_dir, max_requests=1) as (server, stub):
            slow_steps(server, 0.02)
            side = await connect(stub, tiny_serving_dir)
            await side.send(submission("old", [8] * 10, 200))
            await side.read_until(lambda s: "old" in s.tokens)
            await side.send(submission("new", [2, 3], 4), cancel=("old",))
            await side.read_until(lambda s: {"old", "new"} <= s.finals.keys() or bool(s.rejections))
            await side.send(submission("gone", [2, 3], 4), cancel=("gone",))
            await side.read_until(lambda s: "gone" in s.finals or "gone" in s.rejections)
            return side

    side = asyncio.run(main())
    assert not side.rejections, side.rejections
    assert side.finals["old"].finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert len(side.tokens["new"]) == 4
    assert side.finals["gone"].finish_reason == common_pb2.FINISH_REASON_CANCELLED


def test_stats_follow_the_engine_and_open_requests(tiny_serving_dir: Path) -> None:
    async def main() -> None:
        async with running_worker(tiny_serving_dir) as (server, stub):
            before = await stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest())
            assert (before.total_kv_blocks, before.free_kv_tokens, before.open_requests) == (64, 1024, 0)
            slow_steps(server, 0.02)
            side = await connect(stub, tiny_serving_dir)
            await side.send(submission("x", [5] * 20, 100), submission("y", [6] * 20, 100))
            await side.read_until(lambda s: {"x", "y"} <= s.tokens.keys())
            busy = await stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest())
            assert busy.running + busy.waiting == 2 and busy.open_requests == 2
            assert busy.used_kv_blocks >= 4 and busy.free_kv_tokens == (64 - busy.used_kv_blocks) * 16
            assert busy.steps > before.steps
            await side.send(cancel=("x", "y"))
            after = await wait_idle(stub)
            assert after.free_kv_tokens == 1024 and after.steps >= busy.steps

    asyncio.run(main())


def test_too_many_submissions_in_one_message_end_the_stream(tiny_serving_dir: Path) -> None:
    async def main() -> None:
        async with running_worker(tiny_serving_dir, max_submissions_per_message=2) as (server, stub):
            slow_steps(server, 0.02)
            side = await connect(stub, tiny_serving_dir)
            await side.send(submission("first", [4] * 10, 200))
            await side.read_until(lambda s: "first" in s.tokens)
            await side.send(*(submission(f"r{i}", [1, 2], 4) for i in range(3)))
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await side.read_until(lambda s: s.ended)
            assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_submissions_per_message" in (ended.value.details() or "")
            await wait_idle(stub)  # the stream's open request was aborted with it

    asyncio.run(main())


def test_a_warm_prefix_cache_counts_as_free_and_reports_cached_tokens(tiny_serving_dir: Path) -> None:
    """After requests that share a 48-token prefix end, their cached blocks stay evictable and the
    worker still offers its whole cache (stats' free_kv_tokens and the stream's credits): a warm cache
    must not make a worker look full. The second request of a tenant is served the prefix (its
    updates say 48 cached prompt tokens, in 3 blocks of 16) and gets the same tokens as alone; the
    same prompt from another tenant (cache_salt) is served nothing."""
    prefix = [7, 8, 9, 10] * 12
    first, second = [*prefix, 50, 51], [*prefix, 60, 61, 62]
    expected = expected_tokens(tiny_serving_dir, second, 6)

    async def main() -> tuple[GatewaySide, worker_pb2.GetWorkerStatsResponse]:
        async with running_worker(tiny_serving_dir) as (_, stub):
            side = await connect(stub, tiny_serving_dir)
            await side.send(submission("warm", first, 4, cache_salt="acme"))
            await side.read_until(lambda s: "warm" in s.finals)
            await side.send(submission("hit", second, 6, cache_salt="acme"))
            await side.read_until(lambda s: "hit" in s.finals)
            await side.send(submission("other", second, 6, cache_salt="globex"))
            await side.read_until(lambda s: "other" in s.finals)
            return side, await wait_idle(stub)

    side, idle = asyncio.run(main())
    assert side.finals["warm"].cached_prompt_tokens == 0
    assert side.finals["hit"].cached_prompt_tokens == 48
    assert side.finals["other"].cached_prompt_tokens == 0
    assert side.tokens["hit"] == side.tokens["other"] == expected
    assert idle.evictable_kv_blocks == idle.cached_kv_blocks > 0
    assert idle.used_kv_blocks == 0
    assert idle.free_kv_tokens == idle.total_kv_blocks * 16
    assert idle.prefix_cache_hit_blocks == 3
    assert side.messages[-1].credits.kv_tokens == idle.total_kv_blocks * 16
