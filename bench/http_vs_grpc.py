"""`python -m bench.http_vs_grpc` (`make bench-http`): the gateway's front doors on the same
workloads, in one run, alternated: the OpenAI-compatible HTTP API against gRPC, and Anthropic's
Messages API and OpenAI's Responses API against Chat Completions.

One stack is started from a copy of `--config` (both front doors on free ports) whose routes have
admission's TTFT SLO off, so that no request of either is refused. Two workloads, both greedy
with EOS ignored on prompts of exactly `--prompt-tokens` tokens, distinct for every request of the
run (so no contestant gains from the prefix cache): throughput, `--streams` (64) closed-loop streams
of one request each of `--new-tokens` (64), output tokens/s over the level's wall time; and time to
first token, one stream sending `--ttft-requests` (8) requests of `--ttft-new-tokens` (8) back to back,
TTFT p50 (to the first text, as a client of either protocol sees it). gRPC goes through the raw
grpc.aio stub (bench/driver.py), the HTTP APIs through httpx2's async client (bench/http_driver.py):
`http` is /v1/completions with the prompt as it is, `chat` /v1/chat/completions, `messages`
/v1/messages and `responses` /v1/responses (stored, the API's default) with the prompt as one user
message (so all three through the chat template; EOS ignored),
each with its own connections, from this one process, whose CPU time (the client's) is recorded per
level. After a warm-up of each, `--runs` (5) rounds: each runs both workloads, the contestants' order
reversed every other round (G H C M R, R M C H G, ...). Targets: HTTP at least 0.9x gRPC's tokens/s
at `--streams`, and at most 5 ms more TTFT p50 at one stream; Messages and Responses each at least
0.97x Chat Completions' tokens/s and at most 3 ms more TTFT p50; judged on the medians. This module
must not start services other than through bench/session.py.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2

from bench.config_copy import write_config
from bench.driver import make_request, send
from bench.http_driver import (
    body,
    chat_body,
    messages_body,
    responses_body,
    send_http,
    send_messages,
    send_responses,
)
from bench.provenance import finish_provenance, start_provenance
from bench.session import BenchError, gateway, spawned
from bench.stack_prompts import build_prompts, load_tokenizer
from bench.stats import percentile, save_record, summarize
from strata.settings import DEFAULT_CONFIG, read_config

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from bench.driver import RequestResult, Stub
    from bench.stack_prompts import Prompt

PROTOCOLS = ("grpc", "http", "chat", "messages", "responses")
RAW_PROMPT = ("grpc", "http")
"""The contestants whose prompt is the text as it is: their prompt tokens are checked exactly."""
THROUGHPUT_RATIO_TARGET = 0.9
TTFT_DELTA_TARGET_MS = 5.0
MESSAGES_RATIO_TARGET = 0.97
MESSAGES_TTFT_DELTA_TARGET_MS = 3.0
"""Both for the Messages and the Responses API against Chat Completions."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.http_vs_grpc", description=__doc__)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--json", type=Path, default=Path("bench/results/http-vs-grpc-cpu.json"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--ttft-requests", type=int, default=8)
    parser.add_argument("--ttft-new-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="allow --runs 1; the record is not valid")
    args = parser.parse_args(argv)
    if args.runs < 3 and not args.smoke:
        parser.error(f"--runs {args.runs}: at least 3 timed runs (bench/README.md), or --smoke")
    return args


async def closed_loop(
    send_one: Callable[[int], Awaitable[RequestResult]], count: int, concurrency: int
) -> tuple[list[RequestResult], float, float]:
    """`count` requests through `concurrency` streams: the results, the wall time, the client's CPU."""
    pending = iter(range(count))
    results: list[RequestResult] = []

    async def stream() -> None:
        for index in pending:
            results.append(await send_one(index))

    cpu, started = time.process_time(), time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(min(concurrency, count))))
    return results, time.perf_counter() - started, time.process_time() - cpu


def summarize_level(
    results: list[RequestResult],
    wall_s: float,
    cpu_s: float,
    prompts: list[Prompt],
    new_tokens: int,
    raw_prompt: bool = True,
) -> dict[str, Any]:
    """A level's figures; a request counts as mismatched when its output tokens (and, for a raw
    prompt, its prompt tokens: a chat template adds its own) differ from what was sent."""
    ok = [r for r in results if r.status == "OK"]
    mismatched = [
        r.index
        for r in ok
        if r.usage_output_tokens != new_tokens
        or (raw_prompt and r.usage_input_tokens != len(prompts[r.index].token_ids))
    ]
    tokens = sum(r.usage_output_tokens or 0 for r in ok)
    # To the first text on both sides: a gRPC message may carry a token without text (part of a
    # character), which the HTTP API does not send as a chunk of its own.
    ttfts = [r.first_text_s for r in ok if r.first_text_s is not None]
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": sorted({f"{r.status}: {r.message[:120]}" for r in results if r.status != "OK"}),
        "token_mismatches": len(mismatched),
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall_s,
        "ttft_ms_p50": 1000 * percentile(ttfts, 50) if ttfts else None,
        "ttft_ms_p99": 1000 * percentile(ttfts, 99) if ttfts else None,
        "e2e_ms_p50": 1000 * percentile([r.e2e_s for r in ok], 50) if ok else None,
        "client_cpu_s": cpu_s,
        "client_cpu_ms_per_1k_tokens": 1e6 * cpu_s / tokens if tokens else None,
    }


