"""The HTTP front doors' table: the OpenAI-compatible API against gRPC, and Anthropic's Messages API
and OpenAI's Responses API against Chat Completions, on the same workloads (bench/http_vs_grpc.py).
This module only renders its record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from docs_tables_common import Record, Table, met, ratio, runs, spread, table

if TYPE_CHECKING:
    from collections.abc import Mapping


def _pair_rows(
    data: Mapping[str, Any], base: str, other: str, prefix: str, ttft_target: str
) -> list[list[str]]:
    """`other` against `base`: tokens/s at 64 streams and TTFT p50 at one, each with its target (the
    record's names: `prefix` on the verdicts, `ttft_target` the TTFT bound's)."""
    result, targets = data["result"], data["targets"]
    tbase, tother = result[f"throughput_{base}"], result[f"throughput_{other}"]
    fbase, fother = result[f"ttft_{base}"], result[f"ttft_{other}"]
    return [
        [
            "64 streams: output tok/s",
            spread(tbase["output_tok_s"], tbase["spread"]),
            spread(tother["output_tok_s"], tother["spread"]),
            f"**{ratio(result[f'{other}_vs_{base}_tok_s'])}** "
            f"(rounds {runs(result[f'{other}_vs_{base}_tok_s_per_round'])})",
            f">= {targets[f'{other}_vs_{base}_tok_s_min']}x: {met(result[f'{prefix}throughput_target_met'])}",
        ],
        [
            "1 stream: TTFT p50",
            spread(fbase["ttft_ms_p50"], fbase["spread"]) + " ms",
            spread(fother["ttft_ms_p50"], fother["spread"]) + " ms",
            f"**{result[f'{other}_minus_{base}_ttft_ms']:+.1f} ms**",
            f"<= +{targets[ttft_target]:g} ms: {met(result[f'{prefix}ttft_target_met'])}",
        ],
    ]


def http_vs_grpc(records: Mapping[str, Record]) -> list[str]:
    data = records["http-vs-grpc-cpu.json"].data
    result = data["result"]
    grpc, http = result["throughput_grpc"], result["throughput_http"]
    rows = [
        *_pair_rows(data, "grpc", "http", "", "ttft_delta_ms_max"),
        [
            "client CPU per 1000 tokens, 64 streams",
            f"{grpc['client_cpu_ms_per_1k_tokens']:.0f} ms",
            f"{http['client_cpu_ms_per_1k_tokens']:.0f} ms",
            ratio(http["client_cpu_ms_per_1k_tokens"] / grpc["client_cpu_ms_per_1k_tokens"], 1),
            "(recorded)",
        ],
    ]
    lines = table(
        ["workload", "gRPC, median (min-max)", "HTTP, median (min-max)", "HTTP against gRPC", "target"], rows
    )
    for other, name in (("messages", "Messages"), ("responses", "Responses")):
        if f"{other}_vs_chat_tok_s" not in result:  # a record from before this API was measured
            continue
        header = [
            "workload",
            "Chat Completions, median (min-max)",
            f"{name}, median (min-max)",
            f"{name} against Chat Completions",
            "target",
        ]
        rows = _pair_rows(data, "chat", other, f"{other}_", f"{other}_ttft_delta_ms_max")
        lines = [*lines, "", *table(header, rows)]
    return lines


TABLES = (Table("http-vs-grpc", ("http-vs-grpc-cpu.json",), http_vs_grpc),)
