"""The engine's tables: bench.engine records, llama.cpp on the same weights, the facade, the memory profile.

Each function turns quotable records (docs_tables_common.Record, by file name) into markdown lines;
`TABLES` declares which record each table of docs/benchmarks.md, docs/cpu-speed.md and
docs/deployment.md reads. This module must not read files or judge a figure against a target the
record does not state: it only shows what the records hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from docs_tables_common import Record, Table, met, num, ratio, spread, stats, table

if TYPE_CHECKING:
    from collections.abc import Mapping

ENGINE_CONTESTANTS = (
    ("naive", "transformers `generate`, one request at a time"),
    ("hf_cb", "transformers continuous batching (`generate_batch`, warm)"),
    ("engine_torch_ops", "Strata engine, native kernels off"),
    ("engine", "**Strata engine**"),
    ("ceiling", "ceiling: the linear layers' matmuls alone, at the engine's step shapes"),
)


def engine_rows(data: Mapping[str, Any]) -> list[str]:
    """Every contestant the record holds, the engine against each, and each against the ceiling."""
    engine, ceiling = data["engine_tok_s"], data["ceiling_tok_s"]
    rows = []
    for key, label in ENGINE_CONTESTANTS:
        if f"{key}_tok_s" not in data:
            continue
        value = data[f"{key}_tok_s"]
        against = "-" if key == "engine" else ratio(engine / value)
        rows.append([label, spread(value, data[f"{key}_spread"]), against, f"{value / ceiling:.1%}"])
    if "physical_limit_tok_s" in data:
        limit = data["physical_limit_tok_s"]
        machine = data["physical_limit"]["machine"]
        label = (
            f"physical limit: bytes and FLOPs a step needs at {machine['read_bandwidth_gb_s']:.1f} GB/s "
            f"and {machine['matmul_gflop_s']:.0f} GFLOP/s"
        )
        rows.append([label, num(limit), ratio(engine / limit), f"{limit / ceiling:.1%}"])
    lines = table(["contestant", "tok/s, median (min-max)", "the engine against it", "of the ceiling"], rows)
    decode = [("engine", "the engine"), ("engine_torch_ops", "with the native kernels off")]
    full = [
        f"{num(data[f'{key}_full_batch_decode_tok_s'])} tok/s {label}"
        for key, label in decode
        # A contestant the run left out is None there.
        if data.get(f"{key}_full_batch_decode_tok_s") is not None
    ]
    if full:
        lines += ["", "While every request decodes: " + ", ".join(full) + "."]
    return lines


def engine_table(name: str, record: str) -> Table:
    return Table(name, (record,), lambda records: engine_rows(records[record].data))


PEER_PAIRS = {
    "float32": "float32 vs F32",
    "int8": "int8 fallback vs Q8_0",
    "fastest-vs-q4_k_m": "our faster vs Q4_K_M",
    "gguf-q8_0": "llama.cpp's Q8_0 file, both sides",
    "gguf-q4_k_m": "llama.cpp's Q4_K_M file, both sides",
}


def _peer_rate(row: Mapping[str, Any]) -> str:
    """`48.0 / 40.0 = **1.20x** (1.05-1.31)`: both medians, their ratio and the per-round range."""
    return (
        f"{num(row['engine']['median'])} / {num(row['llama_cpp']['median'])} = "
        f"**{ratio(row['ratio_median'])}** ({ratio(row['ratio_min'])}-{ratio(row['ratio_max'])})"
    )


def _peer_perplexity(entry: Mapping[str, Any]) -> str:
    ours = entry["perplexity"]["engine"]
    paths = {value["path"]: value["perplexity"] for value in ours.values()}
    shown = ", ".join(f"{num(value, 2)} ({path})" for path, value in paths.items())
    theirs = entry["perplexity"]["llama_cpp"]
    return f"{shown} / {num(theirs['perplexity'], 2)} ({theirs['type']})"


def peer_rows(data: Mapping[str, Any]) -> list[str]:
    summary = data["summary"]
    rows = []
    for key, entry in summary.items():
        name, _, streams = key.rpartition("@")
        combined = entry["tok_s"]["ratio_median"]
        target = "-"
        if entry.get("target") is not None:
            target = f">= {entry['target']}: " + ("met" if entry["met"] else "**missed**")
        if entry.get("goal") is not None:
            target += f", goal {entry['goal']}: " + ("met" if combined >= entry["goal"] else "**missed**")
        rows.append(
            [
                f"{streams} stream{'s' if streams != '1' else ''}, {PEER_PAIRS.get(name, name)} "
                f"({entry['engine'].removeprefix('engine/')})",
                _peer_rate(entry["tok_s"]),
                _peer_rate(entry["prefill_tok_s"]),
                _peer_rate(entry["decode_tok_s"]),
                _peer_perplexity(entry),
                f"{entry['flagged_rounds']} of {len(entry['tok_s']['ratio_per_round'])}",
                target,
            ]
        )
    header = [
        "workload (our configuration)",
        "combined tok/s, engine / llama.cpp = ratio of medians (per-round range)",
        "prefill alone",
        "decode alone",
        "perplexity, ours (path) / llama.cpp (type)",
        "loaded rounds",
        "target",
    ]
    return table(header, rows)


def perplexity(records: Mapping[str, Record]) -> list[str]:
    data = records["perplexity-cpu.json"].data
    labels = {
        "float32": "float32 (the primary)",
        "int8-small-batch": "int8 fallback, 8 tokens a step (the weight-only copies its decodes read)",
        "int8-dynamic": "int8 fallback, a whole chunk a step (torch's dynamic int8 of its prefill)",
    }
    paths = data["paths"]
    base = paths.get("float32", {}).get("perplexity")
    rows = [
        [
            labels.get(name, name),
            f"{entry['perplexity']:.2f}",
            "-" if base is None or name == "float32" else ratio(entry["perplexity"] / base),
            f"{entry['scored_tokens']:,}",
        ]
        for name, entry in paths.items()
    ]
    window = data["window"]
    return [
        *table(["path", "perplexity", "against float32", "tokens scored"], rows),
        "",
        f"On `bench/data/{data['text']['path']}` ({data['text']['tokens']:,} tokens) in "
        f"{window['chunks']} windows of {window['context']} tokens, the second half of each scored.",
    ]


def facade(records: Mapping[str, Record]) -> list[str]:
    data = records["facade-cpu.json"].data
    lag = data["facade"]
    rows = [
        ["stepped synchronously", stats(data["sync"]["tok_s"]), "-"],
        [
            "stepped through the asyncio facade",
            stats(lag["tok_s"]),
            f"**{ratio(data['facade_vs_sync'])}**; a 1 ms timer late by "
            f"{lag['loop_lag_ms_p50']['median']:.2f} ms p50, {lag['loop_lag_ms_p99']['median']:.1f} ms p99, "
            f"{lag['loop_lag_ms_max']['median']:.1f} ms at worst",
        ],
    ]
    return table(["engine", "tok/s, median (min-max)", "facade against sync"], rows)


def mixing(records: Mapping[str, Record]) -> list[str]:
    data = records["mixing-cpu.json"].data
    rows = []
    for key, label in (("mixed", "mixed steps (`mixed_batches=True`)"), ("alternating", "alternating steps")):
        entry = data[key]
        rows.append(
            [
                label,
                stats(entry["tok_s"]),
                f"{entry['ttft_p50_ms']['median'] / 1000:.2f} s",
                f"{entry['ttft_max_ms']['median'] / 1000:.2f} s",
                f"{entry['itl_p99_ms']['median'] / 1000:.2f} s",
            ]
        )
    return table(["steps", "tok/s, median (min-max)", "TTFT p50", "TTFT max", "inter-token p99"], rows)


def step_cost(records: Mapping[str, Record]) -> list[str]:
    fit = records["step-cost-cpu.json"].data["fit"]
    return [
        f"Fit: step ms = {fit['fixed_ms']:.1f} + {fit['ms_per_decode']:.2f} x decodes + "
        f"{fit['ms_per_prefill_token']:.2f} x prompt tokens, so a decode costs "
        f"{fit['decode_cost_tokens']:.1f} prompt tokens."
    ]


def memory_profile(records: Mapping[str, Record]) -> list[str]:
    mib = 2**20
    rows = []
    for row in records["memory-profile-cpu.json"].data["rows"]:
        model = row["model"].removeprefix("models/").replace(":dynamic-int8", " (dynamic int8)")
        rows.append(
            [
                model,
                str(row["context"]),
                str(row["seqs"]),
                f"{row['weights'] / mib:.0f} MiB",
                f"{row['peak'] / mib:.0f} MiB",
                f"{row['limit_to_start_mib'] / 1024:.1f} GiB",
                f"{row['limit_every_slot_mib'] / 1024:.1f} GiB",
            ]
        )
    header = [
        "model",
        "`max_model_len`",
        "`max_num_seqs`",
        "weights",
        "peak of the largest step",
        "limit to start (one full-length request)",
        "limit with every slot at 1024 tokens",
    ]
    return table(header, rows)


def tensor_parallel(records: Mapping[str, Record]) -> list[str]:
    """bench/tp.py's record: two ranks against one per workload, rank 0's time in collectives, and
    the vocabulary choice's timings."""
    data = records["tp-cpu.json"].data
    rows = [
        [
            str(data[part]["streams"]),
            stats(data[part]["one_rank"]["tok_s"]),
            stats(data[part]["two_ranks"]["tok_s"]),
            stats(data[part]["ratio"], 2),
            f"{stats(data[part]['collective_ms_per_step'])} of {stats(data[part]['two_rank_step_ms'])}",
        ]
        for part in ("one_stream", "many_streams")
    ]
    vocab = [
        [
            rows_count,
            num(figures["project_whole_vocab_ms"], 2),
            num(figures["project_half_vocab_ms"], 2),
            num(figures["all_gather_half_vocab_ms"], 2),
            num(figures["all_reduce_hidden_ms"], 2),
        ]
        for rows_count, figures in data["vocabulary"].items()
    ]
    header = ["streams", "one rank, tok/s", "two ranks, tok/s", "ratio", "collectives, ms of a step"]
    return [
        *table(header, rows),
        "",
        *table(
            [
                "rows",
                "whole vocabulary, ms",
                "half, ms",
                "all_gather of halves, ms",
                "all_reduce of hidden, ms",
            ],
            vocab,
        ),
    ]