class Contestants:
    """Both front doors of one gateway, each sending one workload's requests."""

    def __init__(self, stub: Stub, client: httpx2.AsyncClient, http_url: str, model: str, args: Any) -> None:
        self._stub, self._client, self._url, self._model, self._args = stub, client, http_url, model, args

    async def level(
        self, protocol: str, prompts: list[Prompt], new_tokens: int, concurrency: int
    ) -> dict[str, Any]:
        timeout = self._args.timeout

        async def one(index: int) -> RequestResult:
            prompt, client, url = prompts[index], self._client, self._url
            if protocol == "grpc":
                request = make_request(prompt, new_tokens, f"bench-{id(prompts)}-{index}", self._model)
                return await send(self._stub, index, request, timeout)
            if protocol == "chat":
                payload = chat_body(prompt.text, new_tokens, self._model, ignore_eos=True)
                return await send_http(client, f"{url}/chat/completions", index, payload, timeout)
            if protocol == "messages":
                payload = messages_body(prompt.text, new_tokens, self._model)
                return await send_messages(client, f"{url}/messages", index, payload, timeout)
            if protocol == "responses":
                payload = responses_body(prompt.text, new_tokens, self._model)
                return await send_responses(client, f"{url}/responses", index, payload, timeout)
            return await send_http(
                client, f"{url}/completions", index, body(prompt, new_tokens, self._model), timeout
            )

        results, wall, cpu = await closed_loop(one, len(prompts), concurrency)
        return summarize_level(results, wall, cpu, prompts, new_tokens, protocol in RAW_PROMPT)


