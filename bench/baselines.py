"""The Hugging Face contestants of the engine benchmark, and the models they run on.

`NaiveGenerate` is transformers `generate`, one request at a time; it also produces the greedy
reference every other contestant is checked against. `HfContinuousBatching` is transformers'
continuous batching (`generate_batch` with a persistent, warmed manager sized to admit every request
at once). `build_random_model` writes a random-weight model of a known shape as safetensors, so GPU
runs need no fetched weights. This module must not time the engine or decide what is reported.
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from bench.stats import REFERENCE_TOP_K, Reference

if TYPE_CHECKING:
    from pathlib import Path

# Shapes of the models the benchmark can fake; "special" is the id range their tokenizers reserve.
RANDOM_ARCHS: dict[str, dict[str, Any]] = {
    "llama-135m": {  # SmolLM2-135M
        "config": {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
            "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
            "rms_norm_eps": 1e-5,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
        },
        "special": range(17),
    },
    "llama-1b": {  # Llama-3.2-1B
        "config": {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "rms_norm_eps": 1e-5,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
        },
        "special": range(128000, 128256),
    },
    "tiny": {  # for smoke tests: builds in well under a second
        "config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "tie_word_embeddings": True,
            "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "rms_norm_eps": 1e-5,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
        },
        "special": range(3),
    },
}

# transformers' model classes do not type-check under mypy --strict (generate() reads as a Tensor).
HFModel: TypeAlias = Any

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_random_model(arch: str, out_dir: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """Write a random-weight model of `arch` to `out_dir` (config.json plus safetensors)."""
    spec = RANDOM_ARCHS[arch]
    config = LlamaConfig(**spec["config"])
    torch.manual_seed(seed)
    model: HFModel = LlamaForCausalLM(config)
    model = model.to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "strata-random-weights.json").write_text(json.dumps({"arch": arch, "seed": seed}))
    return out_dir


def special_token_ids(model_dir: Path, vocab_size: int, arch: str | None) -> set[int]:
    """Ids a random prompt must avoid: the config's bos/eos/pad and the tokenizer's added tokens."""
    excluded: set[int] = set(RANDOM_ARCHS[arch]["special"]) if arch else set()
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        excluded.update(value if isinstance(value, list) else [value] if value is not None else [])
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.exists():
        added = json.loads(tokenizer_file.read_text()).get("added_tokens", [])
        excluded.update(int(token["id"]) for token in added if token.get("special", True))
    return {t for t in excluded if 0 <= t < vocab_size}


def load_hf_model(model_dir: Path, device: str, dtype: torch.dtype) -> HFModel:
    model: HFModel = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def _greedy_config(new_tokens: int, **extra: Any) -> GenerationConfig:
    # eos_token_id=-1 makes EOS an ordinary token: it neither stops a request nor is masked out.
    # min_new_tokens would mask it instead, which changes greedy picks wherever EOS is the argmax.
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=-1,
        pad_token_id=0,
        use_cache=True,
        **extra,
    )


class NaiveGenerate:
    """transformers `generate`, one request after another, greedy, with its KV cache."""

    def __init__(self, model: HFModel, new_tokens: int) -> None:
        self.model = model
        self.new_tokens = new_tokens
        self._plain = _greedy_config(new_tokens)
        self._with_logits = _greedy_config(new_tokens, return_dict_in_generate=True, output_logits=True)

    def _input(self, prompt: list[int]) -> dict[str, torch.Tensor]:
        ids = torch.tensor([prompt], device=self.model.device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    @torch.inference_mode()
    def reference(self, prompts: list[list[int]], batch_size: int = 1) -> Reference:
        """Greedy tokens plus, per position, the top-k token ids and logits.

        `batch_size` > 1 runs several prompts per `generate` call; they all have the same length, so
        there is no padding and the result differs from one-at-a-time only by float rounding.
        """
        tokens, top_ids, top_logits = [], [], []
        for first in range(0, len(prompts), batch_size):
            chunk = prompts[first : first + batch_size]
            ids = torch.tensor(chunk, device=self.model.device)
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=self._with_logits
            )
            # [batch, steps, vocab] -> top-k per (batch, step); only these leave the device.
            logits = torch.stack([step.float() for step in out.logits], dim=1)
            top = torch.topk(logits, REFERENCE_TOP_K, dim=-1)
            tokens.extend(out.sequences[:, ids.shape[1] :].tolist())
            top_ids.extend(top.indices.tolist())
            top_logits.extend(top.values.tolist())
        return Reference(tokens, top_ids, top_logits)

    @torch.inference_mode()
    def run(self, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
        outputs = []
        started = time.perf_counter()
        for prompt in prompts:
            out = self.model.generate(**self._input(prompt), generation_config=self._plain)
            outputs.append(out[0, len(prompt) :].tolist())  # .tolist() waits for the device
        return outputs, time.perf_counter() - started


class HfContinuousBatching:
    """transformers continuous batching with a persistent manager that admits every request at once."""

    def __init__(
        self,
        model: HFModel,
        num_requests: int,
        prompt_tokens: int,
        new_tokens: int,
        max_batch_tokens: int,
        page_size: int = 256,
    ) -> None:
        self.model = model
        self.new_tokens = new_tokens
        self.generation_config = _greedy_config(new_tokens)
        pages_per_request = math.ceil((prompt_tokens + new_tokens) / page_size)
        self.cb_config = ContinuousBatchingConfig(
            page_size=page_size,
            # A quarter more blocks than the workload holds, so no request ever waits for memory.
            num_blocks=math.ceil(num_requests * pages_per_request * 1.25) + 1,
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=num_requests,
            # The timed runs repeat the same prompts: prefix caching would skip their prefill.
            allow_block_sharing=False,
            safety_margin=0.0,
        )
        self.all_admitted_at_once = True

    def describe(self) -> dict[str, Any]:
        cfg = self.cb_config
        return {
            "page_size": cfg.page_size,
            "num_blocks": cfg.num_blocks,
            "max_batch_tokens": cfg.max_batch_tokens,
            "max_requests_per_batch": cfg.max_requests_per_batch,
            "allow_block_sharing": cfg.allow_block_sharing,
            "attn_implementation": self.model.config._attn_implementation,
        }

    @torch.inference_mode()
    def run(self, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
        """All prompts at once; the time runs from submission to the last request's last token."""
        started = time.perf_counter()
        results = self.model.generate_batch(
            inputs=prompts,
            generation_config=self.generation_config,
            continuous_batching_config=self.cb_config,
            persistent_manager=True,
            warmup=True,
        )
        finished = [r for r in results.values() if r.error is None]
        if len(finished) != len(prompts):
            errors = [r.error for r in results.values() if r.error is not None]
            raise RuntimeError(f"hf_cb finished {len(finished)} of {len(prompts)} requests: {errors[:3]}")
        # lifespan[1] is stamped when the last token lands, before the manager's stop and gc.
        last_token = max(r.lifespan[1] for r in finished)
        admitted_by = max(r.lifespan[0] for r in finished)
        self.all_admitted_at_once = self.all_admitted_at_once and admitted_by < min(
            r.lifespan[1] for r in finished
        )
        return [list(r.generated_tokens) for r in finished], last_token - started

    def close(self) -> None:
        self.model.destroy_cached_continuous_batching_manager()
