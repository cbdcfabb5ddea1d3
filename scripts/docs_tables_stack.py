"""The whole stack's tables: `strata bench` levels, the fallback under overload, tenants, tracing.

Each function turns quotable records (by file name) into markdown lines for docs/benchmarks.md,
docs/cpu-speed.md and docs/observability.md; `TABLES` declares which record each reads. This module
must not read files or judge a figure against anything but the targets the record itself states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from docs_tables_common import Record, Table, met, ratio, runs, spread, table

if TYPE_CHECKING:
    from collections.abc import Mapping


def stack_rows(data: Mapping[str, Any]) -> list[str]:
    rows = []
    for level in data["levels"]:
        ttft, itl = level["ttft_ms"], level["itl_ms"]
        rows.append(
            [
                str(level["concurrency"]),
                spread(level["output_tok_s"], level["output_tok_s_spread"]),
                f"{ttft['p50']:.0f} / {ttft['p99']:.0f} ms",
                f"{itl['p50']:.0f} / {itl['p99']:.0f} ms",
                f"{level['e2e_ms']['p50'] / 1000:.2f} s",
            ]
        )
    lines = table(
        ["streams", "tok/s, median (min-max)", "TTFT p50 / p99", "inter-token p50 / p99", "end-to-end p50"],
        rows,
    )
    base, target = data.get("engine_baseline"), data.get("target")
    if base and target:
        lines += [
            "",
            f"The in-process engine on the same requests ({base['concurrency']} in flight): "
            f"{spread(base['tok_s'], base['tok_s_spread'])} tok/s, TTFT p50 {base['ttft_p50_ms']:.1f} ms. "
            f"The stack against it: **{ratio(target['throughput_ratio'], 3)}** the tok/s (rounds "
            f"{runs(target['throughput_ratio_runs'], 3)}; target >= {target['throughput_ratio_min']}: "
            f"{met(target['throughput_pass'])})"
            + (
                f", **{ratio(target['ttft_ratio'])}** its TTFT p50 (target <= {target['ttft_ratio_max']}: "
                f"{met(target['ttft_pass'])})"
                if "ttft_ratio" in target
                else ""
            )
            + f"; outputs identical on {base['outputs_identical_to_stack']} of "
            f"{base['outputs_compared']} requests.",
        ]
    return lines


def stack_table(name: str, record: str) -> Table:
    return Table(name, (record,), lambda records: stack_rows(records[record].data))


def request_path(records: Mapping[str, Record]) -> list[str]:
    data = records["request-path.json"].data
    return [
        f"One streaming request runs code in {data['gateway_modules_run_count']} of the "
        f"{data['gateway_modules_total']} gateway modules and makes {data['gateway_types_made_count']} "
        "gateway types.",
        *_walk(data.get("walk_from_serve")),
        *_upward(data.get("upward_calls")),
    ]


def request_path_before(records: Mapping[str, Record]) -> list[str]:
    """The same census of an earlier checkout (`--tree`), to set beside the current one."""
    data = records["request-path-before.json"].data
    return [
        f"The same script on the checkout of {data['measured_tree'][:7]}: "
        f"{data['gateway_modules_run_count']} modules run, {data['gateway_types_made_count']} types made.",
        *_walk(data.get("walk_from_serve")),
        *_upward(data.get("upward_calls")),
    ]


def _upward(upward: Mapping[str, Any] | None) -> list[str]:
    """The calls up the import graph, when the record counts them."""
    if upward is None:
        return []
    return [
        "",
        "Calls from a gateway module into one that imports it (a callback up the layers): "
        f"{upward['count']}.",
        *(f"- `{call}`" for call in upward["calls"]),
    ]


def _walk(walk: Mapping[str, Any] | None) -> list[str]:
    """The walk from Pipeline._serve, when the record has one."""
    if walk is None:
        return []
    most = ", ".join(f"{module} {count}" for module, count in list(walk["stops_per_module"].items())[:4])
    return [
        "",
        f"Read from `Pipeline._serve` on, function by function as each is first called, the path makes "
        f"{walk['stops']} stops in {walk['modules']} modules, {walk['returns_to_a_module_left']} of them "
        f"returns to a module already left; most stops: {most}.",
    ]


BEFORE_AFTER_TARGETS = (0.97, 1.03)
"""After against before: output tokens/s at the top concurrency at least the first, one stream's TTFT
p50 at most the second."""
_BEFORE_AFTER_FIGURES = ("output_tok_s", "ttft_p50_ms_one_stream")


def before_after(records: Mapping[str, Record]) -> list[str]:
    """Two checkouts alternated through `strata bench` (bench/before_after.py): each side's medians
    and spreads, and the ratios after / before against their bounds."""
    data = records["stack-before-after-cpu.json"].data
    top = data["after"]["concurrency"]
    rows = [
        [
            f"{name} ({data['commits'][name][:7]})",
            *(spread(data[name][key]["median"], data[name][key]["spread"]) for key in _BEFORE_AFTER_FIGURES),
        ]
        for name in ("before", "after")
    ]
    speed = data["ratios"]["output_tok_s_after_over_before"]
    ttft = data["ratios"]["ttft_p50_one_stream_after_over_before"]
    least, most = BEFORE_AFTER_TARGETS
    verdicts = [
        [f"{top} streams' tokens/s, after >= {least}x before", ratio(speed), met(speed >= least)],
        [f"one stream's TTFT p50, after <= {most}x before", ratio(ttft), met(ttft <= most)],
    ]
    return [
        *table(["checkout", f"output tokens/s at {top} streams", "TTFT p50 at 1 stream (ms)"], rows),
        "",
        *table(["target (medians of the rounds)", "measured", ""], verdicts),
    ]


def fallback(records: Mapping[str, Record], record: str) -> list[str]:
    rows = []
    for rate in records[record].data["rates"]:
        target = rate["target"]
        for phase_name in ("off", "on"):
            phase = rate["phases"][phase_name]
            p99 = target["ttft_p99"][phase_name]
            worst = " / ".join(
                f"{p99[route]['value_ms'] / 1000:.2f} s" for route in ("primary", "fallback") if route in p99
            )
            refusal = target["gateway_refusal_p99"][phase_name]
            rows.append(
                [
                    f"{rate['rate_rps']:g}/s",
                    f"fallback {phase_name}",
                    worst,
                    spread(phase["goodput_tok_s"], phase["goodput_tok_s_spread"]),
                    f"{phase['itl_ms']['p99']:.0f}",
                    f"{refusal['p99_ms']:g} ms" if refusal.get("known") else "unknown",
                    f"{phase['admitted']} / {phase['refused']}",
                ]
            )
        rows.append(
            [
                f"{rate['rate_rps']:g}/s",
                "on against off",
                met(target["ttft_pass"]) + f" (limit {target['ttft_p99_slo_factor']}x the SLO)",
                f"**{ratio(target['goodput_ratio'])}** (rounds {runs(target['goodput_ratio_runs'])}; "
                f">= {target['goodput_ratio_min']}: {met(target['goodput_pass'])})",
                "",
                met(target["gateway_refusal_pass"]),
                "",
            ]
        )
    header = [
        "rate",
        "phase",
        "admitted TTFT p99, primary / fallback (worst round)",
        "goodput tok/s, median (min-max)",
        "ITL p99 ms",
        "gateway refusal decision p99",
        "admitted / refused",
    ]
    return table(header, rows)


def tenants(records: Mapping[str, Record]) -> list[str]:
    data = records["tenants-cpu.json"].data
    contestants = data["contestants"]
    rows = []
    for key, label in (("on", "fair queuing"), ("off", "FIFO")):
        entry = contestants[key]
        quiet, noisy = entry["tenants"]["quiet"], entry["tenants"]["noisy"]
        rows.append(
            [
                label,
                spread(
                    entry["quiet_admitted_ttft_p99_ms"] / 1000,
                    [v / 1000 for v in entry["quiet_admitted_ttft_p99_ms_spread"]],
                    2,
                )
                + " s",
                spread(entry["quiet_served_share"], entry["quiet_served_share_spread"], 3),
                f"{noisy['goodput_tok_s']:.1f} / {quiet['goodput_tok_s']:.1f}",
                spread(entry["jain_index"], entry["jain_index_spread"], 3),
                f"{quiet['refused']} of {quiet['offered']}",
            ]
        )
    header = [
        "contestant",
        "quiet TTFT p99, median (rounds)",
        "quiet served share, median (rounds)",
        "goodput noisy / quiet tok/s",
        "Jain's index, median (rounds)",
        "quiet requests refused",
    ]
    rates = data["rates"]
    judged = data["target"][data["target"]["judged"]]
    worst = judged["quiet_ttft_p99"], judged["quiet_served_share"], judged["jain_index"]
    return [
        *table(header, rows),
        "",
        f"Capacity measured in the same run: {rates['noisy']['capacity_rps']:.2f} requests/s for the noisy "
        f"shape, {rates['quiet']['capacity_rps']:.2f} for the quiet one, so {rates['noisy']['rate_rps']:.2f} "
        f"and {rates['quiet']['rate_rps']:.2f} requests/s offered. Fair queuing's worst round: quiet p99 "
        f"{worst[0]['value_ms'] / 1000:.2f} s (within {worst[0]['limit_ms'] / 1000:g} s: "
        f"{met(worst[0]['pass'])}), "
        f"served share {worst[1]['value']:.3f} (>= {worst[1]['min']}: {met(worst[1]['pass'])}), Jain's index "
        f"{worst[2]['value']:.3f} (>= {worst[2]['min']}: {met(worst[2]['pass'])}).",
    ]


def trace_overhead(records: Mapping[str, Record]) -> list[str]:
    data = records["trace-overhead-cpu.json"].data
    rows = []
    for key, label in (("off", "off"), ("on", "on, sampling 1.0")):
        mode = data["modes"][key]
        per = mode["per_process_cpu_s_per_request"]
        rows.append(
            [
                label,
                spread(
                    mode["cpu_s_per_request"] * 1000, [v * 1000 for v in mode["cpu_s_per_request_spread"]]
                ),
                f"{mode['spans_per_request']:.1f}",
                *(f"{per[p] * 1000:.1f}" for p in ("gateway", "tokenizer", "worker 0", "worker 1")),
            ]
        )
    target = data["target"]
    header = [
        "tracing",
        "CPU ms per request, median (min-max)",
        "spans per request",
        "gateway",
        "tokenizer",
        "worker",
        "fallback worker (idle)",
    ]
    return [
        *table(header, rows),
        "",
        f"Tracing on against off: **{ratio(target['cpu_ratio_on_off'], 3)}** the CPU per request (pairs "
        f"{runs(target['cpu_ratio_on_off_pairs'])}; target <= {target['cpu_ratio_max']}: "
        f"{met(target['pass'])}).",
    ]


def containers(records: Mapping[str, Record]) -> list[str]:
    """The images' sizes and build times, and the compose stack's start and restart times."""
    images, compose = records["images-cpu.json"].data, records["compose-cpu.json"].data
    rows = [
        [
            f"`{tag}`",
            f"{figures['size_bytes'] / 2**20:,.0f} MiB",
            f"{figures['cold_build_s']:.0f} s",
            f"{figures['cached_build_s']:.1f} s",
        ]
        for tag, figures in images["images"].items()
    ]
    lines = table(["image", "size", "cold build (`--no-cache`)", "rebuild, nothing changed"], rows)
    figures = compose["figures"]
    return [
        *lines,
        "",
        f"Docker Engine {images['engine']['version']} ({images['engine']['origin']}); base "
        f"`{images['base_image']}`, found or made in {images['base_image_s']:.0f} s; torch from "
        f"`{images['torch_source']}`. The compose stack ({', '.join(compose['services'])}): "
        f"`up` to every container healthy **{figures['up_to_healthy_s']:.0f} s**; a worker's process "
        "killed to healthy again, restarted by its restart policy, "
        f"**{figures['worker_restart_to_healthy_s']:.0f} s**.",
    ]


def serve_peer(records: Mapping[str, Record], name: str) -> list[str]:
    """One row per level: both servers' tokens/s and the ratio, time to first token and the gap between
    tokens at p50 (medians over rounds)."""
    data = records[name].data
    rows = []
    for key, row in data["summary"].items():
        ours, theirs = row["strata"], row["llama.cpp"]
        per_round = [r for r in row["strata_vs_llama_cpp_tok_s_per_round"] if r is not None]
        shape, streams = key.split("@")
        rows.append(
            [
                f"{shape} tokens, {streams} stream{'' if streams == '1' else 's'}",
                spread(
                    ours["output_tok_s"]["median"], [ours["output_tok_s"]["min"], ours["output_tok_s"]["max"]]
                ),
                spread(
                    theirs["output_tok_s"]["median"],
                    [theirs["output_tok_s"]["min"], theirs["output_tok_s"]["max"]],
                ),
                f"{ratio(row['strata_vs_llama_cpp_tok_s'])} ({min(per_round):.2f}-{max(per_round):.2f})",
                f"{ours['ttft_ms_p50']['median']:.0f} / {theirs['ttft_ms_p50']['median']:.0f} ms",
                f"{ours['itl_ms_p50']['median']:.0f} / {theirs['itl_ms_p50']['median']:.0f} ms",
            ]
        )
    header = ["level", "Strata tok/s", "llama-server tok/s", "ratio", "TTFT p50 (S / L)", "ITL p50 (S / L)"]
    llama = data["llama_cpp"]
    lines = [
        *table(header, rows),
        "",
        f"`/v1/completions`, streamed, greedy, EOS ignored, median (min-max) of {data['workload']['rounds']} "
        f"alternated rounds; llama-server on `{llama['gguf']}`, {llama['slots']} slots, "
        f"{llama['threads']} threads; Strata from `{data['strata']['config']}`.",
    ]
    if not data["valid"]:
        kinds = sorted(
            {kind for run in data["rounds"] for level in run["levels"] for kind in level["error_kinds"]}
        )
        failed = ", ".join(f"{name} {count}" for name, count in data["errors"].items() if count)
        lines.append(
            f"The record is marked not valid: failed requests ({failed}: {'; '.join(kinds)}); each level's "
            "rate counts the requests that completed."
        )
    return lines


TABLES = (
    stack_table("stack", "stack-cpu.json"),
    stack_table("stack-one-stream", "stack-1-stream-cpu.json"),
    Table("request-path", ("request-path.json",), request_path),
    Table("request-path-before", ("request-path-before.json",), request_path_before),
    Table("stack-before-after", ("stack-before-after-cpu.json",), before_after),
    Table("fallback", ("stack-rate-cpu.json",), lambda records: fallback(records, "stack-rate-cpu.json")),
    Table(
        "fallback-qwen",
        ("stack-rate-qwen-cpu.json",),
        lambda records: fallback(records, "stack-rate-qwen-cpu.json"),
    ),
    Table("tenants", ("tenants-cpu.json",), tenants),
    Table("serve-peer", ("serve-peer-cpu.json",), lambda records: serve_peer(records, "serve-peer-cpu.json")),
    Table(
        "serve-peer-avx2",
        ("serve-peer-avx2-cpu.json",),
        lambda records: serve_peer(records, "serve-peer-avx2-cpu.json"),
    ),
    Table(
        "serve-peer-qwen",
        ("serve-peer-qwen05-cpu.json",),
        lambda records: serve_peer(records, "serve-peer-qwen05-cpu.json"),
    ),
    Table("trace-overhead", ("trace-overhead-cpu.json",), trace_overhead),
    Table("containers", ("images-cpu.json", "compose-cpu.json"), containers),
)
