"""`strata bench`: its pure parts (percentiles, token timing, prompts of exact length, the summaries and the
verdict, options, plots), then smoke runs against a real stack of tiny models started by the launcher."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch

from bench.driver import RequestResult, make_request, token_timing
from bench.load import LevelRun, run_level, summarize_level
from bench.options import resolve
from bench.plots import write_plots
from bench.provenance import start_provenance
from bench.stack import add_arguments, main
from bench.stack_prompts import build_prompt, build_prompts, load_tokenizer
from bench.stack_report import aggregate_levels, judge
from bench.stats import percentile
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from pathlib import Path

NEW_TOKENS = 8


def test_percentile_matches_numpy_linear_interpolation() -> None:
    rng = random.Random(0)
    for size in (1, 2, 7, 100):
        values = [rng.uniform(0, 10) for _ in range(size)]
        for q in (0, 50, 95, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    with pytest.raises(ValueError, match="at least one"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_token_timing_spreads_a_coalesced_message_over_its_tokens() -> None:
    # sent at 10.0; messages at 10.5 (1 token), 10.6 (1), 10.9 (3), 11.0 (text only), 11.2 (1)
    arrivals = [(10.5, 1), (10.6, 1), (10.9, 3), (11.0, 0), (11.2, 1)]
    ttft, gaps = token_timing(10.0, arrivals)
    assert ttft == pytest.approx(0.5)
    assert gaps == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.3])
    # One gap per token after the first: the tokens sharing the first message have none.
    ttft, gaps = token_timing(0.0, [(0.2, 3), (0.5, 2)])
    assert ttft == pytest.approx(0.2)
    assert gaps == pytest.approx([0.15, 0.15])
    assert token_timing(0.0, [(0.3, 0)]) == (None, [])


def _result(index: int, status: str = "OK", tokens: int = NEW_TOKENS, **usage: int) -> RequestResult:
    return RequestResult(
        index=index,
        status=status,
        ttft_s=0.1 * (index + 1) if status == "OK" else None,
        e2e_s=1.0,
        itl_s=[0.01] * (tokens - 1) if status == "OK" else [],
        token_ids=list(range(tokens)),
        usage_input_tokens=usage.get("input", 16) if status == "OK" else None,
        usage_output_tokens=usage.get("output", tokens) if status == "OK" else None,
    )


def test_level_summary_counts_refusals_errors_and_token_mismatches() -> None:
    results = [
        _result(0),
        _result(1),
        _result(2, input=15),  # the stack tokenized the prompt differently
        _result(3, tokens=NEW_TOKENS - 1, output=NEW_TOKENS),  # streamed fewer tokens than usage says
        _result(4, "RESOURCE_EXHAUSTED", tokens=0),
        _result(5, "UNAVAILABLE", tokens=3),  # failed mid-stream: its tokens still count as output
    ]
    summary = summarize_level(LevelRun(4, 2.0, results), [16] * 6, NEW_TOKENS)
    assert summary["requests"] == 6
    assert summary["completed"] == 4
    assert summary["refusals"] == {"RESOURCE_EXHAUSTED": 1}
    assert summary["errors"] == {"UNAVAILABLE": 1}
    assert summary["token_mismatches"] == 2
    assert [m["request"] for m in summary["token_mismatch_examples"]] == [2, 3]
    assert summary["output_tokens"] == 3 * NEW_TOKENS + NEW_TOKENS - 1 + 3
    assert summary["output_tok_s"] == pytest.approx(summary["output_tokens"] / 2.0)
    assert summary["requests_per_s"] == pytest.approx(2.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(250.0)  # of 100, 200, 300, 400 ms
    assert summary["itl_ms"]["p99"] == pytest.approx(10.0)


def test_levels_report_the_acceptance_of_the_drafts_their_requests_usage_counted() -> None:
    def drafted(index: int, drafts: int, kept: int, status: str = "OK") -> RequestResult:
        result = _result(index, status)
        result.draft_tokens, result.accepted_draft_tokens = drafts, kept
        return result

    # A failed request's drafts are not its usage's: only completed requests count.
    first = summarize_level(
        LevelRun(1, 1.0, [drafted(0, 10, 6), drafted(1, 4, 4), drafted(2, 9, 9, "UNAVAILABLE")]),
        [16] * 3,
        NEW_TOKENS,
    )
    second = summarize_level(LevelRun(1, 1.0, [drafted(0, 6, 2)]), [16], NEW_TOKENS)
    assert (first["draft_tokens"], first["accepted_draft_tokens"]) == (14, 10)
    assert aggregate_levels([[first], [second]])[0]["acceptance"] == pytest.approx(12 / 20)
    plain = summarize_level(LevelRun(1, 1.0, [_result(0)]), [16], NEW_TOKENS)
    assert aggregate_levels([[plain]])[0]["acceptance"] is None


def test_a_level_where_everything_failed_has_no_latencies() -> None:
    summary = summarize_level(LevelRun(1, 1.0, [_result(0, "UNAVAILABLE", tokens=0)]), [16], NEW_TOKENS)
    assert summary["ttft_ms"] == {"p50": None, "p95": None, "p99": None}
    assert summary["output_tok_s"] == 0.0


def test_prompts_have_exactly_the_asked_tokens_and_differ(tiny_serving_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_serving_dir)
    for tokens in (1, 2, 5, 16, 64, 200):
        # A tiny vocabulary has few one- or two-token texts: distinct prompts need some length.
        prompts = build_prompts(tokenizer, 6 if tokens >= 5 else 1, tokens, seed=f"t{tokens}")
        for prompt in prompts:
            assert len(prompt.token_ids) == tokens, prompt.text
            assert list(prompt.token_ids) == tokenizer.encode(prompt.text).ids
        assert len({p.text for p in prompts}) == len(prompts)
    again = build_prompts(tokenizer, 6, 64, seed="t64")
    assert [p.text for p in again] == [p.text for p in build_prompts(tokenizer, 6, 64, seed="t64")]
    assert again[0].text != build_prompts(tokenizer, 1, 64, seed="other")[0].text
    with pytest.raises(ValueError, match=">= 1"):
        build_prompt(tokenizer, 0, random.Random(0))


@pytest.mark.real_model
def test_prompts_have_exact_lengths_with_the_real_tokenizer(real_model_dir: Path) -> None:
    tokenizer = load_tokenizer(real_model_dir)
    prompts = build_prompts(tokenizer, 64, 64, seed="real")
    assert {len(p.token_ids) for p in prompts} == {64}
    assert len({p.token_ids[:4] for p in prompts}) > 48, "prompts should not share prefixes"


def _level(concurrency: int, tok_s: float, ttft_s: float) -> dict[str, Any]:
    results = [_result(0)]
    results[0].ttft_s = ttft_s
    return summarize_level(LevelRun(concurrency, NEW_TOKENS / tok_s, results), [16], NEW_TOKENS)


def test_rounds_reduce_to_medians_and_the_verdict_uses_them() -> None:
    rounds = [
        [_level(1, 10.0, 0.100), _level(64, 100.0, 1.0)],
        [_level(1, 12.0, 0.130), _level(64, 90.0, 1.0)],
        [_level(1, 11.0, 0.110), _level(64, 95.0, 1.0)],
    ]
    levels = aggregate_levels(rounds)
    assert [level["concurrency"] for level in levels] == [1, 64]
    assert levels[1]["output_tok_s"] == pytest.approx(95.0)
    assert levels[1]["output_tok_s_spread"] == pytest.approx([90.0, 100.0])
    assert levels[0]["ttft_ms"]["p50"] == pytest.approx(110.0)
    assert len(levels[0]["runs"]) == 3

    engine = {
        "concurrency": 64,
        "tok_s": 100.0,
        "tok_s_runs": [100.0, 100.0, 100.0],
        "ttft_p50_ms": 100.0,
        "ttft_p50_ms_runs": [100.0, 100.0, 100.0],
    }
    verdict = judge(levels, engine)
    assert verdict["throughput_ratio"] == pytest.approx(0.95)
    assert verdict["throughput_ratio_runs"] == pytest.approx([1.0, 0.9, 0.95])
    assert verdict["throughput_pass"] is True
    assert verdict["ttft_ratio"] == pytest.approx(1.1)
    assert verdict["ttft_pass"] is True
    assert verdict["pass"] is True
    slow = judge(levels, {**engine, "tok_s": 120.0, "ttft_p50_ms": 80.0})
    assert slow["throughput_pass"] is False
    assert slow["ttft_pass"] is False
    assert slow["pass"] is False


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_options_take_smoke_sizes_and_enforce_three_runs(tmp_path: Path) -> None:
    args = _parse("--smoke", "--json", str(tmp_path / "r.json"))
    assert resolve(args) is None
    assert args.concurrency == (1, 4)
    assert args.runs == 1
    assert args.plot == tmp_path / "r.png"
    args = _parse("--concurrency", "64,1,8,8")
    assert resolve(args) is None
    assert args.concurrency == (1, 8, 64)
    assert (args.prompt_tokens, args.new_tokens, args.runs) == (64, 64, 3)
    problem = resolve(_parse("--runs", "1"))
    assert problem == "--runs 1: at least 3 timed runs (median and spread); --smoke allows 1"
    for argv, problem in (
        (("--ttft-requests", "0"), "--ttft-requests 0 must be >= 1"),
        (("--requests-per-level", "0"), "--requests-per-level 0 must be >= 1"),
        (("--warmup-requests", "-1"), "--warmup-requests -1 must be >= 0"),
    ):
        assert resolve(_parse(*argv)) == problem, argv
    # What only the open loop checks does not apply to the closed loop.
    assert resolve(_parse("--duration", "-1", "--gap", "-1")) is None
    with pytest.raises(SystemExit):
        _parse("--concurrency", "0,4")
    assert main(["--runs", "2"]) == 2


def test_plots_are_written_as_png(tmp_path: Path) -> None:
    levels = aggregate_levels([[_level(1, 10.0, 0.1), _level(8, 50.0, 0.2)]])
    record = {
        "levels": levels,
        "engine_baseline": {"concurrency": 8, "requests": 8, "tok_s": 60.0, "ttft_p50_ms": 90.0},
        "workload": {"model": "tiny", "prompt_tokens": 16, "new_tokens": NEW_TOKENS},
        "provenance": start_provenance(),
    }
    path = tmp_path / "plots" / "bench.png"
    write_plots(record, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_the_command_line_module_imports_neither_torch_nor_grpc() -> None:
    # `strata --help` builds this parser: it must stay instant.
    code = "import sys, bench.stack; print(sorted({'torch', 'grpc'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


def _bench_imports() -> dict[str, set[str]]:
    """Each bench module's bench imports, lazy and type-only ones included."""
    import ast
    from pathlib import Path

    import bench

    graph: dict[str, set[str]] = {}
    for path in Path(bench.__file__).parent.glob("*.py"):
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "bench":
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench."):
                imported.add(str(node.module).split(".")[1])
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")}
        graph[path.stem] = imported
    return graph


