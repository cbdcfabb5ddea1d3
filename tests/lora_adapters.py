"""LoRA adapters for tests, made with PEFT itself on a base model folder, and their merged references.

`write_adapter` trains nothing: it wraps the base in PEFT with random (not zero) A and B, so an adapter
that were ignored would change nothing and fail every comparison, and saves it in PEFT's own format.
`merged_model` is transformers' model with PEFT's merge of the adapter into the weights: the
reference a served adapter must equal under the parity rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import peft
import torch
from transformers import AutoModelForCausalLM

from services.worker.engine.config import EngineConfig, LoraConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model.loader import load_model
from strata.sampling import SamplingParams

if TYPE_CHECKING:
    from pathlib import Path

NEW_TOKENS = 12
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _base(base_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")


def write_adapter(
    base_dir: Path,
    directory: Path,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    modules: tuple[str, ...] = ALL_MODULES,
    **options: Any,
) -> Path:
    """Save a random rank-`rank` adapter of `modules` for the model in `base_dir` into `directory`."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(modules), init_lora_weights=False, **options
    )
    peft.get_peft_model(_base(base_dir), config).save_pretrained(str(directory))
    return directory


def base_model(base_dir: Path) -> Any:
    """transformers' model of `base_dir` alone, in eval mode: the reference of rows without an adapter."""
    model = _base(base_dir)
    model.eval()
    return model


def merged_model(base_dir: Path, adapter_dir: Path) -> Any:
    """transformers' model of `base_dir` with the adapter merged into its weights by PEFT, in eval mode."""
    merged = peft.PeftModel.from_pretrained(_base(base_dir), adapter_dir).merge_and_unload()
    merged.eval()
    return merged


def lora_engine(model_dir: Path, **lora: Any) -> LLMEngine:
    """An engine of `model_dir` with small test geometry and engine.lora set from `lora`."""
    config = EngineConfig(num_blocks=128, block_size=4, max_num_seqs=16, lora=LoraConfig(**lora))
    return LLMEngine(load_model(model_dir), config)


def run_requests(
    engine: LLMEngine, requests: list[tuple[str, list[int], str]], on_step: Any = None
) -> dict[str, list[int]]:
    """Add every (id, prompt, adapter) at once and step until all finish; each one's new tokens."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for request_id, prompt, adapter in requests:
        engine.validate(prompt, params, adapter)
        engine.add_request(request_id, prompt, params, adapter=adapter)
    tokens: dict[str, list[int]] = {request_id: [] for request_id, _, _ in requests}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if on_step is not None:
            on_step(engine)
    return tokens


def prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(count)
    return [torch.randint(3, 384, (5 + i % 4,), generator=generator).tolist() for i in range(count)]
