"""`python -m bench.spec` (`make bench-spec`): speculative decoding against none, on the same engine.

On `--model` (default SmolLM2-135M-Instruct), CPU, `--threads` threads, with `--method` (ngram, or
draft with `--draft-model`), two parts:
- one stream: the 32 input-grounded chat prompts of bench/data/spec-prompts.json, one at a time,
  `--new-tokens` greedy tokens each (EOS ends one early), through LLMEngine.generate with
  engine.speculative off and with `--method`; the two alternated within each of `--rounds` rounds,
  order flipped every round; tokens/s over the round's whole run, and whether every text is the
  same token for token;
- many streams: `--streams` streams of bench/engine.py's shape (`--prompt-tokens` random prompt
  tokens, `--many-new-tokens` greedy tokens, EOS ignored), both alternated likewise; `--streams 0`
  leaves this part out (its target is the default model's).
Each run records the engine's speculation counters (drafted, accepted, speculative decodes). Prefix
caching is off, so no round serves another. It writes bench/results/spec-cpu.json with
bench/provenance.py's block; the targets' verdicts are arithmetic on the record (`verdicts`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.provenance import finish_provenance, start_provenance
from bench.stats import DEFAULT_MODEL, make_prompts, print_targets, save_record, summarize

WORKLOAD = Path("bench/data/spec-prompts.json")
MODES = ("off", "on")
# The one-stream speed-up each model must reach, by its folder's name; others are judged by the larger
# model's bar.
ONE_STREAM_TARGETS = {"SmolLM2-135M-Instruct": 1.8, "Qwen2.5-Coder-1.5B-Instruct": 1.5}
OTHER_MODELS_TARGET = 1.5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--method", default="ngram", help="engine.speculative.method of the contestant")
    p.add_argument("--draft-model", type=Path, default=None, help="the draft model's folder (--method draft)")
    p.add_argument(
        "--num-tokens", type=int, default=None, help="engine.speculative.num_tokens (default: its)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument(
        "--streams", type=int, default=64, help="streams of the many-streams part; 0: leave it out"
    )
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--many-new-tokens", type=int, default=64)
    p.add_argument("--json", type=Path, default=Path("bench/results/spec-cpu.json"))
    args = p.parse_args(argv)
    if args.rounds < 5:
        p.error(f"--rounds {args.rounds}: ratios need at least 5 alternated rounds")
    return args


def workload_texts(model: Path) -> list[str]:
    """The shipped prompts, each through the model's chat template with the generation prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = []
    for item in json.loads(WORKLOAD.read_text())["prompts"]:
        chat = [{"role": "user", "content": item["prompt"]}]
        texts.append(str(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)))
    return texts


def workload_ids(model: Path) -> list[list[int]]:
    """The shipped prompts' ids, each through the model's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in workload_texts(model)]


def engine(loaded: Any, speculative: dict[str, Any] | None, max_num_seqs: int) -> Any:
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import LLMEngine

    settings: dict[str, Any] = {
        "max_num_seqs": max_num_seqs,
        "enable_prefix_caching": False,
        "kv_cache_memory_bytes": 1 << 30,
    }
    if speculative is not None:
        settings["speculative"] = speculative
    return LLMEngine(loaded, EngineConfig.model_validate(settings))


def counters(engine: Any) -> tuple[int, int, int]:
    stats = engine.stats()
    return stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_speculative_decodes


def run(engine: Any, prompts: list[list[int]], params: Any, one_at_a_time: bool) -> dict[str, Any]:
    """Generate, timed; the outputs and what speculation did meanwhile."""
    before = counters(engine)
    started = time.perf_counter()
    if one_at_a_time:
        outputs = [engine.generate([prompt], params)[0] for prompt in prompts]
    else:
        outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    drafted, accepted, decodes = (after - was for after, was in zip(counters(engine), before, strict=True))
    tokens = sum(len(out) for out in outputs)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "draft_tokens": drafted,
        "accepted_draft_tokens": accepted,
        "speculative_decodes": decodes,
        "outputs": outputs,
    }


def alternate(
    engines: dict[str, Any], prompts_of: Any, params: Any, rounds: int, one: bool, label: str
) -> dict[str, Any]:
    """Each round runs both engines on the round's prompts, the order flipped every round; outputs
    of the two are compared token for token."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    identical = True
    for index in range(rounds):
        prompts = prompts_of(index)
        order = MODES if index % 2 == 0 else MODES[::-1]
        outputs = {}
        for mode in order:
            result = run(engines[mode], prompts, params, one)
            outputs[mode] = result.pop("outputs")
            runs[mode].append(result)
        identical = identical and outputs["on"] == outputs["off"]
        ratio = runs["on"][-1]["tok_s"] / runs["off"][-1]["tok_s"]
        print(
            f"bench.spec: {label} round {index + 1}/{rounds}: on/off {ratio:.2f}x",
            file=sys.stderr,
            flush=True,
        )
    ratios = [on["tok_s"] / off["tok_s"] for on, off in zip(runs["on"], runs["off"], strict=True)]
    on = runs["on"]
    return {
        mode: {"tok_s": asdict(summarize([r["tok_s"] for r in runs[mode]])), "runs": runs[mode]}
        for mode in MODES
    } | {
        "ratio": asdict(summarize(ratios)),
        "identical_text": identical,
        "acceptance_rate": sum(r["accepted_draft_tokens"] for r in on)
        / max(1, sum(r["draft_tokens"] for r in on)),
        "accepted_per_speculative_decode": sum(r["accepted_draft_tokens"] for r in on)
        / max(1, sum(r["speculative_decodes"] for r in on)),
    }


