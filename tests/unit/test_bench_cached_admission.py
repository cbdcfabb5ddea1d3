"""bench/cached_admission.py's workload and oracle: the mix's shares and its truth, the oracle's
answers (a shared system prompt cached only once a prompt holding it was prefilled, in whole blocks),
and the targets' verdict. The run itself starts a stack and is the benchmark's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bench.cached_admission import Mix, OracleCache, _parse, _target
from gateway.prompt_prefix import prompt_prefix
from gateway.tenant_settings import DEFAULT_TENANT
from strata.v1 import gateway_pb2

if TYPE_CHECKING:
    from pathlib import Path


def mix(model_dir: Path) -> Mix:
    """A small mix: system prompts of 300 tokens (past one 256-byte piece: a shorter prompt has no
    hashes to tell prompts apart by), questions of 6."""
    args = _parse(["--system-tokens", "300", "--question-tokens", "6", "--system-prompts", "2"])
    return Mix(args, model_dir)


def test_nine_in_ten_prompts_share_a_system_prompt_and_the_truth_says_how_many_tokens(
    tiny_serving_dir: Path,
) -> None:
    workload = mix(tiny_serving_dir)
    prompts = workload.prompts(200, "seed")
    assert len({p.text for p in prompts}) == 200
    truths = [
        workload.truth[prompt_prefix(gateway_pb2.GenerateRequest(prompt=p.text), DEFAULT_TENANT)]
        for p in prompts
    ]
    shared = [(system, tokens) for system, tokens in truths if system is not None]
    assert 160 <= len(shared) <= 195  # 0.9 of 200, seeded
    for (system, tokens), prompt in zip(truths, prompts, strict=True):
        if system is not None:
            assert prompt.text.startswith(workload.systems[system].text)
            assert 300 <= tokens < len(prompt.token_ids)
    assert workload.prompts(200, "seed") == prompts  # the same seed, the same phase


def test_the_oracle_serves_a_system_prompt_once_it_was_prefilled_in_whole_blocks(
    tiny_serving_dir: Path,
) -> None:
    workload = mix(tiny_serving_dir)
    prompts = workload.prompts(50, "seed")
    prefixes = [prompt_prefix(gateway_pb2.GenerateRequest(prompt=p.text), DEFAULT_TENANT) for p in prompts]
    shared = [prefix for prefix in prefixes if workload.truth[prefix][0] is not None]
    oracle = OracleCache(workload.truth, block_tokens=16)
    assert oracle.cached_tokens(shared[0]) == 0
    oracle.prefilled(shared[0], 100)
    system, tokens = workload.truth[shared[0]]
    assert oracle.cached_tokens(shared[0]) == tokens // 16 * 16 > 0
    others = [p for p in shared if workload.truth[p][0] != system]
    assert others and all(oracle.cached_tokens(p) == 0 for p in others)
    oracle.clear()  # a new stream: the worker's cache may be gone
    assert oracle.cached_tokens(shared[0]) == 0


def phases(guess: float, oracle: float, price_all: float, p99_ms: float | None) -> dict[str, dict[str, Any]]:
    def phase(goodput: float) -> dict[str, Any]:
        return {"goodput_tok_s": goodput, "routes": {"primary": {"ttft_ms": {"p99": p99_ms}}}}

    return {"guess": phase(guess), "oracle": phase(oracle), "price_all": phase(price_all)}


def test_the_targets_are_the_guess_p99_within_the_slo_bound_and_its_goodput_against_the_oracles() -> None:
    met = _target(phases(90.0, 100.0, 40.0, 2150.0), 2000.0)
    assert met["ttft_met"] and met["goodput_met"] and met["goodput_guess_over_price_all"] == 2.25
    assert not _target(phases(89.0, 100.0, 40.0, 2150.0), 2000.0)["goodput_met"]
    missed = _target(phases(90.0, 100.0, 40.0, 2250.0), 2000.0)
    assert not missed["ttft_met"] and missed["guess_ttft_p99_over_slo"] == 1.125
    assert not _target(phases(90.0, 100.0, 40.0, None), 2000.0)["ttft_met"]  # a round with no first token
