"""bench.peer's bookkeeping and bench.physical_limit's arithmetic, on figures given by hand.

The runs themselves (llama.cpp's binaries, the engine's process) are exercised by `make bench-peer`;
here the parts that turn their output into the record are checked exactly: llama.cpp's printed
results parsed, the warm-up pairs dropped, our engine's phases cut, ratios and perplexities summed up.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from bench.peer import parse_args
from bench.peer_engine import phases
from bench.peer_llama import parse_batched, parse_ids, parse_perplexity, warmed_npl
from bench.peer_report import format_summary, our_paths, summarize
from bench.peer_setup import served_folder, shipped_copy
from bench.physical_limit import MachineLimits, ModelBytes, physical_limit
from services.worker.model.registry import load_config

if TYPE_CHECKING:
    from pathlib import Path


def _row(pl: int, t_pp: float, t_tg: float, pp: int = 64, tg: int = 64) -> str:
    fields = {"pp": pp, "tg": tg, "pl": pl, "n_kv": pl * (pp + tg), "t_pp": t_pp, "t_tg": t_tg}
    fields |= {"speed_pp": pl * pp / t_pp, "speed_tg": pl * tg / t_tg, "t": t_pp + t_tg}
    return json.dumps(fields | {"speed": (pl * (pp + tg)) / (t_pp + t_tg)})


def test_batched_bench_keeps_the_second_run_of_each_shape_and_both_phases() -> None:
    assert warmed_npl([1, 64]) == "1,1,64,64"
    stdout = "\n".join(
        [
            "main: n_kv_max = 8192",
            _row(1, 0.5, 1.5),
            _row(1, 0.2, 1.0),
            _row(64, 9.0, 20.0),
            _row(64, 4.0, 12.0),
        ]
    )
    parsed = parse_batched(stdout, [1, 64])
    assert parsed["1"]["tok_s"] == pytest.approx(64 / 1.2)
    assert parsed["1"]["warm_up_tok_s"] == pytest.approx(64 / 2.0)
    assert parsed["64"]["prefill_tok_s"] == pytest.approx(64 * 64 / 4.0)
    assert parsed["64"]["decode_tok_s"] == pytest.approx(64 * 64 / 12.0)
    assert parsed["64"]["tok_s"] == pytest.approx(64 * 64 / 16.0)
    with pytest.raises(SystemExit, match="streams"):
        parse_batched(_row(1, 0.2, 1.0), [1, 64])


def test_perplexity_log_and_token_ids_parse() -> None:
    log = (
        "system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX2 = 1 | AVX512 = 1 |\n"
        "perplexity: calculating perplexity over 6 chunks, n_ctx=512, batch_size=512, n_seq=1\n"
        "[1]12.3,[2]13.1,\nFinal estimate: PPL = 13.1234 +/- 0.45678\n"
    )
    parsed = parse_perplexity(log)
    assert (parsed["perplexity"], parsed["plus_minus"], parsed["chunks"], parsed["context"]) == (
        13.1234,
        0.45678,
        6,
        512,
    )
    assert (
        parsed["system_info"].startswith("system_info: n_threads = 2")
        and "AVX512 = 1" in parsed["system_info"]
    )
    with pytest.raises(SystemExit, match="final estimate"):
        parse_perplexity("perplexity: tokenizing the input ..")
    assert parse_ids("[504, 659, 37919]\n") == [504, 659, 37919]


def test_engine_phases_cut_after_the_last_step_with_prompt_tokens() -> None:
    # 3 streams of 4 prompt tokens: two prefill steps (the second also decodes stream 0), then decodes.
    log = [(8, 2), (5, 2), (3, 3), (3, 3)]
    cut = phases(log, [0.4, 0.3, 0.1, 0.1], prompt_tokens=12)
    assert cut["prefill_seconds"] == pytest.approx(0.7)
    assert cut["prefill_tok_s"] == pytest.approx(12 / 0.7)
    assert cut["prefill_phase_decodes"] == 1
    assert cut["decode_tok_s"] == pytest.approx(6 / 0.2)


def _round(flagged: bool, rates: dict[str, float]) -> dict[str, Any]:
    def streams(rate: float) -> dict[str, dict[str, float]]:
        entry = {"tok_s": rate, "prefill_tok_s": 10 * rate, "decode_tok_s": 1.1 * rate}
        return {"1": entry}

    return {"flagged": flagged, "runs": {name: {"result": streams(rate)} for name, rate in rates.items()}}


def test_summary_pairs_rounds_uses_medians_and_puts_perplexities_beside_every_ratio() -> None:
    rates = [
        {
            "engine/float32": 36.0,
            "llama.cpp/f32": 40.0,
            "engine/int8": 60.0,
            "llama.cpp/q8_0": 50.0,
            "llama.cpp/q4_k_m": 70.0,
            "engine/gguf-q8_0": 20.0,
            "engine/gguf-q4_k_m": 30.0,
        },
        {
            "engine/float32": 40.0,
            "llama.cpp/f32": 41.0,
            "engine/int8": 62.0,
            "llama.cpp/q8_0": 40.0,
            "llama.cpp/q4_k_m": 75.0,
            "engine/gguf-q8_0": 21.0,
            "engine/gguf-q4_k_m": 33.0,
        },
        {
            "engine/float32": 38.0,
            "llama.cpp/f32": 44.0,
            "engine/int8": 58.0,
            "llama.cpp/q8_0": 45.0,
            "llama.cpp/q4_k_m": 80.0,
            "engine/gguf-q8_0": 22.0,
            "engine/gguf-q4_k_m": 40.0,
        },
    ]
    rounds = [_round(index == 1, r) for index, r in enumerate(rates)]
    quality = {
        "ours": {
            "float32": 10.0,
            "int8-small-batch": 10.2,
            "int8-dynamic": 11.0,
            "q8_0-stored-small-batch": 10.04,
            "q8_0-stored-whole-chunk": 10.03,
            "q4_k_m-stored-small-batch": 10.92,
            "q4_k_m-stored-whole-chunk": 10.91,
        },
        "llama_cpp": {"f32": 10.01, "q8_0": 10.05, "q4_k_m": 10.9},
    }
    summary = summarize(rounds, [1], 64, quality)
    row = summary["float32@1"]["tok_s"]
    assert row["engine"]["median"] == 38.0 and row["llama_cpp"]["median"] == 41.0
    assert row["ratio_median"] == pytest.approx(38.0 / 41.0)
    assert row["ratio_per_round"] == pytest.approx([36 / 40, 40 / 41, 38 / 44])
    assert (row["ratio_min"], row["ratio_max"]) == (pytest.approx(38 / 44), pytest.approx(40 / 41))
    assert summary["float32@1"]["met"] is True and summary["float32@1"]["flagged_rounds"] == 1
    int8 = summary["int8@1"]
    assert int8["perplexity"]["engine"] == {
        "prefill": {"path": "int8-dynamic", "perplexity": 11.0},
        "decode": {"path": "int8-small-batch", "perplexity": 10.2},
    }
    assert int8["perplexity"]["llama_cpp"] == {"type": "q8_0", "perplexity": 10.05}
    fastest = summary["fastest-vs-q4_k_m@1"]
    assert fastest["engine"] == "engine/int8" and fastest["llama_cpp"] == "llama.cpp/q4_k_m"
    assert fastest["tok_s"]["ratio_median"] == pytest.approx(60.0 / 75.0)
    assert "0.93x" in format_summary(summary)
    # Our engine on llama.cpp's own file: 64 prompt rows at one stream run the block kernels.
    stored = summary["gguf-q4_k_m@1"]
    assert stored["engine"] == "engine/gguf-q4_k_m" and stored["llama_cpp"] == "llama.cpp/q4_k_m"
    assert stored["tok_s"]["ratio_median"] == pytest.approx(33.0 / 75.0)
    assert stored["perplexity"]["engine"]["prefill"] == {
        "path": "q4_k_m-stored-small-batch",
        "perplexity": 10.92,
    }
    assert (stored["target"], stored["goal"], stored["met"]) == (1.0, 1.2, False)
    assert our_paths("engine/gguf-q8_0", 64, 64) == {
        "prefill": "q8_0-stored-whole-chunk",
        "decode": "q8_0-stored-small-batch",
    }


def test_the_int8_paths_follow_the_rows_a_step() -> None:
    assert our_paths("engine/int8", 64, 64) == {"prefill": "int8-dynamic", "decode": "int8-dynamic"}
    assert our_paths("engine/int8", 8, 64)["decode"] == "int8-small-batch"
    assert our_paths("engine/float32", 1, 64) == {"prefill": "float32", "decode": "float32"}


def test_peer_refuses_a_record_of_fewer_than_five_rounds() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "3", "--json", "x.json"])
    assert parse_args(["--rounds", "1"]).rounds == 1


def test_physical_limit_is_bytes_over_bandwidth_or_flops_over_throughput(tiny_llama_dir: Path) -> None:
    config = load_config(tiny_llama_dir)[1]
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


def test_a_shipped_q4_k_m_file_joins_the_peer_models_as_is(tmp_path: Path) -> None:
    """--shipped-q4-k-m: the model's own file, linked (not converted) into the peer's GGUF folder
    under a name that says it was shipped, and served by our engine from a folder of its own."""
    model_dir = tmp_path / "models" / "Qwen"
    model_dir.mkdir(parents=True)
    (model_dir / "tokenizer.json").write_text("{}")
    shipped = tmp_path / "shipped.gguf"
    shipped.write_bytes(b"GGUF as shipped")
    root = tmp_path / "peer"
    linked = shipped_copy(root, model_dir, shipped)
    assert linked == root / "gguf" / "Qwen-q4_k_m-shipped.gguf"
    assert linked.read_bytes() == b"GGUF as shipped"
    assert linked.stat().st_ino == shipped.stat().st_ino
    assert shipped_copy(root, model_dir, shipped) == linked
    folder = served_folder(model_dir, linked)
    assert sorted(p.name for p in folder.iterdir()) == ["Qwen-q4_k_m-shipped.gguf", "tokenizer.json"]
