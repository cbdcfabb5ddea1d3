"""Tensor parallelism on the CPU: the engine over two real ranks (this process and one it starts, gloo
over loopback) against the same engine on one rank.

Two ranks add partial sums in another order than one matmul does, so logits agree to float32
rounding, not to the bit: log probabilities are compared within 1e-4 and tokens under the parity rule
(identical, or at the first divergence a near tie of the one-rank run that the two-rank run broke the
other way). The models: a tiny Llama with grouped-query attention (4 query heads, 2 KV heads: one KV
head per rank), a tiny Qwen2 (q/k/v biases, split with their rows), and a Llama with one KV head,
which both ranks keep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.grammar_compiler import GrammarCompiler
from services.worker.engine.grammar_spec import GrammarSpec
from services.worker.model.config import ModelLoadError
from services.worker.model.loader import load_model
from services.worker.model.ranks import RankSpec, collective_clock, load_tensor_parallel
from services.worker.model.tensor_parallel import Shard
from services.worker.settings import WorkerSettings
from strata.sampling import SamplingParams
from tests.conftest import build_tiny_model
from tests.parity import TIE_GAP
from tests.scheduler_invariants import check_invariants

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.engine.sequence import StepOutput, TokenLogprobs

TOLERANCE = 1e-4
# Every collective is bounded by this; generous, a tiny step takes milliseconds.
TIMEOUT_S = 60.0
START_S = 600.0
"""The bound on forming the group and loading the shards."""


def two_rank_engine(model_dir: Path, config: EngineConfig) -> LLMEngine:
    spec = RankSpec(model_dir, "cpu", torch.float32, config.kv_cache_dtype, 2, TIMEOUT_S, START_S, threads=1)
    loaded = load_tensor_parallel(spec)
    return LLMEngine(loaded, config)


def run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], **grammars: GrammarSpec
) -> dict[str, list[StepOutput]]:
    outputs: dict[str, list[StepOutput]] = {rid: [] for rid in requests}
    compiler = None
    if grammars:
        config = engine.model_config
        compiler = GrammarCompiler.from_model_dir(
            engine.runner.loaded.path, config.eos_token_ids, config.vocab_size
        )
    for rid, (prompt, params) in requests.items():
        grammar = compiler.matcher(grammars[rid]) if compiler is not None and rid in grammars else None
        engine.validate(prompt, params)
        engine.add_request(rid, prompt, params, grammar=grammar)
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out)
        check_invariants(engine.scheduler)
    return outputs


def both(
    model_dir: Path,
    config: EngineConfig,
    requests: dict[str, tuple[list[int], SamplingParams]],
    **grammars: GrammarSpec,
) -> tuple[dict[str, list[StepOutput]], dict[str, list[StepOutput]], LLMEngine]:
    one = run(LLMEngine.from_model_dir(model_dir, config), requests, **grammars)
    engine = two_rank_engine(model_dir, config)
    try:
        two = run(engine, requests, **grammars)
    finally:
        engine.close()
    return one, two, engine


def tokens(outputs: list[StepOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def logprobs(outputs: list[StepOutput]) -> list[TokenLogprobs]:
    return [lp for out in outputs for lp in out.logprobs or ()]


def assert_parity(two: list[StepOutput], one: list[StepOutput]) -> int:
    """Tokens equal up to a near tie of the one-rank run; log probabilities within TOLERANCE up to
    there. Returns how many tokens were compared."""
    ours, ref, ref_lps, our_lps = tokens(two), tokens(one), logprobs(one), logprobs(two)
    for step, (got, expected) in enumerate(zip(ours, ref, strict=True)):
        if ref_lps:
            assert our_lps[step].logprob == pytest.approx(ref_lps[step].logprob, abs=TOLERANCE)
        if got == expected:
            continue
        top = ref_lps[step].top
        assert top[0][1] - top[1][1] < TIE_GAP and got == top[1][0], (step, ours, ref)
        return step
    return len(ref)


@pytest.fixture(scope="module")
def tiny_uneven_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose 3 KV heads (6 query heads) and 200-wide MLP do not divide by 2, as SmolLM2's 3
    and 9 do not: rank 0 takes 2 KV heads and 101 of the MLP, rank 1 one and 100."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-uneven"),
        "llama",
        seed=5,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=3,
        intermediate_size=201,
    )


@pytest.mark.parametrize(
    "fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama_linear_mqa_dir", "tiny_uneven_dir"]
)
def test_two_ranks_give_one_ranks_logits(fixture: str, request: pytest.FixtureRequest) -> None:
    """Greedy tokens, their log probabilities and the prompts' log probabilities of the two-rank
    engine equal the one-rank engine's to float32 rounding, on four layouts of KV heads (one a rank,
    one for both ranks, uneven shares)."""
    model_dir: Path = request.getfixturevalue(fixture)
    params = SamplingParams(max_new_tokens=16, logprobs=4, prompt_logprobs=2)
    prompts = {"a": [1, 7, 99, 5, 23], "b": [3, 3, 200, 17, 5, 9, 11, 40, 2], "c": list(range(10, 60))}
    one, two, engine = both(
        model_dir, EngineConfig(num_blocks=64, max_num_seqs=4), {k: (p, params) for k, p in prompts.items()}
    )
    for rid in prompts:
        assert assert_parity(two[rid], one[rid]) >= 8
        ref_prompt, our_prompt = one[rid][0].prompt_logprobs, two[rid][0].prompt_logprobs
        assert ref_prompt is not None and our_prompt is not None
        assert [lp.logprob for lp in our_prompt] == pytest.approx(
            [lp.logprob for lp in ref_prompt], abs=TOLERANCE
        )
    clock = collective_clock(engine.runner.model)
    assert clock is not None and clock.calls > 0  # the ranks did exchange


def test_chunks_prefix_cache_preemption_grammar_and_aborts_match_one_rank(tiny_serving_dir: Path) -> None:
    """The engine's features run the same at two ranks: prompts longer than a step's token budget
    (chunked prefill), a shared prefix served from the cache, a cache too small for every sequence
    (preemption), a regex-constrained request and one aborted mid-way."""
    config = EngineConfig(num_blocks=14, block_size=16, max_num_seqs=4, max_num_batched_tokens=32)
    shared = list(range(30, 78))
    params = SamplingParams(max_new_tokens=40, logprobs=2, ignore_eos=True)
    requests = {
        "shared-1": ([*shared, 5, 6], params),
        "shared-2": ([*shared, 7, 8], params),
        "long": (list(range(100, 170)), params),
        "digits": ([12, 40, 41], SamplingParams(max_new_tokens=8, logprobs=2)),
    }
    one_engine = LLMEngine.from_model_dir(tiny_serving_dir, config)
    one = run(one_engine, requests, digits=GrammarSpec.of("regex", "[0-9]+"))
    two_engine = two_rank_engine(tiny_serving_dir, config)
    try:
        two = run(two_engine, requests, digits=GrammarSpec.of("regex", "[0-9]+"))
        aborted = abort_after_first_token(two_engine)
        stats = two_engine.stats()
    finally:
        two_engine.close()
    for rid in requests:
        assert assert_parity(two[rid], one[rid]) > 0, rid
    assert stats.num_preemptions > 0 and one_engine.stats().num_preemptions > 0
    assert sum(out.num_cached_tokens for out in two["shared-2"]) >= 32
    assert aborted == stats.num_blocks  # the abort gave back every block
    assert len(tokens(two["digits"])) > 0


def abort_after_first_token(engine: LLMEngine) -> int:
    """Start a request, abort it after its first token, run the engine idle; its free blocks after."""
    engine.add_request("to-abort", list(range(1, 40)), SamplingParams(max_new_tokens=100))
    while not any(out.new_token_ids for out in engine.step()):
        pass
    engine.abort("to-abort")
    while engine.has_work():
        engine.step()
    return engine.stats().num_free_blocks


def test_a_shard_is_its_share_of_the_heads(tiny_llama_linear_mqa_dir: Path, tiny_llama_dir: Path) -> None:
    """Rank 1 of 2 holds half the query heads and half the MLP; with one KV head both ranks keep it;
    a split that does not divide the heads is refused naming the fix."""
    shard = load_model(tiny_llama_dir, shard=Shard(1, 2))
    whole = load_model(tiny_llama_dir)
    assert shard.config.num_attention_heads * 2 == whole.config.num_attention_heads
    assert shard.config.num_key_value_heads * 2 == whole.config.num_key_value_heads
    assert shard.config.intermediate_size * 2 == whole.config.intermediate_size
    assert not shard.model.native_paths.decode_stack
    mqa = load_model(tiny_llama_linear_mqa_dir, shard=Shard(1, 2))
    assert mqa.config.num_key_value_heads == 1
    with pytest.raises(ModelLoadError, match="tensor_parallel_size of at most 2"):
        load_model(tiny_llama_dir, shard=Shard(0, 3))


def test_quantized_weights_are_refused_over_ranks(tiny_llama_dir: Path) -> None:
    """Only float weights are split: the settings refuse a quantization with several ranks, and the
    loader refuses to split quantized weights, each naming the fix."""
    with pytest.raises(ValueError, match="tensor_parallel_size: 1"):
        WorkerSettings.build(
            {
                "model_name": "tiny",
                "model_path": str(tiny_llama_dir),
                "tensor_parallel_size": 2,
                "quantization": "dynamic-int8",
            }
        )
    with pytest.raises(ModelLoadError, match="dynamic-int8 cannot be split over tensor-parallel ranks"):
        load_model(tiny_llama_dir, quantization="dynamic-int8", shard=Shard(0, 2))
