"""bench.perplexity on a tiny random model: llama-perplexity's windows, and exp(mean NLL) equal to
what transformers computes on the same tokens.

The reference is independent of the module's scoring: transformers' own forward pass over each
window, its log-softmax gathered at the next tokens of each window's second half, averaged over
every scored token. Our model is loaded by the production loader from the same saved checkpoint.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest
import torch

from bench.perplexity import TEXT, perplexity, read_text, windows
from services.worker.model.loader import load_model

if TYPE_CHECKING:
    from pathlib import Path

CONTEXT = 32


def _ids(count: int, vocab: int = 384) -> list[int]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(2, vocab, (count,), generator=generator).tolist()


def test_windows_are_llama_perplexity_chunks_with_bos_first() -> None:
    ids = list(range(100, 200))
    chunks = windows(ids, CONTEXT, bos=None)
    assert len(chunks) == 3 and chunks[1] == ids[32:64]
    with_bos = windows(ids, CONTEXT, bos=1)
    assert [c[0] for c in with_bos] == [1, 1, 1] and with_bos[2][1:] == ids[65:96]
    with pytest.raises(SystemExit, match="lower --context"):
        windows(ids[:63], CONTEXT, None)


def _transformers_perplexity(model_dir: Path, chunks: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for window in chunks:
            logits = model(torch.tensor([window])).logits[0].double()
            first = len(window) // 2
            logp = torch.log_softmax(logits, dim=-1)
            for position in range(first, len(window) - 1):
                total -= logp[position, window[position + 1]].item()
                count += 1
    return math.exp(total / count)


@pytest.mark.parametrize("bos", [None, 1])
def test_perplexity_equals_exp_mean_nll_from_transformers(tiny_llama_dir: Path, bos: int | None) -> None:
    chunks = windows(_ids(100), CONTEXT, bos)
    expected = _transformers_perplexity(tiny_llama_dir, chunks)
    loaded = load_model(tiny_llama_dir)
    whole = perplexity(loaded, chunks, step=None)
    assert whole["scored_tokens"] == 3 * (CONTEXT - CONTEXT // 2 - 1)
    assert whole["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert whole["mean_nll"] == pytest.approx(math.log(expected), rel=1e-4)
    # Fed 8 tokens a step through the KV cache (the small-batch path's feeding), the same model.
    stepped = perplexity(loaded, chunks, step=8)
    assert stepped["perplexity"] == pytest.approx(expected, rel=1e-4)


def test_the_shipped_text_is_long_enough_and_read_as_llama_perplexity_reads_it() -> None:
    raw = TEXT.read_text(encoding="utf-8")
    text = read_text()
    assert text == raw.removesuffix("\n") and "\\" not in text
    # About 3,300 SmolLM2 tokens: at least 2 x 512 needed, 6 chunks of 512 in practice.
    assert len(text.split()) > 2000
