"""`python -m bench.kv_schemes` (`make bench-kv-schemes`): which rounding of the KV cache keeps greedy
output, tried before any kernel is written for it.

An int8 cache with one scale per row kept perplexity within 0.1% of float32 yet changed greedy
tokens on some prompts. This asks where that comes from and what mends it, on the engine's own
model, scheduler and Python attention path
(STRATA_NATIVE_KERNELS=off): the engine runs with a float32 cache, and every row written to it is
first rounded as the scheme would store it and read back ("fake quantization"; bench-only, through
a patch of kv_format.KVFormat.pack for the run, never in the product). The schemes:
- `int8`: int8 rows without a rotation (per token and KV head, scale = max |x| / 127, kv_format's
  quantize_int8), keys and values;
- `int8-keys`, `int8-values`: the same on keys alone, values alone;
- `int8-hadamard`: the cache's own int8 rows (kv_format's int8 format: each head's row rotated by
  the normalized Walsh-Hadamard matrix before the rounding, and back on reading), which spreads a
  row's outlying channels over all of them;
- `int8-group32`: one scale per 32 values instead of per row;
- `int8-hadamard-group32`: rotated as the cache's rows are, then one scale per 32 values;
- `bfloat16`: the values rounded to bfloat16.
Each runs the prompts with greedy decoding (EOS ignored) and is judged by bench/kv_quality.py's
agreement against the unrounded float32 run: tokens before the first divergence, and whether each
divergence is a near tie. Prompts: the real-model parity test's eight, and `--text-prompts` more
cut from bench/data's fixed text. It writes bench/results/kv-schemes-cpu.json with bench/provenance.py's
block (it times nothing). This module measures; it must not change the product's formats.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch

from bench.kv_quality import agreement, run_greedy
from bench.model_parity import prompt_ids
from bench.perplexity import read_text, token_ids
from bench.provenance import finish_provenance, start_provenance
from bench.stats import DEFAULT_MODEL, save_record
from services.worker.model import kv_format

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

# KVFormat.pack as the product has it: rounded_outputs patches the class's pack for its runs.
_CACHE_PACK = kv_format.KVFormat.pack
TEXT_PROMPT_TOKENS = 48


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_schemes", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--new-tokens", type=int, default=64)
    # A prompt that diverges early loses all its later tokens: 64 prompts keep one chance near-tie from
    # moving a scheme by more than a point or two.
    p.add_argument("--text-prompts", type=int, default=56, help="prompts cut from bench/data's text")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def int8_rows(rows: Tensor) -> Tensor:
    """int8 rounding with one scale per row and no rotation, stored and read back."""
    return kv_format.dequantize_int8(kv_format.quantize_int8(rows), torch.float32)


def cache_int8_rows(rows: Tensor) -> Tensor:
    """The int8 cache's own rows (rotated where head_dim is a power of two), stored and read back."""
    fmt = kv_format.resolve("int8", torch.float32, "cpu")
    return fmt.unpack(_CACHE_PACK(fmt, rows), torch.float32)


def grouped_int8(rows: Tensor, group: int) -> Tensor:
    """int8 rounding with one scale per `group` consecutive values."""
    grouped = rows.reshape(*rows.shape[:-1], rows.shape[-1] // group, group)
    return int8_rows(grouped).reshape(rows.shape)


def roundings(head_dim: int) -> dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]]:
    """Each scheme's (keys, values) rounding."""
    if not kv_format.rotated(head_dim):
        raise SystemExit(f"bench.kv_schemes: head_dim {head_dim} is not a power of two: no Hadamard rotation")

    def same(rows: Tensor) -> Tensor:
        return rows

    def group32(rows: Tensor) -> Tensor:
        return grouped_int8(rows, 32)

    def rotated_group32(rows: Tensor) -> Tensor:
        return kv_format.hadamard(grouped_int8(kv_format.hadamard(rows), 32))

    def bf16(rows: Tensor) -> Tensor:
        return rows.to(torch.bfloat16).float()

    return {
        "int8": (int8_rows, int8_rows),
        "int8-keys": (int8_rows, same),
        "int8-values": (same, int8_rows),
        "int8-hadamard": (cache_int8_rows, cache_int8_rows),
        "int8-group32": (group32, group32),
        "int8-hadamard-group32": (rotated_group32, rotated_group32),
        "bfloat16": (bf16, bf16),
    }


