"""The quality gate of the default fallback: dynamic-int8 SmolLM2 from its own folder, through our loader.

The fallback must still answer the Paris question (chat template, greedy) and its perplexity on a
fixed English paragraph (about 240 tokens, below) must stay within 1.5x the float32 primary's, on
both of its paths: the dynamic int8 path of large batches (the whole paragraph in one prefill step)
and the weight-only int8 copies of small ones (the paragraph prefilled small_linear.MAX_ROWS tokens
a step, as decodes run). The perplexities come from our model's own forward pass, so they measure the
same code the engine serves with. A model with layers cut off fails this by far.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model.attention import AttentionMetadata
from services.worker.model.kv_cache import KVCache
from services.worker.model.loader import LoadedModel, load_model
from services.worker.model.small_linear import MAX_ROWS
from strata.cli.model_fetch import FALLBACK_QUANTIZATION, fallback_model_dir
from strata.sampling import SamplingParams

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.real_model

MAX_PERPLEXITY_RATIO = 1.5
BLOCK_SIZE = 16
TEXT = (
    "The river that runs through the old town was once the reason the town existed at all. Merchants "
    "brought salt and wool down from the hills on flat boats, and the mills along the banks ground grain "
    "for the farms that spread across the valley. In the spring the water rose quickly when the snow "
    "melted in the mountains, and the people who lived near the bridge learned to keep their stores on "
    "the upper floors. Over the centuries the town grew beyond its walls. A railway arrived in the "
    "nineteenth century, and with it came factories that made bricks, paper and glass. The river was "
    "straightened and lined with stone so that barges could reach the new docks, and the mills were "
    "turned into warehouses. Today most of the factories have closed, but the warehouses have become "
    "apartments, shops and a small museum that tells the story of the valley. Visitors walk along the "
    "embankment in the evening, children feed the ducks near the bridge, and every summer the town holds "
    "a festival on the water with music, boat races and fireworks. The old market square still hosts a "
    "farmers' market every Saturday morning, where people buy bread, cheese, vegetables and flowers from "
    "the same families that have sold them for generations."
)


@pytest.fixture(scope="module")
def fallback_dir(real_model_dir: Path) -> Path:
    # `strata fetch-model` (which real_model_dir runs when needed) prepares it next to the model.
    return fallback_model_dir(real_model_dir.parent)


def _tokenizer(model_dir: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def perplexity(loaded: LoadedModel, ids: list[int], chunk: int | None = None) -> float:
    """exp(mean next-token cross-entropy) of `ids` from our model, prefilled `chunk` tokens a step
    (all of them in one step by default)."""
    blocks = math.ceil(len(ids) / BLOCK_SIZE)
    cache = KVCache.allocate(loaded.config, blocks, BLOCK_SIZE, loaded.dtype, torch.device("cpu"))
    step = chunk or len(ids)
    rows = []
    with torch.inference_mode():
        for start in range(0, len(ids), step):
            end = min(len(ids), start + step)
            meta = AttentionMetadata.build([end - start], [end], [list(range(blocks))], BLOCK_SIZE, "cpu", 0)
            hidden = loaded.model(torch.tensor(ids[start:end]), torch.arange(start, end), meta, cache)
            rows.append(loaded.model.compute_logits(hidden))
    loss = F.cross_entropy(torch.cat(rows)[:-1], torch.tensor(ids[1:]))
    return math.exp(loss.item())


@pytest.fixture(scope="module")
def paragraph(fallback_dir: Path) -> list[int]:
    tokenizer = _tokenizer(fallback_dir)
    ids: list[int] = tokenizer.encode(TEXT)  # type: ignore[attr-defined]
    assert 200 <= len(ids) <= 400
    return ids


@pytest.fixture(scope="module")
def primary_perplexity(real_model_dir: Path, paragraph: list[int]) -> float:
    primary = perplexity(load_model(real_model_dir), paragraph)
    assert 1.0 < primary < 100.0, "the primary itself does not model English"
    return primary


@pytest.fixture(scope="module")
def fallback(fallback_dir: Path) -> LoadedModel:
    return load_model(fallback_dir, quantization=FALLBACK_QUANTIZATION)


def test_fallback_perplexity_within_1_5x_of_the_primary(
    fallback: LoadedModel, paragraph: list[int], primary_perplexity: float
) -> None:
    large = perplexity(fallback, paragraph)
    shown = f"primary float32 {primary_perplexity:.2f}, fallback {large:.2f}"
    print(f"perplexity on {len(paragraph)} tokens: {shown}")
    assert large != primary_perplexity, "the fallback was not quantized"
    assert large <= MAX_PERPLEXITY_RATIO * primary_perplexity


def test_fallback_small_batch_perplexity_within_1_5x_of_the_primary(
    fallback: LoadedModel, paragraph: list[int], primary_perplexity: float
) -> None:
    small = perplexity(fallback, paragraph, MAX_ROWS)
    large = perplexity(fallback, paragraph)
    print(f"perplexity in steps of {MAX_ROWS} tokens: primary {primary_perplexity:.2f}, fallback {small:.2f}")
    assert small != primary_perplexity, "the small batches were not quantized"
    assert small != large, "the small batches took the large batches' path"
    assert small <= MAX_PERPLEXITY_RATIO * primary_perplexity


def test_fallback_answers_paris(fallback_dir: Path) -> None:
    tokenizer = _tokenizer(fallback_dir)
    text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt: list[int] = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    engine = LLMEngine.from_model_dir(
        fallback_dir, EngineConfig(num_blocks=32), quantization=FALLBACK_QUANTIZATION
    )
    assert engine.runner.loaded.quantization == FALLBACK_QUANTIZATION
    (answer,) = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0))
    decoded: str = tokenizer.decode(answer)  # type: ignore[attr-defined]
    assert "Paris" in decoded