def lora(records: Mapping[str, Record]) -> list[str]:
    """bench/lora.py's record: the engine serving adapters against the base alone per workload, the
    stall of a run-time load, and the record's own verdicts."""
    data = records["lora-cpu.json"].data
    rows = [
        [
            str(data[part]["streams"]),
            stats(data[part]["base"]["tok_s"]),
            stats(data[part]["adapters"]["tok_s"]),
            stats(data[part]["ratio"], 2),
        ]
        for part in ("many_streams", "one_stream")
    ]
    stall = data["load_stall"]
    load = [[stats(stall["step_ms"]), stats(stall["load_ms"]), stats(stall["longest_gap_steps"], 2)]]
    verdicts = [[line["target"], line["figure"], met(line["met"])] for line in data["targets"]]
    return [
        *table(["streams", "base alone, tok/s", "through adapters, tok/s", "ratio"], rows),
        "",
        *table(["steady step, ms", "load, ms", "longest gap, step times"], load),
        "",
        *table(["target", "measured", ""], verdicts),
    ]


TABLES = (
    Table("tensor-parallel", ("tp-cpu.json",), tensor_parallel),
    Table("lora", ("lora-cpu.json",), lora),
    engine_table("engine", "engine-cpu.json"),
    engine_table("engine-native", "engine-cpu-native.json"),
    engine_table("engine-one-stream", "engine-cpu-1-stream.json"),
    engine_table("engine-one-team", "engine-cpu-one-team.json"),
    Table("peer", ("peer-cpu.json",), lambda records: peer_rows(records["peer-cpu.json"].data)),
    Table(
        "peer-avx2", ("peer-avx2-cpu.json",), lambda records: peer_rows(records["peer-avx2-cpu.json"].data)
    ),
    Table(
        "peer-qwen",
        ("peer-qwen05-cpu.json",),
        lambda records: peer_rows(records["peer-qwen05-cpu.json"].data),
    ),
    Table(
        "peer-qwen-one-stream",
        ("peer-qwen05-1-stream-cpu.json",),
        lambda records: peer_rows(records["peer-qwen05-1-stream-cpu.json"].data),
    ),
    Table("facade", ("facade-cpu.json",), facade),
    Table("perplexity", ("perplexity-cpu.json",), perplexity),
    Table("memory-profile", ("memory-profile-cpu.json",), memory_profile),
    Table("mixing", ("mixing-cpu.json",), mixing),
    Table("step-cost", ("step-cost-cpu.json",), step_cost),
)
