"""The identity of a model's tokenizer and of its weights: sha256s over the files that decide them.

The tokenizer service and every worker compute the tokenizer's from their own copy of the model
folder; the worker refuses a gateway whose tokenizer fingerprint differs, so ids can never be read
with the wrong vocabulary, and the gateway sends a stream to a fallback model only when their
fingerprints agree. The chat template is left out of it: it decides which text a chat becomes, which
the tokenizer service renders before any id exists, and two models of one family may ship the same
vocabulary with templates that differ in a byte (Qwen2.5-Coder 0.5B and 1.5B do, in their tools
section), which must not stop one from continuing the other's ids. The weights' fingerprint roots
every prefix-cache block hash, since the same tokens give other K/V under other weights. This module
must not import torch nor the tokenizers library: both sides only hash files.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

# Everything that changes tokenization, special tokens or the stop ids (tokenizer_config.json without
# its chat_template key).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def tokenizer_fingerprint(model_dir: Path) -> str:
    """sha256 (hex, 64 chars) over the names and bytes of the tokenizer files present in model_dir."""
    digest = hashlib.sha256()
    found = 0
    for name in TOKENIZER_FILES:
        path = model_dir / name
        if not path.is_file():
            continue
        found += 1
        data = path.read_bytes()
        if name == "tokenizer_config.json":
            data = _without_chat_template(data)
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    if found == 0:
        raise FileNotFoundError(
            f"{model_dir} holds none of the tokenizer files {', '.join(TOKENIZER_FILES[:2])}, ...; "
            "point the setting at a model folder (run `strata fetch-model` for the default one)"
        )
    return digest.hexdigest()


def _without_chat_template(data: bytes) -> bytes:
    """tokenizer_config.json's bytes with its chat_template key removed (canonical JSON), or as they
    are when they are not a JSON object (the tokenizer service refuses such a folder itself)."""
    try:
        config = json.loads(data)
    except ValueError:
        return data
    if not isinstance(config, dict):
        return data
    config.pop("chat_template", None)
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


# Enough of each weight file to tell two checkpoints apart without reading every byte at start: the
# safetensors header (every tensor's name, dtype, shape and offsets) and the first and last MiB.
_WEIGHT_SAMPLE_BYTES = 1 << 20


def weights_fingerprint(model_dir: Path) -> str:
    """sha256 (hex) over config.json and each *.safetensors file's size, header, first and last MiB."""
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as file:
            digest.update(file.read(_WEIGHT_SAMPLE_BYTES))
            file.seek(max(0, size - _WEIGHT_SAMPLE_BYTES))
            digest.update(file.read(_WEIGHT_SAMPLE_BYTES))
    return digest.hexdigest()