async def run_rounds(endpoints: Any, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    def prompts(tag: str, count: int) -> list[Prompt]:
        return build_prompts(tokenizer, count, args.prompt_tokens, f"http-vs-grpc/{tag}")

    levels: dict[str, dict[str, list[dict[str, Any]]]] = {
        workload: {p: [] for p in PROTOCOLS} for workload in ("throughput", "ttft")
    }
    limits = httpx2.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    async with gateway(endpoints.gateway) as (stub, models), httpx2.AsyncClient(limits=limits) as client:
        contestants = Contestants(stub, client, f"http://{endpoints.http}/v1", models.default_model, args)
        for protocol in PROTOCOLS:  # warm-up: connections, the engine's shapes, both code paths
            warm = await contestants.level(protocol, prompts(f"warm-{protocol}", 8), args.new_tokens, 8)
            if warm["errors"]:
                raise BenchError(f"the {protocol} warm-up failed: {warm['errors']}")
        for index in range(args.runs):
            order = PROTOCOLS if index % 2 == 0 else PROTOCOLS[::-1]
            for protocol in order:
                figures = await contestants.level(
                    protocol, prompts(f"r{index}-{protocol}-tp", args.streams), args.new_tokens, args.streams
                )
                levels["throughput"][protocol].append(figures)
                rate = figures["output_tok_s"]
                print(
                    f"round {index + 1} {protocol} {args.streams} streams: {rate:.1f} tok/s", file=sys.stderr
                )
            for protocol in order[::-1]:
                figures = await contestants.level(
                    protocol,
                    prompts(f"r{index}-{protocol}-ttft", args.ttft_requests),
                    args.ttft_new_tokens,
                    1,
                )
                levels["ttft"][protocol].append(figures)
                print(
                    f"round {index + 1} {protocol} 1 stream: TTFT p50 {figures['ttft_ms_p50']:.1f} ms",
                    file=sys.stderr,
                )
    return {"levels": levels, "default_model": models.default_model}


def verdict(levels: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Medians and spreads per protocol, the ratios and deltas, and whether each target was met."""
    out: dict[str, Any] = {}
    for workload, key in (("throughput", "output_tok_s"), ("ttft", "ttft_ms_p50")):
        for protocol in PROTOCOLS:
            spread = summarize([run[key] for run in levels[workload][protocol]])
            cpu = statistics.median(run["client_cpu_ms_per_1k_tokens"] for run in levels[workload][protocol])
            out[f"{workload}_{protocol}"] = {
                key: spread.median,
                "spread": [spread.low, spread.high],
                "runs": list(spread.values),
                "client_cpu_ms_per_1k_tokens": cpu,
            }
    # The record's names predate the Messages comparison: HTTP against gRPC keeps its bare ones.
    _compare(out, levels, "grpc", "http", "", THROUGHPUT_RATIO_TARGET, TTFT_DELTA_TARGET_MS)
    for other in ("messages", "responses"):
        _compare(
            out, levels, "chat", other, f"{other}_", MESSAGES_RATIO_TARGET, MESSAGES_TTFT_DELTA_TARGET_MS
        )
    return out


def _compare(
    out: dict[str, Any],
    levels: dict[str, dict[str, list[dict[str, Any]]]],
    base: str,
    other: str,
    prefix: str,
    ratio_target: float,
    delta_target_ms: float,
) -> None:
    """`other` against `base` into `out`: the tokens/s ratio (of the medians, and per round), the TTFT
    p50 difference, and whether each target was met (under `prefix`)."""
    base_tp, other_tp = out[f"throughput_{base}"]["output_tok_s"], out[f"throughput_{other}"]["output_tok_s"]
    delta = out[f"ttft_{other}"]["ttft_ms_p50"] - out[f"ttft_{base}"]["ttft_ms_p50"]
    pairs = zip(levels["throughput"][other], levels["throughput"][base], strict=True)
    out[f"{other}_vs_{base}_tok_s"] = other_tp / base_tp
    out[f"{other}_vs_{base}_tok_s_per_round"] = [o["output_tok_s"] / b["output_tok_s"] for o, b in pairs]
    out[f"{other}_minus_{base}_ttft_ms"] = delta
    out[f"{prefix}throughput_target_met"] = other_tp / base_tp >= ratio_target
    out[f"{prefix}ttft_target_met"] = delta <= delta_target_ms


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from services.worker.settings import WorkerSettings

    worker = WorkerSettings.load(args.config, index=0)
    model_dir = Path(worker.model_path)
    tokenizer = load_tokenizer(model_dir)
    provenance = start_provenance(threads=worker.threads)
    log_dir = args.log_dir or Path(f"/tmp/strata-bench-http-{int(time.time())}")
    log_dir.mkdir(parents=True, exist_ok=True)
    # Admission's TTFT SLO off: 64 arrivals at once would otherwise be refused in part, and which ones
    # is up to timing; this measures the front doors, each carrying the whole load.
    routes = [{**route, "ttft_slo_ms": 0} for route in read_config(args.config)["gateway"]["routes"]]
    config = write_config(args.config, log_dir, "http-vs-grpc", {"gateway": {"routes": routes}})
    with spawned(config, log_dir) as endpoints:
        if endpoints.http is None:
            raise BenchError(f"{args.config}'s gateway serves no HTTP API: set gateway.http_listen")
        ran = asyncio.run(run_rounds(endpoints, args, tokenizer))
    levels = ran["levels"]
    errors = [e for w in levels.values() for runs in w.values() for run in runs for e in run["errors"]]
    mismatches = sum(run["token_mismatches"] for w in levels.values() for runs in w.values() for run in runs)
    record = {
        "benchmark": "http_vs_grpc",
        "valid": not errors and not mismatches and not args.smoke,
        "provenance": finish_provenance(provenance),
        "model": ran["default_model"],
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "targets": {
            "http_vs_grpc_tok_s_min": THROUGHPUT_RATIO_TARGET,
            "ttft_delta_ms_max": TTFT_DELTA_TARGET_MS,
            "messages_vs_chat_tok_s_min": MESSAGES_RATIO_TARGET,
            "messages_ttft_delta_ms_max": MESSAGES_TTFT_DELTA_TARGET_MS,
            "responses_vs_chat_tok_s_min": MESSAGES_RATIO_TARGET,
            "responses_ttft_delta_ms_max": MESSAGES_TTFT_DELTA_TARGET_MS,
        },
        "result": verdict(levels),
        "errors": errors,
        "token_mismatches": mismatches,
        "levels": levels,
    }
    save_record(record, args.json)
    result = record["result"]
    print(
        f"tokens/s at {args.streams} streams: http {result['throughput_http']['output_tok_s']:.1f}, "
        f"grpc {result['throughput_grpc']['output_tok_s']:.1f}: {result['http_vs_grpc_tok_s']:.3f}x "
        f"(target >= {THROUGHPUT_RATIO_TARGET}: {'met' if result['throughput_target_met'] else 'MISSED'})\n"
        f"TTFT p50 at 1 stream: http {result['ttft_http']['ttft_ms_p50']:.1f} ms, "
        f"grpc {result['ttft_grpc']['ttft_ms_p50']:.1f} ms: {result['http_minus_grpc_ttft_ms']:+.1f} ms "
        f"(target <= +{TTFT_DELTA_TARGET_MS:g}: {'met' if result['ttft_target_met'] else 'MISSED'})\n"
        + "".join(
            f"{name} against Chat Completions: {result[f'{key}_vs_chat_tok_s']:.3f}x tokens/s "
            f"({'met' if result[f'{key}_throughput_target_met'] else 'MISSED'}), TTFT p50 "
            f"{result[f'{key}_minus_chat_ttft_ms']:+.1f} ms "
            f"({'met' if result[f'{key}_ttft_target_met'] else 'MISSED'})\n"
            for name, key in (("Messages", "messages"), ("Responses", "responses"))
        )
        + f"wrote {args.json}"
    )
    return 0 if record["valid"] or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
