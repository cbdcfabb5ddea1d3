"""`python -m bench.prefix_routing`: prefix-aware routing against least-loaded, two replicas, one route.

A spawned stack (tokenizer, two SmolLM2 workers of one thread each, a gateway whose route has both)
takes the shared-system-prompt workload with 4 distinct system prompts (about 512 tokens each):
--requests requests (>= 256) in a random order of the 4 prompts, each with its own short question,
--users at a time, 64 new tokens, no TTFT SLO (this is about where requests go, not admission).
Contestants: prefix routing on (`prefix_routing_tokens` 64, bound 1.25) and off (0: least loaded),
a fresh stack per run, alternated over 3 rounds. Per run: the cache hit rate (prompt blocks the
workers served from cache over cacheable prompt blocks, from their GetWorkerStats), TTFT p50 (the
gateway's `timing.time_to_first_token_ms`), and the load balance: every 0.2 s each worker's running
plus waiting requests, and the largest share over the average while the route holds at least 8 and
requests remain to be sent (the drain after the last one says nothing about routing).
Targets: hit rate >= 0.9 with prefix routing, and no replica above 1.3x the average. This module
must not change anything but prefix_routing_tokens between contestants.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.prefix_workload import ChatTokens, questions
from bench.provenance import finish_provenance, start_provenance
from bench.stats import DEFAULT_MODEL, percentile, save_record
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc

DEFAULT_JSON = Path("bench/results/prefix-routing-cpu.json")
MODEL = "smollm2-135m-instruct"
CONTESTANTS = {"prefix": 64, "least_loaded": 0}
TARGET_HIT_RATE = 0.9
TARGET_BALANCE = 1.3
MIN_LOAD_FOR_BALANCE = 8


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefix_routing", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--users", type=int, default=32, help="requests in flight at once")
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="16 requests, one run: not a valid record")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    return parser


def system_texts(chat: ChatTokens, tokens: int) -> list[str]:
    """4 system prompts of about `tokens` tokens that differ from their first words."""
    body = chat.encode(
        " ".join(f"Rule {i}: be brief, be kind, cite the library's rules." for i in range(200))
    )
    text = str(chat.tokenizer.decode(body[: tokens - 12]))
    return [f"Branch {name} of the library. {text}" for name in "NSEW"]


def write_config(directory: Path, model: Path, prefix_tokens: int) -> Path:
    worker = {
        "model_name": MODEL,
        "model_path": str(model.resolve()),
        "listen": "127.0.0.1:0",
        "device": "cpu",
        "threads": 1,
        "omp_wait_policy": "PASSIVE",
        "max_requests": 64,
        # Two workers on one machine: each plans for a share, since two at the default 0.8 of the
        # available memory over-commit it (the kernel killed one while it loaded).
        "engine": {"max_num_seqs": 64, "max_num_batched_tokens": 512, "memory_utilization": 0.3},
    }
    config = {
        "telemetry": {"log_format": "text", "metrics_listen": "127.0.0.1:0"},
        "tokenizer": {"listen": "127.0.0.1:0", "models": {MODEL: str(model.resolve())}},
        "workers": [worker, dict(worker)],
        "gateway": {
            "listen": "127.0.0.1:0",
            "default_model": MODEL,
            "routes": [
                {
                    "model": MODEL,
                    "ttft_slo_ms": 0,
                    "max_queued_requests": 1024,
                    "max_queued_tokens": 10**6,
                    "prefix_routing_tokens": prefix_tokens,
                }
            ],
        },
    }
    path = directory / f"prefix-routing-{prefix_tokens}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def _stats(stubs: list[Any]) -> list[worker_pb2.GetWorkerStatsResponse]:
    return [await stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=10) for stub in stubs]


async def drive(
    gateway: str, workers: tuple[str, ...], plan: list[tuple[str, str]], args: argparse.Namespace
) -> dict[str, Any]:
    channels = [grpc.aio.insecure_channel(address) for address in workers]
    stubs = [worker_pb2_grpc.WorkerServiceStub(channel) for channel in channels]
    before = await _stats(stubs)
    ttfts: list[float] = []
    failures: list[str] = []
    balance: list[float] = []
    done = asyncio.Event()
    queue = list(reversed(plan))

    async def sample() -> None:
        # Only while requests remain to be sent: then the router is choosing. Once the last is sent,
        # whichever replica finishes its share first drains to zero whatever the routing.
        while not done.is_set() and queue:
            loads = [s.running + s.waiting for s in await _stats(stubs)]
            if sum(loads) >= MIN_LOAD_FOR_BALANCE:
                balance.append(max(loads) / (sum(loads) / len(loads)))
            await asyncio.sleep(0.2)

    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def user() -> None:
            while queue:
                system, question = queue.pop()
                request = gateway_pb2.GenerateRequest(
                    model=MODEL,
                    messages=[
                        common_pb2.ChatMessage(role="system", content=system),
                        common_pb2.ChatMessage(role="user", content=question),
                    ],
                    sampling=common_pb2.SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True),
                )
                try:
                    answer = await stub.Generate(request, timeout=600)
                except grpc.aio.AioRpcError as exc:
                    failures.append(exc.code().name)
                    continue
                ttfts.append(answer.timing.time_to_first_token_ms)

        sampler = asyncio.create_task(sample())
        started = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(args.users)))
        wall = time.perf_counter() - started
        done.set()
        await sampler
    after = await _stats(stubs)
    for channel in channels:
        await channel.close()
    hit = sum(
        a.prefix_cache_hit_blocks - b.prefix_cache_hit_blocks for a, b in zip(after, before, strict=True)
    )
    query = sum(
        a.prefix_cache_query_blocks - b.prefix_cache_query_blocks for a, b in zip(after, before, strict=True)
    )
    served = [
        a.prefix_cache_query_blocks - b.prefix_cache_query_blocks for a, b in zip(after, before, strict=True)
    ]
    return {
        "wall_s": wall,
        "requests_ok": len(ttfts),
        "failures": failures,
        "hit_rate": hit / query if query else 0.0,
        "query_blocks_per_worker": served,
        "ttft_ms_p50": percentile(ttfts, 50) if ttfts else None,
        "ttft_ms_p99": percentile(ttfts, 99) if ttfts else None,
        "max_over_average_load": max(balance) if balance else None,
        "median_over_average_load": statistics.median(balance) if balance else None,
        "balance_samples": len(balance),
    }


def one_run(
    args: argparse.Namespace, contestant: str, plan: list[tuple[str, str]], scratch: Path
) -> dict[str, Any]:
    from strata.cli.launcher import start_stack

    config = write_config(scratch, args.model, CONTESTANTS[contestant])
    stack = start_stack(
        config,
        log_dir=scratch / f"logs-{contestant}-{time.monotonic_ns()}",
        env={"STRATA_GATEWAY_LISTEN": "127.0.0.1:0"},
    )
    try:
        return asyncio.run(drive(stack.addresses.gateway, stack.addresses.workers, plan, args))
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.runs, args.requests, args.users, args.new_tokens = 1, 16, 8, 8
    elif args.runs < 3 or args.requests < 256:
        print("--runs must be >= 3 and --requests >= 256 (use --smoke for a quick try)", file=sys.stderr)
        return 2
    chat = ChatTokens(args.model)
    systems = system_texts(chat, args.system_tokens)
    rng = random.Random(0)
    plan = [(rng.choice(systems), q) for q in questions(args.requests)]
    record: dict[str, Any] = {
        "benchmark": "prefix_routing",
        "provenance": start_provenance(),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rounds": [],
    }
    with tempfile.TemporaryDirectory(prefix="strata-prefix-routing-") as scratch:
        for index in range(args.runs):
            order = list(CONTESTANTS) if index % 2 == 0 else list(CONTESTANTS)[::-1]
            record["rounds"].append({name: one_run(args, name, plan, Path(scratch)) for name in order})
    from bench.prefix_routing_report import finish, table_text, write_plot

    finish(record, args.smoke, TARGET_HIT_RATE, TARGET_BALANCE)
    finish_provenance(record["provenance"])
    save_record(record, args.json)
    write_plot(record, args.json.with_suffix(".png"))
    print(table_text(record))
    return 0 if record["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
