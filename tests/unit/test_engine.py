"""The synchronous engine on a tiny random model: seeded sampling, leaks, preemption, validation, faults."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.faults import FaultInjectionDisabledError
from services.worker.engine.sequence import FinishReason
from strata.sampling import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from pathlib import Path

VOCAB = 384
SAMPLED = SamplingParams(
    max_new_tokens=20, temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=1234
)


def _prompts(count: int, seed: int, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


Results = dict[str, tuple[list[int], FinishReason | None]]


def _step(engine: LLMEngine, results: Results) -> None:
    for out in engine.step():
        tokens, _ = results.get(out.request_id, ([], None))
        results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)


def _run_to_end(engine: LLMEngine, results: Results | None = None) -> Results:
    results = {} if results is None else results
    for _ in range(100_000):
        if not engine.has_work():
            return results
        _step(engine, results)
    raise AssertionError("the engine did not finish its work in 100,000 steps")


def test_seeded_request_gives_same_tokens_alone_in_a_batch_and_after_preemption(tiny_llama_dir: Path) -> None:
    prompt = _prompts(1, seed=1)[0]
    alone = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=64, block_size=8))
    (solo,) = alone.generate([prompt], SAMPLED)
    assert len(solo) == 20

    batched = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=256, block_size=8))
    others = _prompts(31, seed=2)
    params = [SamplingParams(max_new_tokens=20, temperature=1.0, seed=s) for s in range(31)]
    outputs = batched.generate([*others[:15], prompt, *others[15:]], [*params[:15], SAMPLED, *params[15:]])
    assert outputs[15] == solo

    # 12 blocks of 8 tokens cannot hold 32 sequences of up to 60 tokens: preemption must happen.
    tight = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=12, block_size=8))
    outputs = tight.generate([*others[:15], prompt, *others[15:]], [*params[:15], SAMPLED, *params[15:]])
    assert tight.stats().num_preemptions > 0
    assert outputs[15] == solo


def test_a_third_of_the_kv_cache_gives_every_request_the_same_output(tiny_llama_dir: Path) -> None:
    prompts = _prompts(24, seed=3)
    params = SamplingParams(max_new_tokens=16)
    ample = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=512, block_size=8))
    expected = ample.generate(prompts, params)
    need = sum(-(-(len(p) + 16) // 8) for p in prompts)
    tight = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=need // 3, block_size=8))
    assert tight.generate(prompts, params) == expected
    assert tight.stats().num_preemptions > 0
    assert tight.stats().free_kv_tokens == tight.stats().total_kv_tokens


def test_1000_requests_with_random_aborts_return_every_block(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(
        tiny_llama_dir, EngineConfig(num_blocks=96, block_size=8, max_num_seqs=32, max_num_batched_tokens=128)
    )
    initial = engine.stats().free_kv_tokens
    rng = random.Random(11)
    live: list[str] = []
    finished: set[str] = set()
    aborted = 0
    for index, prompt in enumerate(_prompts(1000, seed=4, max_len=30)):
        rid = f"r{index}"
        params = SamplingParams(
            max_new_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.7]), seed=index
        )
        engine.add_request(rid, prompt, params)
        live.append(rid)
        if rng.random() < 0.5:
            for out in engine.step():
                if out.finished:
                    finished.add(out.request_id)
        if rng.random() < 0.3:
            victim = rng.choice(live[-8:])
            if victim not in finished and engine.abort(victim):
                aborted += 1
    _run_to_end(engine)
    stats = engine.stats()
    assert aborted > 100
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.free_kv_tokens == initial
    engine.block_manager.check_invariants()


def test_finish_reasons_length_and_stop_token(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=64, block_size=8))
    prompt = _prompts(1, seed=5)[0]
    (free_run,) = engine.generate([prompt], SamplingParams(max_new_tokens=12))
    stop_at = free_run[5]
    engine.add_request("stop", prompt, SamplingParams(max_new_tokens=12, stop_token_ids=(stop_at,)))
    engine.add_request("length", prompt, SamplingParams(max_new_tokens=12))
    results = _run_to_end(engine)
    assert results["length"] == (free_run, FinishReason.LENGTH)
    stop_tokens, reason = results["stop"]
    assert reason is FinishReason.STOP
    assert stop_tokens == free_run[: free_run.index(stop_at) + 1]


@pytest.mark.parametrize(
    ("field", "params", "prompt_len"),
    [
        ("temperature", SamplingParams(temperature=-0.1), 4),
        ("top_p", SamplingParams(top_p=0.0), 4),
        ("top_p", SamplingParams(top_p=1.5), 4),
        ("top_k", SamplingParams(top_k=-1), 4),
        ("repetition_penalty", SamplingParams(repetition_penalty=0.0), 4),
        ("max_new_tokens", SamplingParams(max_new_tokens=0), 4),
        ("max_new_tokens", SamplingParams(max_new_tokens=300), 4),
        ("prompt", SamplingParams(), 0),
        ("prompt", SamplingParams(), 256),
    ],
)
def test_invalid_parameters_raise_one_typed_error_naming_the_field(
    tiny_llama_dir: Path, field: str, params: SamplingParams, prompt_len: int
) -> None:
    engine = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=64, block_size=8))
    with pytest.raises(InvalidRequestError) as info:
        engine.validate([5] * prompt_len, params)
    assert info.value.field == field
    assert field in str(info.value)
    assert not engine.has_work()


def test_out_of_range_token_id_is_refused(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=64, block_size=8))
    with pytest.raises(InvalidRequestError, match=r"prompt_ids.*\[0, 384\)"):
        engine.validate([1, VOCAB], SamplingParams())


def test_simulated_out_of_memory_sheds_load_and_every_request_still_completes(tiny_llama_dir: Path) -> None:
    prompts = _prompts(16, seed=6)
    params = SamplingParams(max_new_tokens=10)
    expected = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=256, block_size=8)).generate(
        prompts, params
    )
    config = EngineConfig(num_blocks=256, block_size=8, enable_fault_injection=True, shed_recovery_steps=2)
    engine = LLMEngine.from_model_dir(tiny_llama_dir, config)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    results: Results = {}
    _step(engine, results)
    _step(engine, results)
    engine.faults.fail_next_steps(2)
    _run_to_end(engine, results)
    stats = engine.stats()
    assert stats.num_load_sheds == 2
    assert [results[f"r{i}"][0] for i in range(16)] == expected
    assert stats.free_kv_tokens == stats.total_kv_tokens


def test_a_lone_request_that_keeps_failing_ends_with_an_error(tiny_llama_dir: Path) -> None:
    config = EngineConfig(num_blocks=64, block_size=8, enable_fault_injection=True)
    engine = LLMEngine.from_model_dir(tiny_llama_dir, config)
    engine.add_request("doomed", [3, 4, 5], SamplingParams(max_new_tokens=4))
    engine.faults.fail_next_steps(100)
    results = _run_to_end(engine)
    assert results["doomed"] == ([], FinishReason.ERROR)
    assert engine.stats().free_kv_tokens == engine.stats().total_kv_tokens


def test_fault_switches_refuse_to_arm_outside_test_mode(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=16, block_size=8))
    with pytest.raises(FaultInjectionDisabledError):
        engine.faults.fail_next_steps(1)
    with pytest.raises(FaultInjectionDisabledError):
        engine.faults.set_step_delay(0.1)
