"""bench.kv_schemes: each scheme rounds as it says, and its rounding reaches every row the cache stores.

The roundings are checked on rows made to show their difference (an outlier channel); the hook on
a real engine (tiny random Llama, Python attention path) must leave greedy tokens exactly as they
are when it rounds nothing, and hand the keys' rounding and the values' one row each per cached
token in every layer, so a hook that missed cache writes could not pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bench.kv_cache import engine
from bench.kv_quality import run_greedy
from bench.kv_schemes import cache_int8_rows, grouped_int8, int8_rows, rounded_outputs
from services.worker.model import kv_format, native
from services.worker.model.loader import load_model
from strata.sampling import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


def _outlier_row() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    row = torch.randn(64, generator=generator) * 0.1
    row[3] = 40.0
    return row


def test_int8_is_a_rows_own_scale_and_groups_keep_their_own_scale() -> None:
    row = _outlier_row()
    stored = kv_format.dequantize_int8(kv_format.quantize_int8(row), torch.float32)
    assert torch.equal(int8_rows(row), stored)
    # The outlier sets the one scale of the row: the other channels round to a coarse grid, while
    # the second group of 32 has a scale of its own.
    plain_error = (int8_rows(row) - row)[32:].abs().max()
    grouped_error = (grouped_int8(row, 32) - row)[32:].abs().max()
    assert grouped_error < plain_error / 10


def test_the_hadamard_scheme_is_the_cache_formats_rows_and_spreads_an_outlier() -> None:
    row = _outlier_row()
    fmt = kv_format.resolve("int8", torch.float32, "cpu")
    assert torch.equal(cache_int8_rows(row), fmt.unpack(fmt.pack(row), torch.float32))
    small = torch.arange(64) != 3
    rotated_error = (cache_int8_rows(row) - row)[small].pow(2).mean()
    assert rotated_error < (int8_rows(row) - row)[small].pow(2).mean() / 4


def test_the_rounding_reaches_every_cache_row(tiny_llama_dir: Path) -> None:
    previous = native.set_enabled(False)
    try:
        loaded = load_model(tiny_llama_dir)
        run = engine(loaded, "float32", 1 << 26, 4, 128)
        prompts = [[5, 9, 13, 2, 7, 11], [3, 3, 8, 1], [20, 4, 17, 6, 6, 9, 1]]
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        reference = [tokens for tokens, _ in run_greedy(run, prompts, params)]
        seen = {"keys": 0, "values": 0}

        def counted(part: str) -> Callable[[torch.Tensor], torch.Tensor]:
            def rounding(rows: torch.Tensor) -> torch.Tensor:
                seen[part] += rows.shape[0]
                return rows

            return rounding

        unchanged = rounded_outputs(run, prompts, params, counted("keys"), counted("values"))
        # The cache's own int8 rows go through the patched pack too: it must reach the product's.
        rotated = rounded_outputs(run, prompts, params, cache_int8_rows, cache_int8_rows)
    finally:
        native.set_enabled(previous)
    assert unchanged == reference, "a rounding that changes nothing must leave every token as it was"
    # Every token the cache holds, in every layer: the prompt and each new token but the last.
    cached = sum(len(prompt) + 12 - 1 for prompt in prompts) * loaded.config.num_hidden_layers
    assert seen == {"keys": cached, "values": cached}
    assert [len(tokens) for tokens in rotated] == [12] * len(prompts)
