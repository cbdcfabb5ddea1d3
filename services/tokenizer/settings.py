"""Settings of the tokenizer service: where it listens and which model folders it tokenizes for.

Read once at start through strata.settings (YAML section `tokenizer`, then STRATA_TOKENIZER_*
variables). This module must not load tokenizers nor touch the network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import field_validator
from pydantic_settings import SettingsConfigDict

from strata.rpc import MIB
from strata.settings import ServiceSettings, resolve_path


class TokenizerSettings(ServiceSettings):
    """The tokenizer service's settings."""

    model_config = SettingsConfigDict(env_prefix="STRATA_TOKENIZER_")
    section: ClassVar[str] = "tokenizer"

    listen: str = "127.0.0.1:0"
    """host:port to serve on; port 0 takes a free one (announced with --announce-file)."""
    models: dict[str, Path]
    """Model name -> the model folder holding its tokenizer files."""
    max_message_bytes: int = 16 * MIB
    """Largest request or response message."""
    max_batch_entries: int = 4096
    """Most entries in one Tokenize or Detokenize call."""
    shutdown_grace_s: float = 5.0
    """On SIGTERM or SIGINT, how long calls in flight may take to finish before the service exits."""

    @field_validator("models")
    @classmethod
    def _some_models(cls, value: dict[str, Path]) -> dict[str, Path]:
        if not value:
            raise ValueError(
                "must name at least one model, e.g. {smollm2-135m-instruct: models/SmolLM2-135M-Instruct}"
            )
        return value

    @classmethod
    def resolve_nested_paths(cls, data: dict[str, Any], base: Path) -> dict[str, Any]:
        models = data.get("models")
        if isinstance(models, dict):
            data["models"] = {name: resolve_path(path, base) for name, path in models.items()}
        return data
