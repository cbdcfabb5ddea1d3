"""Log probabilities through the engine on a tiny random model: they are log_softmax of the raw
logits (before any processor), the same alone or in a mixed batch, after chunked prefill, prefix
caching and preemption; prompt logprobs skip the prefix cache; and the processors act end to end.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.logprobs import token_logprobs
from strata.sampling import InvalidRequestError, SamplingParams
from tests.engine_runs import run_requests

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.engine.sequence import StepOutput, TokenLogprobs

VOCAB = 384


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(length)]


def _flat(outs: list[StepOutput]) -> tuple[list[int], list[TokenLogprobs]]:
    tokens = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    return tokens, lps


def test_token_logprobs_are_log_softmax_of_the_raw_logits_for_asking_rows_only() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4
    found = token_logprobs(logits, [7, 3, 49], [5, None, 0])
    reference = torch.log_softmax(logits, dim=-1)
    assert found[1] is None
    first, last = found[0], found[2]
    assert first is not None and last is not None
    # float32 rounding: logit - logsumexp and log_softmax differ by an ulp (about 2e-6 at 18).
    assert first.logprob == pytest.approx(float(reference[0, 7]), abs=1e-5)
    assert [t for t, _ in first.top] == reference[0].topk(5).indices.tolist()
    assert first.rank == int((reference[0] > reference[0, 7]).sum()) + 1
    assert last.top == ()
    assert math.isclose(sum(math.exp(v) for v in reference[2].tolist()), 1.0, rel_tol=1e-5)


def test_logprobs_describe_the_model_not_the_processors_and_match_alone_and_batched(
    tiny_llama_dir: Path,
) -> None:
    prompt = _prompt(1, 30)
    params = SamplingParams(
        max_new_tokens=12, temperature=0.8, top_k=20, min_p=0.05, presence_penalty=1.0, logprobs=4, seed=9
    )
    alone = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=64, block_size=8))
    tokens, lps = _flat(run_requests(alone, {"a": (prompt, params)})["a"])
    assert len(lps) == len(tokens) == 12
    assert [lp.token_id for lp in lps] == tokens
    # Prompt logprobs of prompt + output (one prefill, no processors) give the same numbers.
    check = SamplingParams(max_new_tokens=1, prompt_logprobs=4)
    whole = run_requests(alone, {"check": (prompt + tokens, check)})["check"][0].prompt_logprobs
    assert whole is not None and len(whole) == len(prompt) + len(tokens) - 1
    for lp, ref in zip(lps, whole[len(prompt) - 1 :], strict=True):
        assert lp.token_id == ref.token_id and lp.rank == ref.rank
        assert lp.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t for t, _ in lp.top] == [t for t, _ in ref.top]

    batched = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=256, block_size=8))
    others = {
        f"o{i}": (_prompt(10 + i, 5 + 3 * i), SamplingParams(max_new_tokens=8, temperature=1.0, seed=i))
        for i in range(6)
    }
    outputs = run_requests(
        batched, {**others, "a": (prompt, params), "g": (prompt, SamplingParams(max_new_tokens=4))}
    )
    tokens_b, lps_b = _flat(outputs["a"])
    assert tokens_b == tokens
    for one, two in zip(lps, lps_b, strict=True):
        assert one.logprob == pytest.approx(two.logprob, abs=1e-5)
        assert [t for t, _ in one.top] == [t for t, _ in two.top]
    # Rows that did not ask carry none.
    assert all(o.logprobs is None for rid in others for o in outputs[rid])


def test_prompt_logprobs_survive_chunking_caching_and_preemption(tiny_llama_dir: Path) -> None:
    prompt = _prompt(2, 70)
    params = SamplingParams(max_new_tokens=3, prompt_logprobs=2)
    whole_engine = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=64, block_size=8))
    ref = run_requests(whole_engine, {"r": (prompt, params)})["r"][0].prompt_logprobs
    assert ref is not None and len(ref) == len(prompt) - 1
    assert [lp.token_id for lp in ref] == prompt[1:]

    config = EngineConfig(
        num_blocks=40,
        block_size=8,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        chunked_prefill=True,
    )
    engine = LLMEngine.from_model_dir(tiny_llama_dir, config)
    # The same prompt cached first by a request without prompt logprobs: the second must still compute it.
    run_requests(engine, {"warm": (prompt, SamplingParams(max_new_tokens=1))})
    hits_before = engine.stats().prefix_hit_blocks
    outs = run_requests(engine, {"p": (prompt, params)})["p"]
    assert engine.stats().prefix_hit_blocks == hits_before
    got = outs[0].prompt_logprobs
    assert got is not None and len(got) == len(ref)
    assert all(o.prompt_logprobs is None for o in outs[1:])
    for a, b in zip(got, ref, strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)

    # Two growing requests outgrow 12 blocks: the less urgent one is preempted after its prefill, and
    # its prompt logprobs are still reported once, whole.
    tight = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=12, block_size=8))
    low = SamplingParams(max_new_tokens=30, prompt_logprobs=1)
    for rid, ids, p, priority in [
        ("low", prompt[:40], low, 1),
        ("high", _prompt(3, 40), SamplingParams(max_new_tokens=30), 0),
    ]:
        tight.validate(ids, p)
        tight.add_request(rid, ids, p, priority=priority)
    collected: list[StepOutput] = []
    while tight.has_work():
        collected += [o for o in tight.step() if o.request_id == "low"]
    assert tight.stats().num_preemptions > 0
    reported = [o.prompt_logprobs for o in collected if o.prompt_logprobs]
    assert len(reported) == 1 and [lp.token_id for lp in reported[0]] == prompt[1:40]
    assert sum(len(o.new_token_ids) for o in collected) == 30


def test_stop_token_ids_and_min_tokens_in_the_engine(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=64, block_size=8))
    prompt = _prompt(4, 12)
    (free,) = engine.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))
    stop = free[2]
    (stopped,) = engine.generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=(stop,)))
    assert stopped == free[: free.index(stop) + 1]
    held = SamplingParams(max_new_tokens=10, stop_token_ids=(stop,), min_tokens=6)
    (later,) = engine.generate([prompt], held)
    assert len(later) >= 6 and stop not in later[:6]
    with pytest.raises(InvalidRequestError) as raised:
        engine.validate(prompt, SamplingParams(logit_bias=((VOCAB, 1.0),)))
    assert raised.value.field == "logit_bias"
