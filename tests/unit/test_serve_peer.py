"""bench.serve_peer's plan, its benchmark config and its figures, on values given by hand.

The servers themselves are exercised by `make bench-serve-peer` (and llama-server's start and stream
by test_serve_peer_llama.py); here the alternation, the request bodies, the route that admits the
burst, and the arithmetic that turns requests into the record are checked exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.driver import RequestResult
from bench.serve_peer import CONFIG, parse
from bench.serve_peer_plan import (
    LLAMA,
    STRATA,
    Level,
    Shape,
    plan_levels,
    request_body,
    schedule,
    slot_tokens,
)
from bench.serve_peer_report import level_figures, summarize_levels, table
from bench.stack_prompts import Prompt
from strata.settings import DEFAULT_CONFIG, read_config

QWEN_CONFIG = Path(CONFIG).with_name("serve_peer_qwen.yaml")
SMALL = Shape(64, 64)
LARGE = Shape(512, 128)


def test_shapes_parse_and_reject_what_is_not_prompt_x_new() -> None:
    assert Shape.parse("512x128") == LARGE and LARGE.name == "512x128" and LARGE.tokens == 640
    for bad in ("512", "0x8", "ax8", "8x-1"):
        with pytest.raises(ValueError, match="PROMPTxNEW"):
            Shape.parse(bad)


def test_levels_send_at_least_min_requests_and_a_full_wave() -> None:
    levels = plan_levels([SMALL, LARGE], [1, 8, 64], min_requests=8)
    assert [(lv.key, lv.requests) for lv in levels] == [
        ("64x64@1", 8),
        ("64x64@8", 8),
        ("64x64@64", 64),
        ("512x128@1", 8),
        ("512x128@8", 8),
        ("512x128@64", 64),
    ]
    assert slot_tokens([SMALL, LARGE]) == 640


def test_schedule_alternates_contestants_and_flips_the_order_every_round() -> None:
    levels = plan_levels([SMALL], [1, 64], min_requests=1)
    rounds = schedule(3, levels)
    flat = [c for steps in rounds for _, c in steps]
    assert flat[:4] == [STRATA, LLAMA, STRATA, LLAMA]
    assert flat[4:8] == [LLAMA, STRATA, LLAMA, STRATA]
    assert flat[8:] == flat[:4]
    for steps in rounds:
        # Every level runs on both contestants back to back, once each per round.
        assert [lv.key for lv, _ in steps] == ["64x64@1", "64x64@1", "64x64@64", "64x64@64"]
        assert {c for lv, c in steps if lv.concurrency == 64} == {STRATA, LLAMA}


def test_both_contestants_get_the_same_greedy_body_and_llama_also_n_predict() -> None:
    prompt = Prompt("Some text", (1, 2))
    ours = request_body(STRATA, prompt, 64, "m")
    theirs = request_body(LLAMA, prompt, 64, "m")
    assert ours == {
        "model": "m",
        "prompt": "Some text",
        "max_tokens": 64,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert theirs == {**ours, "n_predict": 64}
    with pytest.raises(ValueError, match="unknown contestant"):
        request_body("vllm", prompt, 64, "m")


def test_the_benchmark_config_is_make_runs_stack_with_a_route_that_admits_the_burst() -> None:
    ours, default = read_config(CONFIG), read_config(DEFAULT_CONFIG)
    route, default_route = ours["gateway"]["routes"][0], default["gateway"]["routes"][0]
    assert {k: v for k, v in ours.items() if k != "gateway"} == {
        k: v for k, v in default.items() if k != "gateway"
    }
    assert {k: v for k, v in ours["gateway"].items() if k != "routes"} == {
        k: v for k, v in default["gateway"].items() if k != "routes"
    }
    assert {k: v for k, v in route.items() if k not in ("ttft_slo_ms", "fallback_enabled")} == default_route
    # A 64 x 512-token burst waits behind ~32k prefill tokens (10-20 s on two cores): admitted, never
    # sent to the int8 fallback, admission itself left on.
    assert route["ttft_slo_ms"] >= 60_000 and route["fallback_enabled"] is False
    assert Path(CONFIG).parent.name == "bench"


def test_the_qwen_config_serves_the_shipped_gguf_alone_with_a_route_that_admits_the_burst() -> None:
    """One worker on the folder configs/qwen.yaml's 0.5B fallback serves (where fetch-model keeps the
    Q4_K_M file as shipped, which llama-server then reads too), with room for 64 streams, and a route
    with no fallback whose SLO admits the burst."""
    ours, qwen = read_config(QWEN_CONFIG), read_config(Path(DEFAULT_CONFIG).parent / "qwen.yaml")
    (worker,) = ours["workers"]
    same = next(w for w in qwen["workers"] if w["model_name"] == worker["model_name"])
    assert worker["model_path"] == same["model_path"]
    assert ours["tokenizer"]["models"] == {worker["model_name"]: worker["model_path"]}
    assert worker["max_requests"] == worker["engine"]["max_num_seqs"] == 64
    assert {
        k: v for k, v in worker["engine"].items() if k not in ("max_num_seqs", "kv_cache_memory_bytes")
    } == {k: v for k, v in same["engine"].items() if k not in ("max_num_seqs", "kv_cache_memory_bytes")}
    # 64 streams of 64 + 64 tokens at 24 KiB a token fit the cache.
    assert worker["engine"]["kv_cache_memory_bytes"] >= 64 * 128 * 24 * 1024
    (route,) = ours["gateway"]["routes"]
    assert route["model"] == ours["gateway"]["default_model"] == worker["model_name"]
    assert route["ttft_slo_ms"] >= 60_000 and not route.get("fallback")
    assert ours["telemetry"] == read_config(DEFAULT_CONFIG)["telemetry"]


def test_fewer_than_three_rounds_need_smoke() -> None:
    with pytest.raises(SystemExit):
        parse(["--rounds", "1"])
    args = parse(["--rounds", "1", "--smoke", "--shapes", "64x64", "--concurrency", "1,8"])
    assert [lv.key for lv in args.levels] == ["64x64@1", "64x64@8"]


def _ok(index: int, ttft: float, gaps: list[float], tokens: int = 4, prompt: int = 64) -> RequestResult:
    result = RequestResult(index, "OK", ttft, ttft + sum(gaps), itl_s=list(gaps), first_text_s=ttft)
    result.usage_input_tokens, result.usage_output_tokens, result.model = prompt, tokens, "m"
    return result


def test_level_figures_count_tokens_latencies_errors_and_mismatches() -> None:
    level = Level(Shape(64, 4), 2, 4)
    results = [
        _ok(0, 0.100, [0.010, 0.020, 0.030]),
        _ok(1, 0.300, [0.010, 0.010, 0.010]),
        _ok(2, 0.200, [0.020, 0.020, 0.020], prompt=65),
        RequestResult(3, "429", None, 0.01, message="queue full"),
    ]
    figures = level_figures(results, 2.0, level, "m")
    assert figures["completed"] == 3 and figures["errors"] == 1
    assert figures["error_kinds"] == {"429: queue full": 1}
    assert figures["token_mismatches"] == 1  # 65 prompt tokens, not 64
    assert figures["output_tok_s"] == pytest.approx(12 / 2.0)
    assert figures["ttft_ms_p50"] == pytest.approx(200.0)
    assert figures["ttft_ms_p99"] == pytest.approx(298.0)
    assert figures["itl_ms_p50"] == pytest.approx(20.0)
    assert figures["tpot_ms_p50"] == pytest.approx(20.0)  # (0.06 s after the first) / 3 tokens
    assert figures["chunks_per_token"] == pytest.approx(1.0)
    assert level_figures(results, 2.0, level, "other")["token_mismatches"] == 3


def test_summary_takes_medians_over_rounds_and_ratios_per_round() -> None:
    level = Level(Shape(64, 4), 1, 1)

    def run(tok_s: float, ttft_ms: float) -> dict[str, object]:
        figures: dict[str, object] = {name: 10.0 for name in ("itl_ms_p50", "itl_ms_p99", "tpot_ms_p50")}
        figures.update(output_tok_s=tok_s, ttft_ms_p50=ttft_ms, ttft_ms_p99=ttft_ms, errors=0)
        return {**figures, "token_mismatches": 0}

    runs = {
        level.key: {
            STRATA: [run(30, 100), run(40, 90), run(35, 95)],
            LLAMA: [run(20, 50), run(25, 60), run(40, 55)],
        }
    }
    pooled = {level.key: {STRATA: [_ok(0, 0.1, [0.01])], LLAMA: [_ok(0, 0.05, [0.02])]}}
    row = summarize_levels([level], runs, pooled)[level.key]
    assert row[STRATA]["output_tok_s"] == {"median": 35, "min": 30, "max": 40, "runs": [30, 40, 35]}
    assert row["strata_vs_llama_cpp_tok_s"] == pytest.approx(35 / 25)
    assert row["strata_vs_llama_cpp_tok_s_per_round"] == pytest.approx([30 / 20, 40 / 25, 35 / 40])
    assert row["strata_minus_llama_cpp_ttft_ms_p50"] == pytest.approx(95 - 55)
    assert row[LLAMA]["pooled"]["itl_ms_p50"] == pytest.approx(20.0)
    assert "1.40" in table({level.key: row})
