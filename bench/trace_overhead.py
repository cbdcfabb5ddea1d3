"""`python -m bench.trace_overhead`: what tracing costs the whole stack in CPU per request.

Each run starts a fresh stack (tokenizer, workers, gateway: separate processes, `start_stack`) from
the config with a top-level `telemetry:` section: tracing off, or on at sampling 1.0 exporting to an
OTLP receiver in this process. After a warm-up and a settle, a window opens: the CPU time (user +
system, psutil) of every stack process is read, `--requests` greedy EOS-ignored requests go through
the gateway on `--concurrency` closed-loop streams, the stack settles for `--settle-s` (longer than
the services' 5 s span batching, so the window holds their export work too) and the CPU is read
again. Runs alternate off, on, off, on, ... (bench/README.md's rule 7); the record is reduced and
judged in bench/trace_overhead_report.py. The load generator is bench/load.py; this module only
orchestrates, and must not change any service's settings but `telemetry` and its routes' admission:
every route admits the whole run (no TTFT SLO, a queue as long as the run), since a forecast of this
machine's speed refusing part of a burst would make the run invalid, and admission is not what it
measures.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import grpc
import psutil

from bench.config_copy import admit_all
from bench.config_copy import write_config as copy_config
from bench.driver import make_request
from bench.load import run_level, summarize_level
from bench.stack_prompts import build_prompts, load_tokenizer
from bench.trace_overhead_report import MIN_RUNS, RunResult, build_record, format_report
from strata.otlp_receiver import OtlpReceiver
from strata.rpc import MIB, channel_options
from strata.settings import DEFAULT_CONFIG, SettingsError
from strata.v1 import gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Mapping

    from bench.stack_prompts import Prompt

DEFAULTS = {"runs": 5, "requests": 64, "concurrency": 16, "prompt_tokens": 32, "new_tokens": 32}
SMOKE = {"runs": 1, "requests": 4, "concurrency": 2, "prompt_tokens": 16, "new_tokens": 8}
DEFAULT_JSON = Path("bench/results/trace-overhead-cpu.json")
# Longer than the BatchSpanProcessor's default 5 s schedule, so a window's spans are sent within it.
DEFAULT_SETTLE_S = 6.0
# After a window, how long spans still in flight may take to arrive before a traced run is void.
LATE_SPANS_WAIT_S = 15.0


class BenchError(RuntimeError):
    """The benchmark cannot run; the message says why."""


def write_config(
    source: Path, telemetry: Mapping[str, Any], directory: Path, name: str, requests: int
) -> Path:
    """`source` with `telemetry` as its top-level section, routes that admit `requests` at once and
    every path made absolute, in `directory`."""
    return copy_config(
        source, directory, name, {"telemetry": telemetry, "gateway": admit_all(source, requests)}
    )


def cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each process and its descendants (reaped ones included)."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess as exc:
            raise BenchError(f"the stack's {name} (pid {pid}) is gone") from exc
        total = 0.0
        for process in tree:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue  # a short-lived helper that ended just now; its parent's children_* has it
            total += times.user + times.system + times.children_user + times.children_system
        out[name] = total
    return out


def _requests(prompts: list[Prompt], args: argparse.Namespace, tag: str) -> list[gateway_pb2.GenerateRequest]:
    requests = []
    for index, prompt in enumerate(prompts):
        request = make_request(prompt, args.new_tokens, f"{tag}-{index}", args.model)
        request.no_fallback = True  # every run on the primary: a fallback answer costs different CPU
        requests.append(request)
    return requests


async def _window(
    address: str,
    args: argparse.Namespace,
    mode: str,
    index: int,
    prompts: tuple[list[Prompt], list[Prompt]],
    pids: Mapping[str, int],
    receiver: OtlpReceiver,
) -> RunResult:
    """Warm up, settle, then the measured window: load and settle between two CPU readings."""
    warmup, timed = prompts
    progress = not args.no_progress
    async with grpc.aio.insecure_channel(address, options=channel_options(16 * MIB)) as channel:
        stub = cast("gateway_pb2_grpc.GatewayAsyncStub", gateway_pb2_grpc.GatewayStub(channel))
        if warmup:
            requests = _requests(warmup, args, f"warmup-{mode}-{index}")
            await run_level(
                stub, requests, args.concurrency, timeout_s=args.timeout, label="warm-up", progress=progress
            )
        await asyncio.sleep(args.settle_s)
        first_span, started, before = receiver.span_count, time.perf_counter(), cpu_seconds(pids)
        label = f"run {index + 1}/{args.runs} tracing {mode}"
        run = await run_level(
            stub, _requests(timed, args, f"{mode}-{index}"), args.concurrency,
            timeout_s=args.timeout, label=label, progress=progress,
        )  # fmt: skip
        await asyncio.sleep(args.settle_s)
        after, window_s, in_window = cpu_seconds(pids), time.perf_counter() - started, receiver.span_count
    if mode == "on":
        try:
            receiver.wait_for(lambda spans: len(spans) >= first_span + len(timed), LATE_SPANS_WAIT_S)
        except TimeoutError as exc:
            print(f"trace_overhead: {exc}", file=sys.stderr)
    spans = receiver.spans()[first_span:]
    names: dict[str, int] = {}
    for span in spans:
        names[f"{span.service}/{span.name}"] = names.get(f"{span.service}/{span.name}", 0) + 1
    summary = summarize_level(run, [len(p.token_ids) for p in timed], args.new_tokens)
    return RunResult(
        mode=mode,
        index=index,
        requests=len(run.results),
        completed=summary["completed"],
        failures={**summary["refusals"], **summary["errors"]},
        token_mismatches=summary["token_mismatches"],
        cpu_s={name: after[name] - before[name] for name in pids},
        window_s=window_s,
        load_wall_s=run.wall_s,
        spans=len(spans),
        late_spans=len(spans) - (in_window - first_span),
        span_names=names,
    )


def _one_run(
    args: argparse.Namespace,
    mode: str,
    index: int,
    prompts: tuple[list[Prompt], list[Prompt]],
    receiver: OtlpReceiver,
    work_dir: Path,
) -> RunResult:
    from strata.cli.launcher import StackError, start_stack

    telemetry: dict[str, Any] = {"tracing": "off"}
    if mode == "on":
        telemetry = {"tracing": "on", "otlp_endpoint": receiver.endpoint, "sampling_ratio": 1.0}
    config = write_config(args.config, telemetry, work_dir, f"run{index}-{mode}", args.requests)
    log_dir = work_dir / f"run{index}-{mode}-logs"
    try:
        stack = start_stack(
            config,
            env={"STRATA_GATEWAY_LISTEN": "127.0.0.1:0", "STRATA_GATEWAY_HTTP_LISTEN": "127.0.0.1:0"},
            log_dir=log_dir,
        )
    except (StackError, SettingsError) as exc:
        raise BenchError(f"the stack did not start (tracing {mode}): {exc}") from exc
    try:
        return asyncio.run(_window(stack.addresses.gateway, args, mode, index, prompts, stack.pids, receiver))
    finally:
        stack.stop()


def run_benchmark(args: argparse.Namespace) -> int:
    """Every run, alternating off and on, then the record and the table; 1 when the numbers do not count."""
    from bench.provenance import finish_provenance, start_provenance
    from bench.stack_engine import resolve_device
    from bench.stats import save_record
    from services.worker.settings import WorkerSettings

    primary = WorkerSettings.load(args.config, index=0)
    tokenizer = load_tokenizer(Path(primary.model_path))
    seed = f"{args.seed}/{args.prompt_tokens}"
    warmup = build_prompts(tokenizer, args.warmup_requests, args.prompt_tokens, f"{seed}/warmup")
    timed = [
        build_prompts(tokenizer, args.requests, args.prompt_tokens, f"{seed}/r{i}") for i in range(args.runs)
    ]
    provenance = start_provenance(threads=primary.threads, device=resolve_device(primary)[0])
    work_dir = Path(tempfile.mkdtemp(prefix="strata-trace-overhead-"))
    print(f"trace_overhead: configs and service logs in {work_dir}", file=sys.stderr, flush=True)
    runs: list[RunResult] = []
    with OtlpReceiver() as receiver:
        for index in range(args.runs):
            for mode in ("off", "on"):
                runs.append(_one_run(args, mode, index, (warmup, timed[index]), receiver, work_dir))
                receiver.clear()
    finish_provenance(provenance)
    config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    config["primary_worker"] = {"model_path": str(primary.model_path), "threads": primary.threads}
    record = build_record(
        runs, expected_requests=args.requests, smoke=args.smoke, provenance=provenance, config=config
    )
    save_record(record, args.json)
    print(format_report(record))
    if args.json is not None:
        print(f"wrote {args.json}")
    if record["voided"]:
        print("trace_overhead: a run failed its checks: these numbers do not count", file=sys.stderr)
        return 1
    if args.smoke:
        print("trace_overhead: --smoke run: not a valid result", file=sys.stderr)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.trace_overhead", description=__doc__.split("\n")[0]
    )
    for name, default in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default: {default}")
    parser.add_argument(
        "--warmup-requests", type=int, help="untimed requests per run (default: --concurrency)"
    )
    parser.add_argument("--settle-s", type=float, default=DEFAULT_SETTLE_S, help="default: %(default)s")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="stack config (default: local)")
    parser.add_argument("--model", default="", help="GenerateRequest.model (default: the gateway's default)")
    parser.add_argument("--seed", default="0", help="prompt texts' seed (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, s")
    parser.add_argument("--json", type=Path, help=f"the record (default: {DEFAULT_JSON}; none with --smoke)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 1 run each; the record is invalid")
    args = parser.parse_args(argv)
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, SMOKE[name] if args.smoke else default)
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.runs < MIN_RUNS and not args.smoke:
        parser.error(
            f"--runs {args.runs}: at least {MIN_RUNS} runs each (median and spread); --smoke allows 1"
        )
    if args.warmup_requests is None:
        args.warmup_requests = args.concurrency
    if args.warmup_requests < 0 or args.settle_s < 0:
        parser.error("--warmup-requests and --settle-s must be >= 0")
    if args.json is None and not args.smoke:
        args.json = DEFAULT_JSON
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run_benchmark(args)
    except (BenchError, SettingsError, FileNotFoundError) as exc:
        print(f"trace_overhead: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
