"""What a fetched GGUF file becomes in a model folder: kept as shipped, or converted to float32.

`keep_gguf` moves the file into the folder as it is (the worker serves its blocks as stored and reads
its config from the file's metadata, services/worker/model/gguf_file.py) and writes beside it what
the other services read from a folder: the tokenizer files, with the chat template inside
tokenizer_config.json, and generation_config.json, all made by transformers from the file's metadata
alone (no tensor is read, so this takes seconds). `transformers_kwargs` says how transformers opens
either kind of folder (parity references). `convert_gguf` dequantizes every tensor with transformers
and writes a plain Hugging Face folder (config, generation config, tokenizer,
``model.safetensors``): the form the default model, every parity test's reference, is served in.
This module owns those two writers; it must not download, check hashes or write manifests
(model_fetch.py does), nor import torch or transformers at module import time (fetch-model's
already-fetched path must stay fast).
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    Progress = Callable[[str], None]


def transformers_kwargs(model_dir: Path) -> dict[str, str]:
    """transformers' from_pretrained arguments for a model folder: the file of one kept as shipped
    (transformers then dequantizes it), none for a float32 one."""
    kept = sorted(model_dir.glob("*.gguf"))
    return {"gguf_file": kept[0].name} if kept else {}


def _save_tokenizer(gguf: Path, out_dir: Path, max_length: int) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.model_max_length = max_length
    # Keep the chat template inside tokenizer_config.json, where non-transformers readers look.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def keep_gguf(gguf: Path, out_dir: Path, progress: Progress) -> None:
    """Move ``gguf`` into ``out_dir`` as shipped, with tokenizer files and a generation config beside it."""
    from transformers import AutoConfig, GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    progress(f"keeping {gguf.name} as shipped; writing tokenizer files from its metadata")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    _save_tokenizer(gguf, out_dir, config.max_position_embeddings)
    shutil.move(gguf, out_dir / gguf.name)


def _dedupe_tied(state: dict[str, Any]) -> dict[str, Any]:
    # Tied weights (lm_head = embed_tokens) share memory; safetensors refuses aliases, and the
    # config's tie_word_embeddings makes from_pretrained re-tie them, so the first name is enough.
    seen: set[tuple[int, tuple[int, ...]]] = set()
    unique: dict[str, Any] = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        unique[name] = tensor.detach().contiguous()
    return unique


def convert_gguf(gguf: Path, out_dir: Path, progress: Progress) -> None:
    """Dequantize ``gguf`` to float32 and write a Hugging Face model directory into ``out_dir``."""
    progress(f"dequantizing {gguf.name} to float32 (transformers; the longest step)")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress("writing model.safetensors")
    save_file(_dedupe_tied(model.state_dict()), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    # The weights are saved dequantized: a leftover quantization_config would send loaders to GGUF;
    # the GGUF's internal run name is no path of ours.
    for stale_key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, stale_key):
            delattr(config, stale_key)
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    progress("writing tokenizer files")
    _save_tokenizer(gguf, out_dir, config.max_position_embeddings)
