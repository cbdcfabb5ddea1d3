"""Logprobs on the real SmolLM2-135M-Instruct agree with log_softmax of transformers' float32 logits.

The tolerance is derived, not guessed: the same test measures our model's logits against
transformers' on the same tokens along the engine's own path (a prefill of the prompt, then one decode
step per token; the float32 parity bound of tests/parity.py, 1e-4, pins that error), and log_softmax
moves by at most twice the largest logit error (the logit's own error plus the log-sum-exp's), plus
float32 rounding of the log-sum-exp itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model.attention import AttentionMetadata
from services.worker.model.kv_cache import KVCache
from strata.sampling import SamplingParams

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.model.family import CausalLM

# Our float32 logits against transformers' (tests/parity.py's assert_logits_close bound).
LOGIT_PARITY = 1e-4
# float32 rounding of a log-sum-exp over 49,152 logits of magnitude ~30.
LSE_ROUNDING = 1e-5


def our_logits(model: CausalLM, prompt: list[int], tokens: list[int], block_size: int = 16) -> torch.Tensor:
    """Our model's float32 logits at every position of prompt + tokens, along the engine's path: one
    prefill of the prompt, then one decode step per token."""
    ids = prompt + tokens
    blocks = -(-len(ids) // block_size)
    cache = KVCache.allocate(model.config, blocks, block_size, model.dtype, model.device)
    table = [list(range(blocks))]
    rows: list[torch.Tensor] = []
    with torch.inference_mode():
        for start, end in [(0, len(prompt)), *((n, n + 1) for n in range(len(prompt), len(ids) - 1))]:
            meta = AttentionMetadata.build(
                query_lens=[end - start],
                context_lens=[end],
                block_tables=table,
                block_size=block_size,
                device=model.device,
                num_decodes=0 if start == 0 else 1,
            )
            hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), meta, cache)
            rows.append(model.compute_logits(hidden).float())
    return torch.cat(rows)


@pytest.mark.real_model
def test_logprobs_agree_with_transformers_log_softmax(real_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    prompt = tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    engine = LLMEngine.from_model_dir(real_model_dir, EngineConfig(num_blocks=64, block_size=16))
    params = SamplingParams(
        max_new_tokens=16, temperature=0.7, top_p=0.9, seed=3, logprobs=5, prompt_logprobs=5, ignore_eos=True
    )
    engine.validate(prompt, params)
    engine.add_request("r", prompt, params)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    tokens = [t for o in outputs for t in o.new_token_ids]
    sampled = [lp for o in outputs for lp in (o.logprobs or [])]
    prompt_lps = outputs[0].prompt_logprobs
    assert prompt_lps is not None and len(sampled) == len(tokens) == 16

    hf = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    ids = prompt + tokens
    with torch.inference_mode():
        ref_logits = hf(torch.tensor([ids])).logits[0].float()
    # The measured logit error of our model against transformers on these very tokens.
    ours = our_logits(engine.runner.model, prompt, tokens)
    logit_error = float((ours - ref_logits[: len(ids) - 1]).abs().max())
    assert logit_error <= LOGIT_PARITY, f"our float32 logits differ from transformers' by {logit_error:.3g}"
    tolerance = 2 * logit_error + LSE_ROUNDING
    ref = torch.log_softmax(ref_logits, dim=-1)
    # Position p's logits predict token p + 1: prompt positions first, then each sampled token's.
    positions = [*prompt_lps, *sampled]
    assert [lp.token_id for lp in positions] == ids[1:]
    worst = 0.0
    for p, lp in enumerate(positions):
        worst = max(worst, abs(lp.logprob - float(ref[p, lp.token_id])))
        top = ref[p].topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist() or torch.allclose(
            torch.tensor([v for _, v in lp.top]), top.values, atol=tolerance
        ), f"position {p}: top-5 differs beyond a near tie"
        for token, value in lp.top:
            worst = max(worst, abs(value - float(ref[p, token])))
    assert worst <= tolerance, f"logprob error {worst:.3g} > {tolerance:.3g} (logit error {logit_error:.3g})"
