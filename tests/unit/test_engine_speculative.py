"""Speculative decoding (prompt lookup) through the engine on a tiny random model.

Greedy or sampled, with penalties, logprobs, stops, preemption and two streams at once, a request
gets the very tokens, and log probabilities to the bit, that it gets without speculation; drafts were
scored and some kept (each test checks the engine's counters, so a speculator that never drafted
would fail). Sampling at temperature 1 keeps its distribution: a chi-squared test over many seeds.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from typing import TYPE_CHECKING

import pytest

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.sequence import FinishReason
from services.worker.model import decode_stack, native
from strata.sampling import SamplingParams
from tests.engine_runs import pin_draft_cost, run_requests

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.engine.sequence import StepOutput

VOCAB = 384
NGRAM = {"method": "ngram", "num_tokens": 3}


def _engine(model: Path, speculative: dict[str, object] | None, **config: object) -> LLMEngine:
    settings: dict[str, object] = {"num_blocks": 128, "block_size": 8, **config}
    if speculative is None:
        return LLMEngine.from_model_dir(model, EngineConfig.model_validate(settings))
    settings["speculative"] = speculative
    return pin_draft_cost(LLMEngine.from_model_dir(model, EngineConfig.model_validate(settings)))


def _repeating_prompt(seed: int, period: int = 10, copies: int = 3) -> list[int]:
    """A prompt that repeats itself, as text quoting its input does: prompt lookup finds drafts."""
    rng = random.Random(seed)
    unit = [rng.randrange(2, VOCAB) for _ in range(period)]
    return unit * copies


def _tokens(outputs: list[StepOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def _logprobs(outputs: list[StepOutput]) -> list[object]:
    return [lp for out in outputs for lp in out.logprobs or []]


def _assert_drafts_kept(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens > 0
    assert stats.num_speculative_decodes > 0


@pytest.mark.parametrize("stack", [True, False], ids=["decode-stack", "per-operator"])
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8"])
def test_one_stream_gets_the_same_tokens_and_logprob_bits(
    tiny_llama_dir: Path, kv_cache_dtype: str, stack: bool
) -> None:
    """A speculative step's rows are the decodes the tokens would have been one step at a time, so
    logits, and the log probabilities taken from them, are the same bits: through the native decode
    stack and through the per-operator path's paged attention kernel, over float32 and int8 caches.
    (Without the native kernels, torch's GEMM at several rows need not give one row's bits.)"""
    if native.library() is None:
        pytest.skip(f"the native kernels are off here: {native.status()}")
    previous = decode_stack.set_enabled(stack)
    try:
        _compare_one_stream(tiny_llama_dir, kv_cache_dtype)
    finally:
        decode_stack.set_enabled(previous)


def _compare_one_stream(tiny_llama_dir: Path, kv_cache_dtype: str) -> None:
    plain = _engine(tiny_llama_dir, None, kv_cache_dtype=kv_cache_dtype)
    fast = _engine(tiny_llama_dir, NGRAM, kv_cache_dtype=kv_cache_dtype)
    for seed in range(4):
        request = {"r": (_repeating_prompt(seed), SamplingParams(max_new_tokens=48, logprobs=3))}
        expected, got = run_requests(plain, request)["r"], run_requests(fast, request)["r"]
        assert _tokens(got) == _tokens(expected)
        assert _logprobs(got) == _logprobs(expected)
        assert len(got) < len(expected)  # fewer steps: some drafts were kept
    _assert_drafts_kept(fast)
    assert fast.block_manager.num_used_blocks == 0


def test_sampling_penalties_and_min_tokens_draw_the_same_tokens(tiny_llama_dir: Path) -> None:
    """Each scored position draws with its own output position's noise and the penalties of the
    output it would follow, so a seeded request's sample is the same token for token."""
    params = [
        SamplingParams(max_new_tokens=40, temperature=0.7, top_p=0.95, seed=7),
        SamplingParams(max_new_tokens=40, temperature=0.5, repetition_penalty=1.3, seed=8),
        SamplingParams(max_new_tokens=40, presence_penalty=0.8, frequency_penalty=0.3, seed=9),
        SamplingParams(max_new_tokens=40, min_tokens=30, stop_token_ids=(5, 6, 7), seed=10),
    ]
    plain = _engine(tiny_llama_dir, None)
    fast = _engine(tiny_llama_dir, NGRAM)
    for seed, p in enumerate(params):
        request = {"r": (_repeating_prompt(seed + 10), p)}
        assert _tokens(run_requests(fast, request)["r"]) == _tokens(run_requests(plain, request)["r"])
    _assert_drafts_kept(fast)


def test_two_streams_stops_and_length_end_where_they_would(tiny_llama_dir: Path) -> None:
    plain = _engine(tiny_llama_dir, None)
    prompts = [_repeating_prompt(20), _repeating_prompt(21)]
    free = [_tokens(run_requests(plain, {"r": (p, SamplingParams(max_new_tokens=30))})["r"]) for p in prompts]
    stop = free[0][17]
    requests = {
        "stop": (prompts[0], SamplingParams(max_new_tokens=30, stop_token_ids=(stop,))),
        "length": (prompts[1], SamplingParams(max_new_tokens=23)),
    }
    fast = _engine(tiny_llama_dir, NGRAM)
    got = run_requests(fast, requests)
    assert _tokens(got["stop"]) == free[0][: free[0].index(stop) + 1]
    assert got["stop"][-1].finish_reason is FinishReason.STOP
    assert _tokens(got["length"]) == free[1][:23]
    assert got["length"][-1].finish_reason is FinishReason.LENGTH
    _assert_drafts_kept(fast)


