"""The HTTP front doors' table: the OpenAI-compatible API against gRPC, and Anthropic's Messages API
against Chat Completions, on the same workloads (bench/http_vs_grpc.py). This module only renders
its record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from docs_tables_common import Record, Table, met, ratio, runs, spread, table

if TYPE_CHECKING:
    from collections.abc import Mapping


def http_vs_grpc(records: Mapping[str, Record]) -> list[str]:
    data = records["http-vs-grpc-cpu.json"].data
    result, targets = data["result"], data["targets"]
    grpc, http = result["throughput_grpc"], result["throughput_http"]
    tgrpc, thttp = result["ttft_grpc"], result["ttft_http"]
    rows = [
        [
            "64 streams: output tok/s",
            spread(grpc["output_tok_s"], grpc["spread"]),
            spread(http["output_tok_s"], http["spread"]),
            f"**{ratio(result['http_vs_grpc_tok_s'])}** "
            f"(rounds {runs(result['http_vs_grpc_tok_s_per_round'])})",
            f">= {targets['http_vs_grpc_tok_s_min']}x: {met(result['throughput_target_met'])}",
        ],
        [
            "1 stream: TTFT p50",
            spread(tgrpc["ttft_ms_p50"], tgrpc["spread"]) + " ms",
            spread(thttp["ttft_ms_p50"], thttp["spread"]) + " ms",
            f"**{result['http_minus_grpc_ttft_ms']:+.1f} ms**",
            f"<= +{targets['ttft_delta_ms_max']:g} ms: {met(result['ttft_target_met'])}",
        ],
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
    if "messages_vs_chat_tok_s" not in result:  # a record from before the Messages API was measured
        return lines
    chat, messages = result["throughput_chat"], result["throughput_messages"]
    tchat, tmessages = result["ttft_chat"], result["ttft_messages"]
    rows = [
        [
            "64 streams: output tok/s",
            spread(chat["output_tok_s"], chat["spread"]),
            spread(messages["output_tok_s"], messages["spread"]),
            f"**{ratio(result['messages_vs_chat_tok_s'])}** "
            f"(rounds {runs(result['messages_vs_chat_tok_s_per_round'])})",
            f">= {targets['messages_vs_chat_tok_s_min']}x: {met(result['messages_throughput_target_met'])}",
        ],
        [
            "1 stream: TTFT p50",
            spread(tchat["ttft_ms_p50"], tchat["spread"]) + " ms",
            spread(tmessages["ttft_ms_p50"], tmessages["spread"]) + " ms",
            f"**{result['messages_minus_chat_ttft_ms']:+.1f} ms**",
            f"<= +{targets['messages_ttft_delta_ms_max']:g} ms: {met(result['messages_ttft_target_met'])}",
        ],
    ]
    header = [
        "workload",
        "Chat Completions, median (min-max)",
        "Messages, median (min-max)",
        "Messages against Chat Completions",
        "target",
    ]
    return [*lines, "", *table(header, rows)]


TABLES = (Table("http-vs-grpc", ("http-vs-grpc-cpu.json",), http_vs_grpc),)
