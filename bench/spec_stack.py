"""`python -m bench.spec_stack` (`make bench-spec-stack`): speculative decoding through the whole
stack, over the HTTP API, against the same engine in this process.

A stack is started from `--config` with every worker speculating by `--method` and its prefix cache
off (the environment's STRATA_WORKER_ENGINE__* overrides, which this process's engine reads too, so
both run the first worker's engine settings). Each round sends bench/data/spec-prompts.json's 32
prompts one at a time as chat completions (/v1/chat/completions, one user message, greedy,
`--new-tokens` at most, EOS ends one early, streamed with `include_usage`), and runs the same prompts
(the chat template applied here) one at a time through the in-process engine while the stack sits
idle; the two alternate, the order flipped every round. Figures: each side's generated tokens over
the round's wall time, the ratio per round, acceptance (the HTTP usage's accepted and rejected
prediction tokens; the engine's counters), and how many texts equal the engine's tokens decoded.
Target: the stack at least 0.9x the engine. It writes bench/results/spec-stack-cpu.json with
bench/provenance.py's block. This module must not start services other than through
bench/session.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2

from bench.http_driver import chat_body, send_http
from bench.provenance import finish_provenance, start_provenance
from bench.session import BenchError, gateway, spawned
from bench.stack_prompts import load_tokenizer
from bench.stats import print_targets, save_record
from strata.settings import DEFAULT_CONFIG

if TYPE_CHECKING:
    from bench.stack_engine import EngineBaseline

SIDES = ("engine", "stack")
RATIO_TARGET = 0.9


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.spec_stack", description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--method", default="ngram", help="engine.speculative.method of every worker")
    p.add_argument("--draft-model", type=Path, default=None, help="the draft model's folder (--method draft)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, s")
    p.add_argument("--log-dir", type=Path, default=None, help="where the services write their logs")
    p.add_argument("--json", type=Path, default=Path("bench/results/spec-stack-cpu.json"))
    args = p.parse_args(argv)
    if args.rounds < 5:
        p.error(f"--rounds {args.rounds}: ratios need at least 5 alternated rounds")
    return args


def speculate_everywhere(args: argparse.Namespace) -> None:
    """The workers' engine settings, as environment overrides the stack and this process both read."""
    os.environ["STRATA_WORKER_ENGINE__SPECULATIVE__METHOD"] = args.method
    os.environ["STRATA_WORKER_ENGINE__ENABLE_PREFIX_CACHING"] = "false"
    if args.draft_model is not None:
        os.environ["STRATA_WORKER_ENGINE__SPECULATIVE__DRAFT_MODEL_PATH"] = str(args.draft_model.resolve())