def two_sides(runs: dict[str, list[dict[str, Any]]], first: str, second: str) -> dict[str, Any]:
    """Two speculating sides' rounds reduced: each side's tokens/s median and spread, its acceptance
    and its runs; the ratio of the first's tokens/s to the second's per round, and its median."""
    out: dict[str, Any] = {}
    for side in (first, second):
        drafted = sum(r["draft_tokens"] for r in runs[side])
        out[side] = {
            "tok_s": asdict(summarize([r["tok_s"] for r in runs[side]])),
            "acceptance_rate": sum(r["accepted_draft_tokens"] for r in runs[side]) / max(1, drafted),
            "runs": runs[side],
        }
    ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(runs[first], runs[second], strict=True)]
    return out | {"ratio": asdict(summarize(ratios))}


def ratio_figure(record: dict[str, Any], first: str, second: str) -> str:
    """two_sides' ratio as a verdict's figure: its median and range, and both sides' tokens/s."""
    ratio = record["ratio"]
    ours, theirs = (record[side]["tok_s"]["median"] for side in (first, second))
    return (
        f"{ratio['median']:.2f}x (range {ratio['low']:.2f}-{ratio['high']:.2f}), "
        f"{ours:.1f} against {theirs:.1f} tokens/s"
    )


def verdicts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target: {"target", "figure", "met"}."""
    one, many = record["one_stream"], record["many_streams"]
    workload = record["workload"]
    bar = ONE_STREAM_TARGETS.get(Path(workload["model"]).name, OTHER_MODELS_TARGET)
    lines = [
        (
            f"one stream, {workload['method']} against off: >= {bar}x tokens/s, identical text",
            f"{one['ratio']['median']:.2f}x (range {one['ratio']['low']:.2f}-{one['ratio']['high']:.2f}), "
            f"identical: {one['identical_text']}, "
            + (
                f"acceptance {100 * one['acceptance_rate']:.0f}%"
                if any(run["draft_tokens"] for run in one["on"]["runs"])
                else "nothing drafted"
            ),
            one["ratio"]["median"] >= bar and one["identical_text"],
        )
    ]
    if many is not None:
        ratio = many["ratio"]
        drafted = sum(r["draft_tokens"] for r in many["on"]["runs"])
        lines.append(
            (
                f"{workload['streams']} streams: >= 0.97x without speculation",
                f"{ratio['median']:.2f}x (range {ratio['low']:.2f}-{ratio['high']:.2f}), "
                f"{drafted} tokens drafted",
                ratio["median"] >= 0.97,
            )
        )
    return [{"target": t, "figure": f, "met": bool(m)} for t, f, m in lines]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from services.worker.model.loader import load_model
    from strata.sampling import SamplingParams

    provenance = start_provenance(threads=args.threads)
    loaded = load_model(args.model)
    speculative: dict[str, Any] = {"method": args.method}
    if args.draft_model is not None:
        speculative["draft_model_path"] = str(args.draft_model)
    if args.num_tokens is not None:
        speculative["num_tokens"] = args.num_tokens
    seqs = max(1, args.streams)
    engines = {"off": engine(loaded, None, seqs), "on": engine(loaded, speculative, seqs)}
    prompts = workload_ids(args.model)
    greedy = SamplingParams(max_new_tokens=args.new_tokens)
    # One untimed prompt each: the first steps pay for allocations the rest reuse.
    for eng in engines.values():
        eng.generate(prompts[:1], SamplingParams(max_new_tokens=16))
    one = alternate(engines, lambda _: prompts, greedy, args.rounds, True, "one stream")
    vocab = loaded.config.vocab_size
    fixed = SamplingParams(max_new_tokens=args.many_new_tokens, ignore_eos=True)

    def random_prompts(index: int) -> list[list[int]]:
        return make_prompts(args.streams, args.prompt_tokens, vocab, set(), seed=index)

    many = (
        alternate(engines, random_prompts, fixed, args.rounds, False, f"{args.streams} streams")
        if args.streams > 0
        else None
    )
    record: dict[str, Any] = {
        "benchmark": "spec",
        "provenance": finish_provenance(provenance),
        "workload": {
            "model": str(args.model),
            "method": args.method,
            "speculative": engines["on"].config.speculative.model_dump(),
            "prompts": str(WORKLOAD),
            "new_tokens": args.new_tokens,
            "streams": args.streams,
            "many_streams_shape": f"{args.streams}x{args.prompt_tokens}+{args.many_new_tokens}"
            if args.streams > 0
            else None,
            "rounds": args.rounds,
            "threads": args.threads,
        },
        "one_stream": one,
        "many_streams": many,
    }
    record["targets"] = verdicts(record)
    save_record(record, args.json)
    print_targets("bench.spec", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
