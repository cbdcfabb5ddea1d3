"""bench.peer's bookkeeping and bench.physical_limit's arithmetic, on figures given by hand.

The runs themselves (llama.cpp's binary, the engine's process) are exercised by `make bench-peer`;
here the parts that turn their numbers into the record are checked exactly.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import pytest

from bench.peer import format_summary, parse_args, summarize
from bench.physical_limit import MachineLimits, ModelBytes, physical_limit
from services.worker.model.config import ModelConfig

if TYPE_CHECKING:
    from pathlib import Path


def _runs(ours: list[float], theirs: list[float]) -> dict[str, list[dict[str, dict[str, float]]]]:
    def rows(values: list[float]) -> list[dict[str, dict[str, float]]]:
        return [{"1": {"tok_s": v, "decode_tok_s": v * 1.1}} for v in values]

    return {"float32/engine": rows(ours), "float32/llama.cpp": rows(theirs)}


def test_summary_reports_medians_bests_and_per_round_ratios() -> None:
    args = argparse.Namespace(pairs=["float32"], npl="1")
    summary = summarize(args, {"runs": _runs([36.0, 40.0, 38.0], [40.0, 41.0, 44.0])})
    row = summary["1"]
    assert row["engine_tok_s"]["median"] == 38.0 and row["engine_tok_s"]["best"] == 40.0
    assert row["llama_cpp_tok_s"]["median"] == 41.0
    assert row["ratio_median"] == pytest.approx(38.0 / 41.0)
    assert row["ratio_best"] == pytest.approx(40.0 / 44.0)
    assert row["ratio_per_round"] == pytest.approx([36 / 40, 40 / 41, 38 / 44])
    assert (row["target"], row["goal"], row["met"]) == (0.9, 1.0, True)
    assert "0.93x" in format_summary(summary)


def test_peer_refuses_fewer_than_three_rounds_and_unknown_pairs() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "2"])
    with pytest.raises(SystemExit):
        parse_args(["--pairs", "float32,fp8"])


def test_physical_limit_is_bytes_over_bandwidth_or_flops_over_throughput(tiny_llama_dir: Path) -> None:
    config = ModelConfig.from_dir(tiny_llama_dir)
    model = ModelBytes.of(config)
    h, inter, layers = 64, 128, 3
    per_layer = h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * inter
    assert model.layer_params == per_layer * layers
    assert model.lm_head_bytes == 384 * h * 4
    assert model.kv_bytes_per_token == 2 * config.kv_size * layers * 4
    limits = MachineLimits(read_bandwidth_gb_s=1.0, matmul_gflop_s=1.0, threads=1)
    # One decode of 1 token over 9 cached ones: memory-bound at these sizes.
    decode = physical_limit(model, limits, [(1, 1, 9)])
    read = model.layer_weight_bytes + model.lm_head_bytes + 10 * model.kv_bytes_per_token
    assert decode["seconds"] == pytest.approx(read / 1e9)
    # A 4096-token prefill with nothing sampled: compute-bound.
    prefill = physical_limit(model, limits, [(4096, 0, 0)])
    assert prefill["seconds"] == pytest.approx(2 * 4096 * model.layer_params / 1e9)
    assert prefill["memory_bound_seconds"] < prefill["seconds"]