def engine_round(engine: EngineBaseline, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """The prompts one at a time through the engine: tokens/s over the round, drafts, the outputs."""
    from bench.spec import run
    from strata.sampling import SamplingParams

    return run(engine.engine, prompts, SamplingParams(max_new_tokens=new_tokens), one_at_a_time=True)


async def stack_round(
    client: httpx2.AsyncClient, url: str, model: str, texts: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """The prompts one at a time over HTTP: tokens/s over the round, drafts, the texts received."""
    started = time.perf_counter()
    results = []
    for index, text in enumerate(texts):
        result = await send_http(client, url, index, chat_body(text, args.new_tokens, model), args.timeout)
        if result.status != "OK":
            raise BenchError(f"prompt {index} failed over HTTP: {result.status} {result.message[:200]}")
        results.append(result)
    seconds = time.perf_counter() - started
    tokens = sum(r.usage_output_tokens or 0 for r in results)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "draft_tokens": sum(r.draft_tokens for r in results),
        "accepted_draft_tokens": sum(r.accepted_draft_tokens for r in results),
        "texts": [r.text for r in results],
        "counts": [r.usage_output_tokens for r in results],
    }


async def rounds(
    engine: EngineBaseline, model_dir: Path, endpoints: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """Every round, both sides alternated; the engine runs while the stack has nothing in flight."""
    from bench.spec import WORKLOAD, workload_ids

    texts = [item["prompt"] for item in json.loads(WORKLOAD.read_text())["prompts"]]
    prompts = workload_ids(model_dir)
    tokenizer = load_tokenizer(model_dir)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    same = compared = 0
    url = f"http://{endpoints.http}/v1/chat/completions"
    async with gateway(endpoints.gateway) as (_, models), httpx2.AsyncClient() as client:
        model = models.default_model
        # Untimed: the first steps' allocations, the connection, both code paths.
        engine_round(engine, prompts[:1], 16)
        await stack_round(
            client, url, model, texts[:1], argparse.Namespace(**{**vars(args), "new_tokens": 16})
        )
        for index in range(args.rounds):
            order = SIDES if index % 2 == 0 else SIDES[::-1]
            found: dict[str, dict[str, Any]] = {}
            for side in order:
                if side == "engine":
                    found[side] = engine_round(engine, prompts, args.new_tokens)
                else:
                    found[side] = await stack_round(client, url, model, texts, args)
            outputs, received = found["engine"].pop("outputs"), found["stack"].pop("texts")
            counts = found["stack"].pop("counts")
            for ids, text, count in zip(outputs, received, counts, strict=True):
                compared += 1
                same += int(count == len(ids) and tokenizer.decode(ids, skip_special_tokens=True) == text)
            for side in SIDES:
                runs[side].append(found[side])
            ratio = found["stack"]["tok_s"] / found["engine"]["tok_s"]
            print(
                f"bench.spec_stack: round {index + 1}/{args.rounds}: stack/engine {ratio:.2f}x",
                file=sys.stderr,
            )
    return {"runs": runs, "identical": same, "compared": compared}


def figures(found: dict[str, Any]) -> dict[str, Any]:
    """Per side: tokens/s median and spread, acceptance; the ratio per round and its median."""
    from bench.spec import two_sides

    texts = {"texts_identical": found["identical"], "texts_compared": found["compared"]}
    return two_sides(found["runs"], "stack", "engine") | texts


def verdicts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The one target: {"target", "figure", "met"}."""
    from bench.spec import ratio_figure

    ratio = record["ratio"]
    figure = (
        f"{ratio_figure(record, 'stack', 'engine')}, "
        f"texts identical {record['texts_identical']}/{record['texts_compared']}"
    )
    target = f"one stream over HTTP, {record['workload']['method']}: >= {RATIO_TARGET}x the engine's speed"
    return [{"target": target, "figure": figure, "met": ratio["median"] >= RATIO_TARGET}]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    speculate_everywhere(args)
    from bench.stack_engine import EngineBaseline
    from services.worker.settings import WorkerSettings

    settings = WorkerSettings.load(args.config, index=0)
    # Before torch loads (bench.spec imports it): the engine takes the worker's OpenMP wait policy.
    engine = EngineBaseline(settings, settings.threads)
    from bench.spec import WORKLOAD

    provenance = start_provenance(threads=engine.threads)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="strata-bench-logs-"))
    print(f"bench.spec_stack: starting the stack of {args.config} (logs in {log_dir})", file=sys.stderr)
    try:
        with spawned(args.config, log_dir) as endpoints:
            found = asyncio.run(rounds(engine, Path(settings.model_path), endpoints, args))
    except BenchError as exc:
        print(f"bench.spec_stack: error: {exc}", file=sys.stderr)
        return 1
    record: dict[str, Any] = {
        "benchmark": "spec-stack",
        "provenance": finish_provenance(provenance),
        "workload": {
            "config": str(args.config),
            "model": str(settings.model_path),
            "method": args.method,
            "engine": engine.describe(),
            "prompts": str(WORKLOAD),
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
        },
        **figures(found),
    }
    record["targets"] = verdicts(record)
    save_record(record, args.json)
    print_targets("bench.spec_stack", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
