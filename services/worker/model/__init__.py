"""Strata's own Llama-family model: config, paged KV cache, attention, layers, loader, quantization.

The package root imports nothing, so `services.worker.model.config` stays importable without torch
(the engine sizes its cache from a config before any tensor exists). Import the submodules directly:
`config`, `kv_cache`, `attention`, `rope`, `layers`, `llama`, `loader`, `quant`.
"""

from __future__ import annotations
