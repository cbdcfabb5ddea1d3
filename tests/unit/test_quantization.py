"""bitsandbytes int8 and nf4 linear layers: real quantized loading on CPU, close to float32.

bitsandbytes runs on CPU as well as on CUDA, so CI checks the quantized path for real: the decoder's
projections are replaced, the logits stay near the float32 model's, and on the real SmolLM2 a
quantized engine still answers the Paris question.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

import pytest
import torch

from services.worker.model.attention import AttentionMetadata
from services.worker.model.kv_cache import KVCache
from services.worker.model.loader import load_model

if TYPE_CHECKING:
    from pathlib import Path


def _logits(model_dir: Path, quantization: str | None, prompt: list[int]) -> torch.Tensor:
    loaded = load_model(model_dir, quantization=quantization)
    cache = KVCache.allocate(loaded.config, 8, 16, loaded.dtype, torch.device("cpu"))
    meta = AttentionMetadata.build([len(prompt)], [len(prompt)], [[0, 1, 2]], 16, "cpu", num_decodes=0)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes warns on every int8 matmul about its fp16 cast
        hidden = loaded.model(torch.tensor(prompt), torch.arange(len(prompt)), meta, cache)
        return loaded.model.compute_logits(hidden)


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_quantized_model_replaces_projections_and_stays_close(tiny_llama_dir: Path, mode: str) -> None:
    bnb: Any = importlib.import_module("bitsandbytes")

    loaded = load_model(tiny_llama_dir, quantization=mode)
    quantized_type = bnb.nn.Linear8bitLt if mode == "int8" else bnb.nn.Linear4bit
    layer: Any = loaded.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, quantized_type)
    assert isinstance(layer.mlp.down_proj, quantized_type)
    assert loaded.quantization == mode

    prompt = [5, 77, 120, 9, 300, 41, 8, 250]
    full = _logits(tiny_llama_dir, None, prompt)
    quantized = _logits(tiny_llama_dir, mode, prompt)
    assert not torch.equal(full, quantized), "quantization changed nothing"
    # Quantization error, not a broken model: the logits stay strongly correlated with float32's.
    correlation = torch.corrcoef(torch.stack([full.flatten(), quantized.flatten()]))[0, 1]
    assert correlation > 0.9


@pytest.mark.real_model
@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_quantized_real_model_answers_paris(real_model_dir: Path, mode: str) -> None:
    from transformers import AutoTokenizer

    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import LLMEngine
    from strata.sampling import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    engine = LLMEngine.from_model_dir(real_model_dir, EngineConfig(num_blocks=32), quantization=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (answer,) = engine.generate(
            [tokenizer.encode(text, add_special_tokens=False)], SamplingParams(max_new_tokens=12)
        )
    assert "Paris" in tokenizer.decode(answer)
