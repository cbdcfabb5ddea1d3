"""`python -m bench.perplexity`: our model's perplexity on a fixed text, counted as llama.cpp counts it.

The text is bench/data/perplexity-text.txt (own-written English, about 3,300 SmolLM2 tokens), read
as llama-perplexity's `-f` reads it (one trailing newline dropped) and tokenized by the model's own
tokenizer. The windows are llama-perplexity's default ones (no --ppl-stride): the ids cut into
consecutive chunks of `--context` tokens (the remainder dropped), each evaluated alone from position
0 with an empty cache, its first token replaced by BOS when the tokenizer adds one; only the second
half of each chunk is scored (the logits at positions n/2 .. n-2 against the next tokens), so every
scored token has at least n/2 tokens of context. Perplexity is exp(mean negative log-likelihood) over
all scored tokens. bench/peer.py runs llama-perplexity on the same text and window and checks that
its token ids are these.

Three of our paths are measured: float32; the int8 fallback (dynamic_int8.py) fed `small_linear.
MAX_ROWS` tokens a step, so every projection runs the weight-only int8 small-batch kernel that serves
its decodes; and the same fallback fed a whole chunk a step, so the projections run torch's dynamic
int8 (whole-batch activations quantized) that serves prefill and many-stream decodes. It writes
bench/results/perplexity-cpu.json. This module measures quality only; it must not time anything nor
touch llama.cpp.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.isa_probe import add_cap_option, apply_cap
from bench.stats import DEFAULT_MODEL, save_record

TEXT = Path(__file__).parent / "data" / "perplexity-text.txt"
CONTEXT = 512
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class OurPath:
    """One of our paths: how the model is loaded and how many tokens each forward step takes
    (None: the whole chunk)."""

    quantization: str | None
    step: int | None


def paths() -> dict[str, OurPath]:
    from services.worker.model.dynamic_int8 import DYNAMIC_INT8
    from services.worker.model.small_linear import MAX_ROWS

    return {
        "float32": OurPath(None, None),
        "int8-small-batch": OurPath(DYNAMIC_INT8, MAX_ROWS),
        "int8-dynamic": OurPath(DYNAMIC_INT8, None),
        "stored-small-batch": OurPath(None, MAX_ROWS),
        "stored-whole-chunk": OurPath(None, None),
    }


def read_text(path: Path = TEXT) -> str:
    """The text as llama-perplexity's -f option reads it: one trailing newline removed."""
    return path.read_text(encoding="utf-8").removesuffix("\n")


def token_ids(model_dir: Path, text: str) -> tuple[list[int], int | None]:
    """The text's ids from the model's tokenizer, and the BOS id when that tokenizer adds one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = tokenizer.encode(text)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.encode("a")[:1] == [bos]
    return ids, bos if adds_bos else None


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def windows(ids: list[int], context: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: consecutive, `context` tokens each, the first replaced by BOS."""
    if len(ids) < 2 * context:
        raise SystemExit(
            f"bench.perplexity: {len(ids)} tokens are fewer than 2 x context {context}: lower --context"
        )
    chunks = [ids[start : start + context] for start in range(0, len(ids) - context + 1, context)]
    return [[bos, *chunk[1:]] if bos is not None else chunk for chunk in chunks]


def scored_nll(logits: torch.Tensor, window: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of the window's second half, and how many tokens it scores."""
    first = len(window) // 2
    rows = logits[first : len(window) - 1].double()
    targets = torch.tensor(window[first + 1 :])
    nll = F.cross_entropy(rows, targets, reduction="sum")
    return nll.item(), len(targets)


def window_logits(loaded: Any, window: list[int], step: int | None) -> torch.Tensor:
    """Logits [len(window), vocab] of our model, fed `step` tokens a forward pass from an empty cache."""
    from services.worker.model.attention import AttentionMetadata
    from services.worker.model.kv_cache import KVCache

    blocks = math.ceil(len(window) / BLOCK_SIZE)
    cache = KVCache.allocate(loaded.config, blocks, BLOCK_SIZE, loaded.dtype, torch.device("cpu"))
    size = step or len(window)
    rows = []
    with torch.inference_mode():
        for start in range(0, len(window), size):
            end = min(len(window), start + size)
            meta = AttentionMetadata.build([end - start], [end], [list(range(blocks))], BLOCK_SIZE, "cpu", 0)
            hidden = loaded.model(torch.tensor(window[start:end]), torch.arange(start, end), meta, cache)
            rows.append(loaded.model.compute_logits(hidden))
    return torch.cat(rows)


def perplexity(loaded: Any, chunks: list[list[int]], step: int | None) -> dict[str, Any]:
    total, count = 0.0, 0
    for window in chunks:
        nll, scored = scored_nll(window_logits(loaded, window, step), window)
        total, count = total + nll, count + scored
    return {"perplexity": math.exp(total / count), "mean_nll": total / count, "scored_tokens": count}


def measure(model_dir: Path, names: list[str], context: int, text_path: Path = TEXT) -> dict[str, Any]:
    from services.worker.model.loader import load_model

    ids, bos = token_ids(model_dir, read_text(text_path))
    chunks = windows(ids, context, bos)
    results = {}
    for name in names:
        path = paths()[name]
        loaded = load_model(model_dir, quantization=path.quantization)
        measured = perplexity(loaded, chunks, path.step)
        results[name] = {
            **measured,
            "quantization": path.quantization,
            "tokens_per_step": path.step or context,
        }
        print(f"bench.perplexity: {name} {results[name]['perplexity']:.4f}", file=sys.stderr, flush=True)
    return {
        "text": {
            "path": text_path.name,
            "sha256": hashlib.sha256(text_path.read_bytes()).hexdigest(),
            "tokens": len(ids),
            "token_ids_sha256": ids_digest(ids),
            "bos_replaces_first": bos,
        },
        "window": {"context": context, "chunks": len(chunks), "scored": "second half of each chunk"},
        "paths": results,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.perplexity", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--context", type=int, default=CONTEXT, help="llama-perplexity's -c")
    p.add_argument("--paths", default="float32,int8-small-batch,int8-dynamic")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path)
    add_cap_option(p)
    args = p.parse_args(argv)
    args.paths = args.paths.split(",")
    unknown = [name for name in args.paths if name not in paths()]
    if unknown:
        p.error(f"--paths: unknown {', '.join(unknown)}; choose from {', '.join(paths())}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apply_cap(args.native_isa)
    if args.threads:
        torch.set_num_threads(args.threads)
    from bench.provenance import finish_provenance, start_provenance

    provenance = start_provenance(threads=torch.get_num_threads())
    measured = measure(args.model, args.paths, args.context)
    record = {
        "provenance": finish_provenance(provenance),
        # Quality only: no figure depends on the machine's load.
        "timed": False,
        "benchmark": "bench.perplexity",
        "model": args.model.name,
        **measured,
    }
    save_record(record, args.json)
    for name, result in measured["paths"].items():
        print(f"{name:<18} perplexity {result['perplexity']:.4f} over {result['scored_tokens']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
