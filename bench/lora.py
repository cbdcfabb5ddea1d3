"""`python -m bench.lora` (`make bench-lora`): what serving LoRA adapters costs the engine.

On `--model` (default SmolLM2-135M-Instruct), CPU, float32, prefix caching off, two engines in this
process: the base model alone (no adapter slots), and the same model with `--adapters` slots holding
as many random rank-`--rank` adapters of every projection (q, k, v, o, gate, up, down), made with PEFT
at the start (random, so every delta is non-zero work), plus one more for the load test. Two
workloads, the two engines alternated within each of `--rounds` rounds, order flipped every round:
`--streams` streams spread over the adapters (stream i through adapter i mod N) against the same
streams on the base, and one stream through one adapter against one on the base; `--prompt-tokens`
random prompt tokens and `--new-tokens` greedy tokens each, EOS ignored; generated tokens/s. Then, per
round, the stall a run-time load causes: `--load-streams` streams decode through all adapters but
one, then the extra adapter is loaded between two steps (as the worker's LoadAdapter runs) and a
stream through it starts (it takes the unused adapter's slot, written before its first step); the
record keeps the longest gap between two step ends across that, in median step times of the steady
steps before it. It writes bench/results/lora-cpu.json with bench/provenance.py's block; the targets'
verdicts are arithmetic on the record (`verdicts`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.provenance import finish_provenance, start_provenance
from bench.stats import DEFAULT_MODEL, make_prompts, save_record, summarize

SIDES = ("base", "adapters")
MANY_STREAMS_TARGET = 0.8
ONE_STREAM_TARGET = 0.85
STALL_TARGET_STEPS = 2.0
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--load-streams", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--json", type=Path, default=Path("bench/results/lora-cpu.json"))
    args = p.parse_args(argv)
    if args.rounds < 5:
        p.error(f"--rounds {args.rounds}: ratios need at least 5 alternated rounds")
    if args.adapters < 2:
        p.error(f"--adapters {args.adapters}: the stall test loads one while the others run")
    return args


def make_adapters(model: Path, count: int, rank: int, directory: Path) -> list[Path]:
    """`count` random PEFT adapters of `model`, saved under `directory`."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    paths = []
    for index in range(count):
        torch.manual_seed(index)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=list(MODULES), init_lora_weights=False
        )
        path = directory / f"adapter{index}"
        peft.get_peft_model(base, config).save_pretrained(str(path))
        paths.append(path)
    return paths


def engines(args: argparse.Namespace, adapters: list[Path]) -> dict[str, Any]:
    from services.worker.engine.config import EngineConfig, LoraConfig
    from services.worker.engine.engine import LLMEngine
    from services.worker.model.loader import load_model

    config = EngineConfig(max_num_seqs=args.streams, enable_prefix_caching=False, num_blocks=1024)
    lora = LoraConfig(max_loras=args.adapters, max_lora_rank=args.rank)
    served = LLMEngine(load_model(args.model), config.model_copy(update={"lora": lora}))
    for index, path in enumerate(adapters[:-1]):  # the last is the one the stall test loads
        served.load_adapter(f"a{index}", path)
    return {"base": LLMEngine(load_model(args.model), config), "adapters": served}


def generate(engine: Any, prompts: list[list[int]], names: list[str], params: Any) -> dict[str, Any]:
    started = time.perf_counter()
    for index, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(f"g{index}", prompt, params, adapter=name)
    tokens = 0
    while engine.has_work():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    elapsed = time.perf_counter() - started
    return {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed}


