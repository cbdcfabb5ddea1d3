"""The asyncio facade: streaming, aborts that free blocks, stats, errors, and a loop that stays responsive."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import TYPE_CHECKING

import pytest

from services.worker.engine.async_engine import AsyncEngine, EngineDeadError, StepReport
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.sequence import FinishReason
from services.worker.model.loader import ModelLoadError
from strata.sampling import InvalidRequestError, SamplingParams
from tests.polling import wait_for_async

if TYPE_CHECKING:
    from pathlib import Path


def _engine(model_dir: Path, **overrides: object) -> AsyncEngine:
    settings: dict[str, object] = {"num_blocks": 128, "block_size": 8, **overrides}
    config = EngineConfig.model_validate(settings)
    return AsyncEngine(lambda: LLMEngine.from_model_dir(model_dir, config))


async def _collect(stream: object) -> tuple[list[int], FinishReason | None]:
    tokens: list[int] = []
    reason = None
    async for out in stream:  # type: ignore[attr-defined]
        tokens.extend(out.new_token_ids)
        reason = out.finish_reason
    return tokens, reason


def test_concurrent_streams_match_the_synchronous_engine(tiny_llama_dir: Path) -> None:
    prompts = [[5 + i, 17, 200 - i, 9] * (i + 1) for i in range(12)]
    params = SamplingParams(max_new_tokens=10)
    expected = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=128, block_size=8)).generate(
        prompts, params
    )

    async def main() -> list[tuple[list[int], FinishReason | None]]:
        engine = _engine(tiny_llama_dir)
        await engine.start()
        try:
            streams = [engine.submit(f"r{i}", p, params) for i, p in enumerate(prompts)]
            return await asyncio.gather(*(_collect(s) for s in streams))
        finally:
            await engine.stop()

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    assert all(reason is FinishReason.LENGTH for _, reason in results)


def test_abort_frees_blocks_by_the_next_step(tiny_llama_dir: Path) -> None:
    async def main() -> None:
        engine = _engine(tiny_llama_dir, enable_fault_injection=True)
        await engine.start()
        total = engine.stats().total_kv_tokens
        try:
            engine.engine.faults.set_step_delay(0.02)
            stream = engine.submit("long", [7] * 40, SamplingParams(max_new_tokens=200))
            received = 0
            async for out in stream:
                received += len(out.new_token_ids)
                if received >= 3:
                    break  # leaving the iterator early aborts the request
            assert stream.finished is False
            # Blocks are freed when the step thread reads the abort, before its next step.
            await wait_for_async(
                lambda: engine.stats().free_kv_tokens,
                5.0,
                "the aborted request's KV blocks freed",
                until=lambda free: free == total,
                interval_s=0.01,
            )
            assert engine.stats().num_running == 0
        finally:
            await engine.stop()

    asyncio.run(main())


def test_explicit_abort_ends_the_stream_with_aborted(tiny_llama_dir: Path) -> None:
    async def main() -> tuple[list[int], FinishReason | None]:
        engine = _engine(tiny_llama_dir, enable_fault_injection=True)
        await engine.start()
        try:
            engine.engine.faults.set_step_delay(0.02)
            stream = engine.submit("r", [9] * 8, SamplingParams(max_new_tokens=200))
            engine.abort("r")
            return await _collect(stream)
        finally:
            await engine.stop()

    tokens, reason = asyncio.run(main())
    assert reason is FinishReason.ABORTED
    assert len(tokens) < 200


def test_bad_input_and_duplicate_ids_are_refused_at_submit(tiny_llama_dir: Path) -> None:
    async def main() -> None:
        engine = _engine(tiny_llama_dir)
        await engine.start()
        try:
            with pytest.raises(InvalidRequestError, match="top_p"):
                engine.submit("bad", [1, 2], SamplingParams(top_p=2.0))
            stream = engine.submit("dup", [1, 2], SamplingParams(max_new_tokens=4))
            with pytest.raises(InvalidRequestError, match="request_id"):
                engine.submit("dup", [1, 2], SamplingParams(max_new_tokens=4))
            tokens, reason = await _collect(stream)
            assert (len(tokens), reason) == (4, FinishReason.LENGTH)
        finally:
            await engine.stop()
        with pytest.raises(EngineDeadError):
            engine.submit("late", [1, 2], SamplingParams())

    asyncio.run(main())


def test_the_engine_is_built_on_the_step_thread_and_build_errors_reach_start(tiny_llama_dir: Path) -> None:
    built_on: list[str] = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=16, block_size=8))

    def broken() -> LLMEngine:
        return LLMEngine.from_model_dir(tiny_llama_dir / "missing", EngineConfig())

    async def main() -> None:
        engine = AsyncEngine(build)
        with pytest.raises(EngineDeadError, match="not built yet"):
            engine.stats()
        await engine.start()
        assert built_on == ["strata-engine"]
        assert engine.stats().num_running == 0
        await engine.stop()
        failing = AsyncEngine(broken)
        with pytest.raises(ModelLoadError):
            await failing.start()
        with pytest.raises(EngineDeadError):
            failing.submit("r", [1, 2], SamplingParams())

    asyncio.run(main())


def test_the_event_loop_stays_responsive_while_the_engine_steps(tiny_llama_dir: Path) -> None:
    """The step loop runs on its own thread: a 1 ms ticker on the loop must keep ticking."""

    async def main() -> float:
        engine = _engine(tiny_llama_dir)
        await engine.start()
        worst = 0.0
        try:
            streams = [
                engine.submit(f"r{i}", [3 + i] * 30, SamplingParams(max_new_tokens=40)) for i in range(16)
            ]
            work = asyncio.gather(*(_collect(s) for s in streams))
            while not work.done():
                before = time.perf_counter()
                await asyncio.sleep(0.001)
                worst = max(worst, time.perf_counter() - before - 0.001)
            await work
        finally:
            await engine.stop()
        return worst

    worst_lag = asyncio.run(main())
    # Expected lag is a few ms (the GIL between torch kernels); 0.5 s would mean the loop was blocked.
    assert worst_lag < 0.5


def test_step_listeners_see_every_step_and_add_request_needs_no_stream(tiny_llama_dir: Path) -> None:
    """A listener gets each step's whole output list, timed; add_request feeds listeners only."""
    prompts = [[11, 4, 90], [7] * 20, [3, 250, 8, 8, 1]]
    params = SamplingParams(max_new_tokens=6)
    expected = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=128, block_size=8)).generate(
        prompts, params
    )

    async def main() -> None:
        engine = _engine(tiny_llama_dir)
        await engine.start()
        reports: list[StepReport] = []
        tokens: dict[str, list[int]] = {}
        finished: dict[str, FinishReason | None] = {}
        failures: list[tuple[str | None, BaseException]] = []
        done = asyncio.Event()

        def on_step(report: StepReport) -> None:
            reports.append(report)
            for out in report.outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    finished[out.request_id] = out.finish_reason
            if len(finished) == len(prompts):
                done.set()

        remove = engine.add_step_listener(on_step, lambda rid, exc: failures.append((rid, exc)))
        try:
            for i, prompt in enumerate(prompts[:2]):
                engine.add_request(f"q{i}", prompt, params)
            streamed = engine.submit("q2", prompts[2], params)
            with pytest.raises(InvalidRequestError, match="request_id"):
                engine.check("q0", prompts[0], params)
            streamed_tokens, _ = await _collect(streamed)
            await asyncio.wait_for(done.wait(), 30.0)
            assert [tokens[f"q{i}"] for i in range(3)] == expected
            assert streamed_tokens == expected[2]
            assert set(finished.values()) == {FinishReason.LENGTH}
            times = [(r.started, r.ended) for r in reports]
            assert all(start <= end for start, end in times)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(times))
            remove()
            seen = len(reports)
            await _collect(engine.submit("after", [5, 6], SamplingParams(max_new_tokens=3)))
            assert len(reports) == seen
            assert failures == []
            engine.add_step_listener(on_step, lambda rid, exc: failures.append((rid, exc)))
            engine.add_request("open", [9] * 4, SamplingParams(max_new_tokens=200))
        finally:
            await engine.stop()
        # Stopping fails the open request, then reports the loop's end with None.
        assert [rid for rid, _ in failures] == ["open", None]
        assert all(isinstance(exc, EngineDeadError) for _, exc in failures)

    asyncio.run(main())


def test_a_request_the_engine_cannot_add_fails_alone_and_the_engine_keeps_running(
    tiny_llama_dir: Path,
) -> None:
    """add_request takes a request `check` passed; should the scheduler still refuse it (here: an id
    added twice, which `check` would have refused), that request fails and the step loop lives on."""

    async def main() -> None:
        engine = _engine(tiny_llama_dir)
        await engine.start()
        failures: list[tuple[str | None, BaseException]] = []
        engine.add_step_listener(lambda report: None, lambda rid, exc: failures.append((rid, exc)))
        try:
            params = SamplingParams(max_new_tokens=4)
            engine.add_request("twice", [1, 2], params)
            engine.add_request("twice", [1, 2], params)
            await wait_for_async(lambda: failures, 30, "the second add failed")
            assert [(rid, type(exc)) for rid, exc in failures] == [("twice", ValueError)]
            assert engine.is_running
            tokens, reason = await _collect(engine.submit("after", [1, 2], params))
            assert (len(tokens), reason) == (4, FinishReason.LENGTH)
        finally:
            await engine.stop()

    asyncio.run(main())
