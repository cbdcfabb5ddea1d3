"""Speculative decoding with a draft model, on tiny random models sharing one tokenizer.

The served model drafting for itself agrees with itself: nearly every draft is kept, greedy or
sampled (the draft draws with the target's seeded noise at the same positions). A smaller model of
other, untied weights disagrees: its drafts are rejected, and the output is still the one without
speculation. The draft's cache sits inside the memory budget, its mirrors go back
when requests end, and a draft of another tokenizer is refused at start.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

import pytest

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model import native
from strata.sampling import SamplingParams
from tests.engine_runs import pin_draft_cost
from tests.scheduler_invariants import check_invariants

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.engine.sequence import StepOutput


def _engine(model: Path, draft: Path | None, **config: object) -> LLMEngine:
    settings: dict[str, object] = {"kv_cache_memory_bytes": 4 << 20, "block_size": 8, **config}
    if draft is None:
        return LLMEngine.from_model_dir(model, EngineConfig.model_validate(settings))
    settings["speculative"] = {"method": "draft", "draft_model_path": str(draft), "num_tokens": 3}
    return pin_draft_cost(LLMEngine.from_model_dir(model, EngineConfig.model_validate(settings)))


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[StepOutput]]:
    outputs: dict[str, list[StepOutput]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        outputs[f"r{i}"] = []
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out)
        check_invariants(engine.scheduler)
    return outputs


def _tokens(outputs: dict[str, list[StepOutput]]) -> dict[str, list[int]]:
    return {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in outputs.items()}


def _logprobs(outputs: dict[str, list[StepOutput]]) -> list[object]:
    return [lp for outs in outputs.values() for out in outs for lp in out.logprobs or []]


PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42] * 3]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=30, logprobs=2),
        SamplingParams(max_new_tokens=30, temperature=0.8, seed=3),
    ],
    ids=["greedy", "sampled"],
)
def test_the_model_drafting_for_itself_keeps_its_drafts_and_its_tokens(
    tiny_serving_dir: Path, params: SamplingParams
) -> None:
    plain = _run(_engine(tiny_serving_dir, None), PROMPTS, params)
    engine = _engine(tiny_serving_dir, tiny_serving_dir)
    drafted = _run(engine, PROMPTS, params)
    assert _tokens(drafted) == _tokens(plain)
    if native.library() is not None and params.logprobs is not None:
        # Through the native kernels, the verified rows' logits are the same bits as one-row steps'.
        assert _logprobs(drafted) == _logprobs(plain)
    stats = engine.stats()
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
    assert engine.speculator is not None and engine.speculator.draft is not None
    assert engine.speculator.draft.num_mirrors == 0
    assert engine.speculator.draft.blocks.num_used_blocks == 0
    # Its passes (prompt catch-ups and one-token drafts) gave the rule a line to price drafts by.
    draft_passes = engine.speculator.draft.costs
    assert draft_passes.fitted and draft_passes.seconds(1) > 0


@pytest.fixture(scope="module")
def untied_draft_dir(tiny_serving_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama of other, untied weights with tiny_serving_dir's tokenizer: where the tied
    served model repeats its last token, this one writes others."""
    from strata.fingerprint import TOKENIZER_FILES
    from tests.conftest import build_tiny_model

    directory = build_tiny_model(
        tmp_path_factory.mktemp("tiny-untied-draft"), "llama", seed=7, num_hidden_layers=2
    )
    for name in TOKENIZER_FILES:
        if (tiny_serving_dir / name).is_file():
            shutil.copyfile(tiny_serving_dir / name, directory / name)
    return directory


def test_a_draft_that_disagrees_changes_no_token(tiny_serving_dir: Path, untied_draft_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=30)
    plain = _run(_engine(tiny_serving_dir, None), PROMPTS, params)
    engine = _engine(tiny_serving_dir, untied_draft_dir)
    assert _tokens(_run(engine, PROMPTS, params)) == _tokens(plain)
    stats = engine.stats()
    assert stats.num_draft_tokens > stats.num_accepted_tokens


def test_the_draft_cache_counts_in_the_budget(tiny_serving_dir: Path, tiny_fallback_dir: Path) -> None:
    alone = _engine(tiny_serving_dir, None)
    paired = _engine(tiny_serving_dir, tiny_fallback_dir)
    # One budget, a block of each cache: fewer blocks, each holding the same tokens in both.
    assert paired.memory.bytes_per_block > alone.memory.bytes_per_block
    assert paired.memory.num_blocks == (4 << 20) // paired.memory.bytes_per_block < alone.memory.num_blocks
    assert paired.speculator is not None and paired.speculator.draft is not None
    assert paired.speculator.draft.blocks.num_blocks == paired.memory.num_blocks


def test_a_draft_of_another_tokenizer_is_refused(
    tiny_fallback_dir: Path, tiny_serving_dir: Path, tmp_path: Path
) -> None:
    other = shutil.copytree(tiny_fallback_dir, tmp_path / "other-tokenizer")
    tokenizer = other / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + "\n")
    with pytest.raises(ValueError, match="another tokenizer"):
        _engine(tiny_serving_dir, other)


def test_draft_settings_name_the_fix() -> None:
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="SPECULATIVE__DRAFT_MODEL_PATH"):
        EngineConfig.model_validate({"speculative": {"method": "draft"}})
    with pytest.raises(pydantic.ValidationError, match="SPECULATIVE__DRAFT_MODEL_PATH"):
        EngineConfig.model_validate({"speculative": {"method": "ngram", "draft_model_path": "x"}})
