"""Strata's own models: the interface (family.py), the registry of families, the shared decoder and its
layers, the paged KV cache, attention, the loader, quantization and the native kernels.

The package root imports nothing, so `services.worker.model.config` stays importable without torch
(the engine sizes its cache from a config before any tensor exists). Import the submodules directly.
A family is one module (llama, mistral, qwen2, qwen3, gemma3, phi3) plus its line in registry.py.
"""

from __future__ import annotations