def alternate(sides: dict[str, Any], count: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    from strata.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    prompts = make_prompts(count, args.prompt_tokens, vocab, set(), seed=count)
    served = sides["adapters"].adapter_names
    names = {"base": [""] * count, "adapters": [served[i % len(served)] for i in range(count)]}
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for round_index in range(args.rounds):
        for side in SIDES if round_index % 2 == 0 else SIDES[::-1]:
            runs[side].append(generate(sides[side], prompts, names[side], params))
            print(
                f"lora: {count} stream(s) round {round_index + 1} {side}: {runs[side][-1]}", file=sys.stderr
            )
    ratios = [a["tok_s"] / b["tok_s"] for b, a in zip(runs["base"], runs["adapters"], strict=True)]
    out: dict[str, Any] = {
        side: {"tok_s": asdict(summarize([r["tok_s"] for r in runs[side]])), "runs": runs[side]}
        for side in SIDES
    }
    return out | {"streams": count, "ratio": asdict(summarize(ratios))}


def load_stall(
    engine: Any, path: Path, args: argparse.Namespace, vocab: int, round_index: int
) -> dict[str, Any]:
    """The longest gap between two step ends while an adapter is loaded and its first stream starts,
    against the median step of the running streams before it."""
    from strata.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    served = engine.adapter_names[:-1]  # one resident adapter unused: the new one takes its slot
    prompts = make_prompts(args.load_streams + 1, args.prompt_tokens, vocab, set(), seed=round_index)
    for index, prompt in enumerate(prompts[:-1]):
        engine.add_request(f"s{round_index}-{index}", prompt, params, adapter=served[index % len(served)])
    ends = [time.perf_counter()]
    while len(ends) < 12:  # past the prefills: steady decode steps
        engine.step()
        ends.append(time.perf_counter())
    steady = [b - a for a, b in zip(ends[-6:], ends[-5:], strict=False)]
    started = time.perf_counter()
    engine.load_adapter("late", path)
    load_s = time.perf_counter() - started
    engine.add_request(f"late{round_index}", prompts[-1], params, adapter="late")
    for _ in range(3):
        engine.step()
        ends.append(time.perf_counter())
    gaps = [b - a for a, b in zip(ends[-4:], ends[-3:], strict=False)]
    while engine.has_work():
        engine.step()
    engine.unload_adapter("late")
    step_s = statistics.median(steady)
    return {
        "step_ms": 1000 * step_s,
        "load_ms": 1000 * load_s,
        "longest_gap_ms": 1000 * max(gaps),
        "longest_gap_steps": max(gaps) / step_s,
    }


def verdicts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target: {"target", "figure", "met"}; ratios by their medians, the stall by its worst round."""
    work = record["workload"]
    lines = []
    for part, bar in (("many_streams", MANY_STREAMS_TARGET), ("one_stream", ONE_STREAM_TARGET)):
        ratio, streams = record[part]["ratio"], record[part]["streams"]
        over = min(streams, work["adapters"])
        lines.append(
            (
                f"{streams} stream(s) over {over} adapter(s): >= {bar}x the base's tokens/s",
                f"{ratio['median']:.2f}x (range {ratio['low']:.2f}-{ratio['high']:.2f})",
                ratio["median"] >= bar,
            )
        )
    gap = record["load_stall"]["longest_gap_steps"]
    lines.append(
        (
            f"a load while {work['load_streams']} streams run: no gap over {STALL_TARGET_STEPS:g} step times",
            f"worst {gap['high']:.2f} (median {gap['median']:.2f}) step times",
            gap["high"] <= STALL_TARGET_STEPS,
        )
    )
    return [{"target": target, "figure": figure, "met": met} for target, figure, met in lines]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    provenance = start_provenance(threads=None)
    with tempfile.TemporaryDirectory(prefix="strata-lora-") as scratch:
        adapters = make_adapters(args.model, args.adapters + 1, args.rank, Path(scratch))
        sides = engines(args, adapters)
        vocab = sides["base"].model_config.vocab_size
        record: dict[str, Any] = {
            "benchmark": "LoRA adapters: the engine serving adapters against the base model alone",
            "provenance": provenance,
            "workload": {
                "model": args.model.name,
                "adapters": args.adapters,
                "rank": args.rank,
                "modules": list(MODULES),
                "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens,
                "rounds": args.rounds,
                "load_streams": args.load_streams,
            },
            "many_streams": alternate(sides, args.streams, args, vocab),
            "one_stream": alternate(sides, 1, args, vocab),
        }
        stalls = [load_stall(sides["adapters"], adapters[-1], args, vocab, i) for i in range(args.rounds)]
        for engine in sides.values():
            engine.close()
    record["load_stall"] = {key: asdict(summarize([s[key] for s in stalls])) for key in stalls[0]}
    finish_provenance(provenance)
    record["targets"] = verdicts(record)
    for line in record["targets"]:
        print(f"lora: {line['target']}: {line['figure']} ({'met' if line['met'] else 'MISSED'})")
    save_record(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
