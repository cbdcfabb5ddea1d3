"""The GPU floor: transformers' one decode step at batch B over a static cache, replayed from a CUDA graph.

An engine's steady-state decode throughput is measured against this: B tokens per replay is what the
same model can do when every launch cost is gone and nothing is scheduled. On a CPU the step runs
eagerly (no graphs there), which only serves to check this script before it spends device time.

    python -m bench.cuda_floor --random-weights llama-135m --batch 256 --context 192 --json FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, StaticCache

from bench.baselines import build_random_model
from bench.provenance import finish_provenance, start_provenance
from bench.stats import save_record

if TYPE_CHECKING:
    from collections.abc import Callable


def _step(model: Any, ids: torch.Tensor, cache: StaticCache, position: torch.Tensor) -> torch.Tensor:
    out = model(
        input_ids=ids,
        past_key_values=cache,
        cache_position=position,
        position_ids=position.expand(ids.shape[0], 1),
        use_cache=True,
    )
    logits: torch.Tensor = out.logits
    return logits


def measure_floor(
    model_dir: Path, batch: int, context: int, device: str, dtype: torch.dtype, reps: int
) -> dict[str, Any]:
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).eval()
    cache = StaticCache(config=model.config, max_cache_len=context + 8)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (batch, context), generator=gen).to(device)
        model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(context, device=device))
        ids = torch.randint(0, vocab, (batch, 1), generator=gen).to(device)
        position = torch.tensor([context], device=device)
        replay: Callable[[], object] = lambda: _step(model, ids, cache, position)  # noqa: E731
        graphed = device == "cuda"
        if graphed:
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    _step(model, ids, cache, position)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _step(model, ids, cache, position)
            replay = graph.replay
        times = []
        for _ in range(reps + 2):
            if graphed:
                torch.cuda.synchronize()
            started = time.perf_counter()
            replay()
            if graphed:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    steady = times[2:]
    step_s = statistics.median(steady)
    return {
        "batch": batch,
        "context": context,
        "cuda_graph": graphed,
        "step_ms_median": step_s * 1000,
        "step_ms_min": min(steady) * 1000,
        "step_ms_max": max(steady) * 1000,
        "floor_tok_s": batch / step_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--random-weights", default="llama-135m", help="llama-135m | llama-1b | tiny")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=192, help="cached tokens when the step runs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    provenance = start_provenance(device=args.device)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = build_random_model(args.random_weights, Path(scratch), dtype)
        record = measure_floor(model_dir, args.batch, args.context, args.device, dtype, args.reps)
    record.update(arch=args.random_weights, dtype=args.dtype, provenance=finish_provenance(provenance))
    print(json.dumps(record, indent=2))
    save_record(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
