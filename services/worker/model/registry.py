"""The registry of model families: a checkpoint's `architectures` -> the family module that serves it.

This module owns the one table of families and the lookups through it: which family a config.json
names (by `architectures`, else `model_type`), its ModelConfig, and the list of what is supported for
error messages. Adding a family is one module (config, checkpoint names, state dict) plus one line in
FAMILIES. It must not hold any family's logic nor read weights (the loader does).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.worker.model import gemma3, llama, mistral, phi3, qwen2, qwen3
from services.worker.model.config import ModelLoadError, read_config

if TYPE_CHECKING:
    from services.worker.model.config import ModelConfig
    from services.worker.model.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
)
SUPPORTED_ARCHITECTURES = tuple(arch for family in FAMILIES for arch in family.architectures)


def family_of(raw: dict[str, Any]) -> Family:
    """The family a parsed config.json names, or a ModelLoadError that lists the supported ones."""
    architectures = raw.get("architectures") or []
    for family in FAMILIES:
        if architectures and str(architectures[0]) in family.architectures:
            return family
        if not architectures and raw.get("model_type") in family.model_types:
            return family
    named = str(architectures[0]) if architectures else f"<none; model_type={raw.get('model_type')!r}>"
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    raise ModelLoadError(f"architecture {named} is not supported; supported architectures: {supported}")


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a parsed config.json, read by its family."""
    return family_of(raw).config(raw)


def load_config(model_dir: str | Path) -> tuple[Family, ModelConfig]:
    """The family and ModelConfig of a model directory (config.json plus generation_config.json)."""
    raw = read_config(Path(model_dir))
    family = family_of(raw)
    return family, family.config(raw)