def test_preempted_speculating_requests_resume_with_the_same_tokens(tiny_llama_dir: Path) -> None:
    prompts = [_repeating_prompt(30 + i, period=6, copies=2) for i in range(8)]
    params = SamplingParams(max_new_tokens=24)
    expected = _engine(tiny_llama_dir, None, num_blocks=256).generate(prompts, params)
    tight = _engine(tiny_llama_dir, NGRAM, num_blocks=16)
    assert tight.generate(prompts, params) == expected
    assert tight.stats().num_preemptions > 0
    _assert_drafts_kept(tight)
    assert tight.stats().free_kv_tokens == tight.stats().total_kv_tokens


def test_a_request_that_opts_out_never_drafts(tiny_llama_dir: Path) -> None:
    fast = _engine(tiny_llama_dir, NGRAM)
    request = {"r": (_repeating_prompt(40), SamplingParams(max_new_tokens=32, speculate=False))}
    outputs = run_requests(fast, request)["r"]
    assert len(outputs) == 32
    assert fast.stats().num_draft_tokens == 0


def _chi_squared_p(first: Counter[int], second: Counter[int]) -> float:
    """The p-value of a chi-squared test that two samples come from one distribution (categories
    with fewer than 10 draws pooled into one), by the Wilson-Hilferty approximation."""
    total_a, total_b = sum(first.values()), sum(second.values())
    pooled = first + second
    common = [t for t, n in pooled.items() if n >= 10]
    bins = [(first[t], second[t]) for t in common]
    rest = (total_a - sum(a for a, _ in bins), total_b - sum(b for _, b in bins))
    if sum(rest):
        bins.append(rest)
    statistic = 0.0
    for a, b in bins:
        expected_a = (a + b) * total_a / (total_a + total_b)
        expected_b = (a + b) * total_b / (total_a + total_b)
        statistic += (a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b
    df = len(bins) - 1
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_tokens_keep_their_distribution_over_many_seeds(tiny_llama_dir: Path) -> None:
    """The third token of 300 seeded samples at temperature 1 with speculation, against 300 other
    seeds without: one distribution (chi-squared p > 0.001), and drafts were scored on the way."""
    prompt = _repeating_prompt(50, period=40, copies=2)
    speculative = {"method": "ngram", "num_tokens": 3, "ngram_min": 1}

    def third_tokens(engine: LLMEngine, seeds: range) -> Counter[int]:
        params = [SamplingParams(max_new_tokens=4, temperature=1.0, top_k=12, seed=s) for s in seeds]
        return Counter(out[2] for out in engine.generate([prompt] * len(seeds), params))

    fast = _engine(tiny_llama_dir, speculative, num_blocks=1024, max_num_seqs=64)
    with_drafts = third_tokens(fast, range(300))
    without = third_tokens(_engine(tiny_llama_dir, None, num_blocks=1024, max_num_seqs=64), range(300, 600))
    _assert_drafts_kept(fast)
    assert _chi_squared_p(with_drafts, without) > 0.001


def test_constrained_requests_draft_within_their_grammar(tiny_serving_dir: Path) -> None:
    """A regex of repeated words: prompt lookup drafts the words written before, the grammar cuts
    drafts it refuses and masks each scored position for its own state, and the output is the one
    the same grammar gives without speculation."""
    from tokenizers import Tokenizer

    from services.worker.engine.grammar_compiler import GrammarCompiler
    from services.worker.engine.grammar_spec import GrammarSpec

    tokenizer = Tokenizer.from_file(str(tiny_serving_dir / "tokenizer.json"))
    spec = GrammarSpec.of("regex", "((red|green|blue) ){24}")
    prompts = [tokenizer.encode(f"Colours, take {i}: red green blue").ids for i in range(3)]
    outputs = {}
    for name, speculative in (("off", None), ("on", {"method": "ngram", "ngram_min": 1})):
        engine = _engine(tiny_serving_dir, speculative, num_blocks=256)
        config = engine.model_config
        compiler = GrammarCompiler.from_model_dir(tiny_serving_dir, config.eos_token_ids, config.vocab_size)
        for i, prompt in enumerate(prompts):
            engine.add_request(
                f"r{i}", prompt, SamplingParams(max_new_tokens=120), grammar=compiler.matcher(spec)
            )
        found: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        reasons = {}
        while engine.has_work():
            for out in engine.step():
                found[out.request_id].extend(out.new_token_ids)
                reasons[out.request_id] = out.finish_reason
        outputs[name] = (found, reasons)
        if speculative is not None:
            _assert_drafts_kept(engine)
    assert outputs["on"] == outputs["off"]
    for tokens in outputs["on"][0].values():
        assert re.fullmatch("((red|green|blue) ){24}", tokenizer.decode(tokens))
