"""Our engine's side of bench.peer, in a process of its own: llama-batched-bench's workload, timed.

For each parallel-stream count it runs `n` seeded prompts of `--prompt-tokens` through LLMEngine at
once, greedy with EOS ignored: once untimed (the warm-up, the same one llama.cpp gets: each shape
once), then timed from submission to the last token, with the prefill and decode phases timed apart
(`phases`). llama-batched-bench counts `ntg` generated tokens after one prefill and `ntg` decode passes
(the prefill's logits are not a generated token there), so the engine is asked for ntg + 1 tokens
and credited with ntg: both sides then run one prefill and ntg decode passes per stream. With
`--check` the warm-up's outputs pass the parity rule against transformers first (float32 only; the
int8 path is held to its quality gate instead). It prints one JSON object; bench/peer.py owns the
rounds and the report. It must not touch the peer.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peer_engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument(
        "--vocab-model",
        type=Path,
        help="the folder whose config.json names the vocabulary and special ids (default: --model; "
        "a GGUF folder has none)",
    )
    p.add_argument("--npl", type=lambda s: [int(v) for v in s.split(",")], required=True)
    p.add_argument("--prompt-tokens", type=int, required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--quantization", choices=["dynamic-int8"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="check the warm-up against transformers")
    return p.parse_args(argv)


def _run(engine: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    from strata.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens + 1, ignore_eos=True)
    engine.reset_step_log()
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    return {
        "outputs": outputs,
        "seconds": elapsed,
        "tok_s": len(prompts) * new_tokens / elapsed,
        **phases(engine.step_log, engine.step_seconds, len(prompts) * len(prompts[0])),
    }


def phases(step_log: list[tuple[int, int]], step_seconds: list[float], prompt_tokens: int) -> dict[str, Any]:
    """The run cut where llama-batched-bench cuts it: the prefill phase is every step up to the last
    one that computes prompt tokens (a step computes more tokens than it samples only then; decodes
    of streams already prefilled may share those steps, and are counted in `prefill_phase_decodes`),
    the decode phase every step after it. Rates are the phase's tokens over its steps' seconds."""
    prefills = [i for i, (tokens, samples) in enumerate(step_log) if tokens > samples]
    cut = prefills[-1] + 1 if prefills else 0
    prefill_seconds, decode_seconds = sum(step_seconds[:cut]), sum(step_seconds[cut:])
    decodes = sum(samples for _, samples in step_log[cut:])
    return {
        "prefill_seconds": prefill_seconds,
        "prefill_tok_s": prompt_tokens / prefill_seconds if prefill_seconds else None,
        "prefill_phase_decodes": sum(tokens for tokens, samples in step_log[:cut]) - prompt_tokens,
        "decode_seconds": decode_seconds,
        "decode_tok_s": decodes / decode_seconds if decode_seconds else None,
        "steps": len(step_log),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from bench.baselines import special_token_ids
    from bench.stats import make_prompts
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import LLMEngine
    from services.worker.model import native

    vocab_model = args.vocab_model or args.model
    vocab = json.loads((vocab_model / "config.json").read_text())["vocab_size"]
    excluded = special_token_ids(vocab_model, vocab, None)
    result: dict[str, Any] = {"native_isa": native.isa(), "streams": {}}
    most = max(args.npl)
    block = EngineConfig().block_size
    per_request = math.ceil((args.prompt_tokens + args.new_tokens + 1) / block)
    # No prefix cache: the timed run repeats the warm-up's prompts, and llama-batched-bench clears its
    # KV memory before each run, so a cache would let only our side skip the prefill.
    config = EngineConfig(
        max_num_seqs=most,
        num_blocks=math.ceil(most * per_request * 1.25) + 1,
        enable_prefix_caching=False,
    )
    engine = LLMEngine.from_model_dir(args.model, config=config, quantization=args.quantization)
    for npl in args.npl:
        prompts = make_prompts(npl, args.prompt_tokens, vocab, excluded, args.seed)
        warm = _run(engine, prompts, args.new_tokens)
        timed = _run(engine, prompts, args.new_tokens)
        entry = {k: v for k, v in timed.items() if k != "outputs"}
        entry["identical_to_warm_up"] = timed["outputs"] == warm["outputs"]
        if args.check:
            entry["parity"] = _parity(args, prompts, warm["outputs"])
        result["streams"][str(npl)] = entry
    json.dump(result, sys.stdout)
    return 0


def _parity(args: argparse.Namespace, prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, Any]:
    from bench.baselines import NaiveGenerate, load_hf_model
    from bench.stats import check_parity

    checked = prompts[:16]
    reference = NaiveGenerate(load_hf_model(args.model, "cpu", torch.float32), args.new_tokens + 1)
    report = check_parity(outputs[: len(checked)], reference.reference(checked, len(checked)))
    summary: dict[str, Any] = report.as_dict()
    summary["median_new_tokens"] = statistics.median(len(o) for o in outputs)
    return summary


if __name__ == "__main__":
    sys.exit(main())