def test_bench_modules_import_downward_only() -> None:
    import graphlib

    graph = _bench_imports()
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError on an import cycle
    # The command line dispatches to the two runs; they share the driver and the session, not each other.
    assert {"options", "stack_run", "rate_run", "session"} <= graph["stack"]
    for run in ("stack_run", "rate_run"):
        assert not graph[run] & {"stack", "stack_run", "rate_run"}, run
        assert {"session", "stack_prompts"} <= graph[run], run
    assert "driver" in graph["load"] and "driver" in graph["rate"]
    for shared in ("driver", "summary", "load", "rate", "session", "options"):
        assert not graph[shared] & {"stack", "stack_run", "rate_run"}, shared


def test_no_gateway_is_a_clear_error_not_a_hang(
    tiny_serving_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Port 1 needs root to listen on: nothing answers there.
    argv = ["--address", "127.0.0.1:1", "--model-dir", str(tiny_serving_dir), "--smoke", "--no-progress"]
    assert main(argv) == 1
    assert "no gateway answers at 127.0.0.1:1" in capsys.readouterr().err


def _write_config(
    directory: Path, model_dir: Path, route: dict[str, Any] | None = None, **worker: Any
) -> Path:
    """A one-worker stack config whose route starts from NO_SLO_ROUTE (tests/route_defaults.py): a smoke
    run counts no refusal for the machine's speed; `route` adds a test's own limits."""
    import yaml

    config = {
        "tokenizer": {"listen": "127.0.0.1:0", "models": {"tiny": str(model_dir)}},
        "workers": [
            {
                "model_name": "tiny",
                "model_path": str(model_dir),
                "listen": "127.0.0.1:0",
                "device": "cpu",
                "threads": 1,
                "engine": {"num_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 128},
                **worker,
            }
        ],
        "gateway": {
            "listen": "127.0.0.1:0",
            "default_model": "tiny",
            "routes": [harness_route("tiny", **(route or {}))],
        },
    }
    path = directory / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_smoke_run_against_a_spawned_tiny_stack(tmp_path: Path, tiny_serving_dir: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [
        "--spawn", "--config", str(_write_config(tmp_path, tiny_serving_dir)), "--smoke",
        "--concurrency", "1,4", "--new-tokens", str(NEW_TOKENS), "--engine-baseline", "--threads", "1",
        "--json", str(out), "--no-progress", "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    record = json.loads(out.read_text())
    assert [level["concurrency"] for level in record["levels"]] == [1, 4]
    for level in record["levels"]:
        assert level["output_tok_s"] > 0
        assert level["errors"] == {} and level["refusals"] == {}
        assert level["token_mismatches"] == 0
        assert level["runs"][0]["completed"] == level["requests"] == 8
        assert level["ttft_ms"]["p50"] > 0
    assert record["valid"] is False and record["smoke"] is True
    assert record["workload"]["model"] == "tiny"
    engine = record["engine_baseline"]
    assert engine["tok_s"] > 0 and engine["ttft_p50_ms"] > 0
    assert engine["outputs_compared"] == 8
    assert {"throughput_ratio", "ttft_ratio", "pass"} <= set(record["target"])
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "logs" / "gateway.log").exists()


@pytest.mark.slow
def test_refusals_are_counted_not_fatal_and_a_closed_loop_stack_admits_them_all(
    tmp_path: Path, tiny_serving_dir: Path
) -> None:
    from bench.session import stack_endpoints
    from strata.rpc import channel_options
    from strata.v1 import gateway_pb2_grpc

    # One credit and no admission queue: the gateway refuses what the worker cannot take, at once.
    config = _write_config(tmp_path, tiny_serving_dir, route={"max_queued_requests": 0}, max_requests=1)
    args = argparse.Namespace(spawn=True, config=config, log_dir=tmp_path / "logs", address="")
    prompts = build_prompts(load_tokenizer(tiny_serving_dir), 8, 16, seed="refusals")
    requests = [make_request(p, NEW_TOKENS, f"refusal-{i}") for i, p in enumerate(prompts)]

    async def drive(address: str) -> LevelRun:
        import grpc

        async with grpc.aio.insecure_channel(address, options=channel_options(1 << 20)) as channel:
            stub: Any = gateway_pb2_grpc.GatewayStub(channel)
            return await run_level(stub, requests, 4, timeout_s=60.0, label="refusals", progress=False)

    with stack_endpoints(args) as endpoints:
        run = asyncio.run(drive(endpoints.gateway))
    summary = summarize_level(run, [16] * len(prompts), NEW_TOKENS)
    assert summary["refusals"].get("RESOURCE_EXHAUSTED", 0) >= 1
    assert summary["errors"] == {}
    assert summary["completed"] >= 1
    assert summary["completed"] + summary["refusals"]["RESOURCE_EXHAUSTED"] == len(prompts)
    assert summary["token_mismatches"] == 0
    # The same stack spawned for a closed loop (admit=): its routes queue what the credit cannot take.
    with stack_endpoints(args, admit=len(requests)) as endpoints:
        admitted = summarize_level(asyncio.run(drive(endpoints.gateway)), [16] * len(prompts), NEW_TOKENS)
    assert admitted["refusals"] == {} and admitted["errors"] == {}
    assert admitted["completed"] == len(prompts)