def rounded_outputs(
    engine: Any,
    prompts: list[list[int]],
    params: Any,
    keys: Callable[[Tensor], Tensor],
    values: Callable[[Tensor], Tensor],
) -> list[list[int]]:
    """Greedy tokens with every cache row rounded on its way in. The attention layer packs a layer's
    keys, then its values (model/attention.py), so the pack calls alternate keys and values."""

    original = kv_format.KVFormat.pack
    calls = [0]

    def pack(self: kv_format.KVFormat, rows: Tensor) -> Tensor:
        rounding = keys if calls[0] % 2 == 0 else values
        calls[0] += 1
        return original(self, rounding(rows.to(torch.float32)))

    with mock.patch.object(kv_format.KVFormat, "pack", pack):
        outputs = [tokens for tokens, _ in run_greedy(engine, prompts, params)]
    if calls[0] == 0 or calls[0] % 2:
        raise SystemExit(
            f"bench.kv_schemes: {calls[0]} cache writes went through KVFormat.pack: the rounding did not "
            "see every key and value row (a native path wrote the cache?)"
        )
    return outputs


def text_prompts(model: Path, count: int) -> list[list[int]]:
    """`count` prompts of TEXT_PROMPT_TOKENS tokens, evenly spaced through the fixed text."""
    ids, _ = token_ids(model, read_text())
    stride = max(TEXT_PROMPT_TOKENS, (len(ids) - TEXT_PROMPT_TOKENS) // max(count, 1))
    starts = range(0, len(ids) - TEXT_PROMPT_TOKENS, stride)
    return [ids[start : start + TEXT_PROMPT_TOKENS] for start in starts][:count]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Before the model loads: the Python attention path is the one every scheme goes through.
    os.environ["STRATA_NATIVE_KERNELS"] = "off"
    torch.set_num_threads(args.threads)
    from bench.kv_cache import engine
    from services.worker.model import native
    from services.worker.model.loader import load_model
    from strata.sampling import SamplingParams

    if native.library() is not None:
        raise SystemExit("bench.kv_schemes: the native kernels loaded although STRATA_NATIVE_KERNELS=off")

    provenance = start_provenance(threads=args.threads)
    loaded = load_model(args.model)
    parity = prompt_ids(args.model)
    prompts = parity + text_prompts(args.model, args.text_prompts)
    longest = max(len(prompt) for prompt in prompts) + args.new_tokens
    run = engine(loaded, "float32", 1 << 30, len(prompts), max(longest, 512))
    reference = run_greedy(
        run, prompts, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, logprobs=2)
    )
    plain = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    schemes: dict[str, Any] = {}
    for name, (keys, values) in roundings(loaded.config.head_dim).items():
        found = agreement(reference, rounded_outputs(run, prompts, plain, keys, values), args.new_tokens)
        schemes[name] = found
        print(
            f"bench.kv_schemes: {name}: {found['agreement']:.1%} of tokens before the first divergence, "
            f"{found['divergences']} divergences, near ties only: {found['every_divergence_a_near_tie']}",
            file=sys.stderr,
            flush=True,
        )
    record = {
        "benchmark": "kv-schemes",
        "timed": False,
        "provenance": finish_provenance(provenance),
        "workload": {
            "model": str(args.model),
            "prompts": len(prompts),
            "parity_prompts": len(parity),
            "text_prompt_tokens": TEXT_PROMPT_TOKENS,
            "new_tokens": args.new_tokens,
            "attention": "python (STRATA_NATIVE_KERNELS=off), float32 cache, rows rounded by the scheme",
        },
        "schemes": schemes,
    }
    save_record(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
