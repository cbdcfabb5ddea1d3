"""The features' tables: speculative decoding, the int8 KV cache, prefix caching and routing, log
probabilities and n samples, structured output.

Each function turns quotable records (by file name) into markdown lines for docs/benchmarks.md and
docs/structured-output.md and docs/speculative-decoding.md; `TABLES` declares which record each reads.
This module must not read files or judge a figure against anything but the targets the record itself
states.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from docs_tables_common import Record, Table, met, ratio, runs, stats, table

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping


def _target(entry: Mapping[str, Any]) -> str:
    return f"{entry['target']}: {met(entry['met'])}" if "target" in entry else ""


def prefix_cache(records: Mapping[str, Record]) -> list[str]:
    data = records["prefix-cache-cpu.json"].data
    shared, chat, targets = data["shared"]["summary"], data["chat"]["summary"], data["targets"]
    one = data["shared"]["one_stream"]
    p50, p99 = targets["shared_ttft_p50_off_over_on"], targets["shared_ttft_p99_off_over_on"]
    tps, total = targets["shared_tokens_per_s_on_over_off"], targets["chat_total_time_off_over_on"]
    on_turns = ", ".join(f"{v / 1000:.2f}" for v in chat["on"]["ttft_ms_p50_per_turn"])
    off_turns = ", ".join(f"{v / 1000:.2f}" for v in chat["off"]["ttft_ms_p50_per_turn"])
    rows = [
        [
            "512-token system prompt, 64 users at once",
            "TTFT p50 s",
            stats(shared["off"]["ttft_ms_p50"], 2, 1e-3),
            stats(shared["on"]["ttft_ms_p50"], 2, 1e-3),
            f"**{ratio(p50['median'], 1)}** lower (rounds {runs(p50['ratios'], 1)})",
            _target(p50),
        ],
        [
            "",
            "TTFT p99 s",
            stats(shared["off"]["ttft_ms_p99"], 2, 1e-3),
            stats(shared["on"]["ttft_ms_p99"], 2, 1e-3),
            f"rounds {runs(p99['ratios'], 1)} lower",
            "",
        ],
        [
            "",
            "generated tokens/s",
            stats(shared["off"]["tokens_per_s"]),
            stats(shared["on"]["tokens_per_s"]),
            f"**{ratio(tps['median'])}** (rounds {runs(tps['ratios'])})",
            _target(tps),
        ],
        [
            f"one stream, cached {one['prefix_tokens']:,}-token prefix "
            f"vs a {one['short_prompt_tokens']}-token prompt",
            "first token",
            f"{one['cold_ttft_ms'] / 1000:.2f} s cold",
            f"{min(one['cached_ttft_ms']):.0f}-{max(one['cached_ttft_ms']):.0f} ms vs "
            f"{min(one['short_ttft_ms']):.0f}-{max(one['short_ttft_ms']):.0f} ms",
            f"**{ratio(one['ratio_cached_to_short'])}** the short prompt's",
            f"{one['target']}: {met(one['met'])}",
        ],
        [
            "16 conversations x 6 turns resending history",
            "total time s",
            stats(chat["off"]["total_s"]),
            stats(chat["on"]["total_s"]),
            f"**{ratio(total['median'])}** less (rounds {runs(total['ratios'])})",
            _target(total),
        ],
        ["", "TTFT p50 per turn, s", off_turns, on_turns, "", ""],
    ]
    return table(["workload", "figure", "cache off", "cache on", "ratio", "target"], rows)


def prefix_routing(records: Mapping[str, Record]) -> list[str]:
    data = records["prefix-routing-cpu.json"].data
    summary, targets = data["summary"], data["targets"]
    prefix, least = summary["prefix"], summary["least_loaded"]
    hit, load = targets["hit_rate_prefix"], targets["max_load_share_prefix"]
    rows = [
        ["cache hit rate", stats(prefix["hit_rate"], 3), stats(least["hit_rate"], 3), _target(hit)],
        [
            "TTFT p50 ms",
            stats(prefix["ttft_ms_p50"], 0),
            stats(least["ttft_ms_p50"], 0),
            "least loaded against prefix-aware per round: "
            + runs(targets["ttft_p50_least_loaded_over_prefix"]),
        ],
        [
            "largest replica load over the average (max per round)",
            stats(prefix["max_over_average_load"], 2),
            stats(least["max_over_average_load"], 2),
            f"max {load['max_over_runs']:.2f}, {load['target']}: {met(load['met'])}",
        ],
    ]
    return table(["figure, median (min-max)", "prefix-aware", "least loaded", "target"], rows)


def logprobs(records: Mapping[str, Record]) -> list[str]:
    data = records["outputs-logprobs-cpu.json"].data["logprobs"]
    tps = data["tokens_per_s"]
    rows = [["plain", stats(tps["plain"]), ""]]
    for key, ratio_key in (
        ("logprobs5", "ratio_logprobs5_to_plain"),
        ("one_asks", "ratio_one_asks_to_plain"),
    ):
        rows.append([key, stats(tps[key]), f"**{data[ratio_key]:.2f}**"])
    return [
        *table(["contestant", "generated tokens/s, median (min-max)", "ratio to plain"], rows),
        "",
        f"Target: {data['target']}: {met(data['met'])}.",
    ]


def samples(records: Mapping[str, Record]) -> list[str]:
    data = records["outputs-samples-cpu.json"].data["samples"]
    rows = [
        [
            key,
            stats(data["wall_s"][key], 2) + " s",
            f"{data['tokens_per_s'][key]['median']:.1f}",
            f"{data['ttft_ms_p50'][key]['median']:.0f} ms",
            str(data["prefill_tokens"][key]),
        ]
        for key in ("n8", "separate8")
    ]
    header = ["contestant", "wall time, median (min-max)", "tokens/s", "TTFT p50", "prompt tokens computed"]
    return [
        *table(header, rows),
        "",
        f"n8 against separate8 in wall time: **{ratio(data['ratio_wall_n8_to_separate8'])}**; "
        f"target {data['target']}: {met(data['met'])}.",
    ]


def grammar_cost(records: Mapping[str, Record], record: str) -> list[str]:
    data = records[record].data
    tps, share = data["tokens_per_s"], data["mask_share_of_step_time"]
    rows = [
        [
            f"tokens/s, median (min-max) of {len(data['runs']['free'])} alternated runs",
            stats(tps["free"]),
            stats(tps["json_schema"]),
        ],
        [
            "ratio of medians",
            "",
            f"**{data['json_over_free']:.3f}** (per run: {runs(data['json_over_free_per_run'], 3)})",
        ],
        [
            "the mask's share of step time",
            "",
            f"{share['median']:.1%} ({data['mask_ms_per_step']['median']:.1f} ms per step; "
            f"{share['low']:.1%}-{share['high']:.1%} in every run)",
        ],
        ["cost to an unconstrained request", f"{data['unconstrained_hook_us_per_step']:.1f} us per step", ""],
    ]
    place = data.get("mask_placement_ms")
    if place:
        rows.append(
            [
                "one decode step: alone / the fill alone / one after the other / the fill on a thread",
                "",
                f"{place['step_ms']:.1f} / {place['mask_ms']:.2f} / {place['serial_ms']:.1f} / "
                f"{place['overlapped_ms']:.1f} ms",
            ]
        )
    cold = data.get("cold_compile")
    if cold:
        medians = [entry["median"] for entry in cold["per_schema_ms"].values()]
        rows.append(
            [
                "cold compile per schema (medians); the tokenizer's setup once per worker",
                "",
                f"{min(medians):.2f} to {max(medians):.2f} ms; {cold['tokenizer_setup_s']:.2f} s",
            ]
        )
    head = f"{data['streams']} streams x {data['new_tokens']} greedy tokens"
    return table([head, "free", "JSON schema on every request"], rows)


def grammar_quality(records: Mapping[str, Record]) -> list[str]:
    data = records["grammar-quality-cpu.json"].data
    rows = [
        [
            str(data["prompts"]),
            str(data["max_tokens"]),
            f"{data['stop_rate']:.0%}",
            f"{data['finished_valid_rate']:.0%}",
            f"{data['output_tokens']:,} in {data['wall_s']:.0f} s",
        ]
    ]
    header = [
        "prompts (greedy)",
        "max_tokens",
        "finish with `stop`",
        "of those, valid by `jsonschema`",
        "tokens",
    ]
    return table(header, rows)


def grammar_libs(records: Mapping[str, Record]) -> list[str]:
    data = records["grammar-libs-cpu.json"].data
    libs = ("llguidance", "xgrammar")

    def compile_range(lib: str) -> str:
        medians = [entry["median"] for entry in data[lib]["cold_compile_ms"].values()]
        return f"{min(medians):.2f} to {max(medians):.2f} ms"

    def cell(lib: str, key: str) -> str:
        return f"{data[lib]['mask_us_per_token'][key]['median']:.1f} us"

    rows = [
        ["declared requirements", *(", ".join(data[lib]["package"]["requires"]) or "none" for lib in libs)],
        ["installed size", *(f"{data[lib]['package']['installed_bytes'] / 1e6:.1f} MB" for lib in libs)],
        [
            "tokenizer setup, then the first grammar",
            *(
                f"{data[lib]['tokenizer_setup_s']:.2f} s, {data[lib]['first_compile_s']:.2f} s"
                for lib in libs
            ),
        ],
        ["cold compile per schema (medians)", *(compile_range(lib) for lib in libs)],
        [
            f"mask fill per token at {data['streams']} streams, one matcher at a time",
            *(cell(lib, "serial") for lib in libs),
        ],
        ["the same through the library's batch call", *(cell(lib, "parallel") for lib in libs)],
    ]
    header = ["", *(f"{lib} {data[lib]['package']['version']}" for lib in libs)]
    return table(header, rows)


def kv_cache(records: Mapping[str, Record]) -> list[str]:
    """The int8 KV cache's targets, one row each, as bench/kv_report.py judged them in the record."""
    data = records["kv-cache-cpu.json"].data
    return table(
        ["target", "measured", ""],
        [[line["target"], line["figure"], met(line["met"])] for line in data["targets"]],
    )


# What each rounding of bench/kv_schemes.py keeps of the keys and values: the reader's key to its rows.
KV_SCHEMES = {
    "int8": "int8 keys and values, one scale per row, unrotated",
    "int8-keys": "int8 keys, values unrounded",
    "int8-values": "int8 values, keys unrounded",
    "int8-hadamard": "int8 keys and values, each row Hadamard-rotated first (the cache's int8)",
    "int8-group32": "int8 keys and values, one scale per 32 values",
    "int8-hadamard-group32": "int8 keys and values, rotated, then one scale per 32 values",
    "bfloat16": "bfloat16 keys and values",
}


def kv_schemes(records: Mapping[str, Record]) -> list[str]:
    """Greedy agreement of each simulated cache rounding with the float32 cache."""
    data = records["kv-schemes-cpu.json"].data
    workload = data["workload"]
    rows = [
        [
            KV_SCHEMES.get(name, name),
            f"{found['agreement']:.1%}",
            f"{found['divergences']} of {found['prompts']}",
            "yes" if found["every_divergence_a_near_tie"] else "no",
        ]
        for name, found in data["schemes"].items()
    ]
    note = (
        f"{workload['prompts']} prompts ({workload['parity_prompts']} of the parity test, the rest "
        f"{workload['text_prompt_tokens']} tokens of bench/data's text), {workload['new_tokens']} greedy "
        "tokens each, the Python attention path over a float32 cache whose rows are rounded on the way in."
    )
    return [
        *table(
            ["rounding", "tokens before the first divergence", "prompts that diverge", "near ties only"], rows
        ),
        "",
        note,
    ]


def speculative_of(name: str) -> Callable[[Mapping[str, Record]], list[str]]:
    """The table of one bench/spec.py record: its targets as judged, then the model and counters."""

    def render(records: Mapping[str, Record]) -> list[str]:
        data = records[name].data
        one = data["one_stream"]
        rows = [[line["target"], line["figure"], met(line["met"])] for line in data["targets"]]
        drafted = sum(run["draft_tokens"] for run in one["on"]["runs"])
        kept = (
            f"{one['accepted_per_speculative_decode']:.2f} drafts kept per decode that drafted"
            if drafted
            else "no token drafted in the timed rounds: the draft-length rule priced every draft "
            "above what it buys"
        )
        note = (
            f"{Path(data['workload']['model']).name}, one stream: "
            f"{one['off']['tok_s']['median']:.1f} tokens/s without speculation, "
            f"{one['on']['tok_s']['median']:.1f} with it (medians of {len(one['on']['runs'])} rounds); "
            f"{kept}."
        )
        return [*table(["target", "measured", ""], rows), "", note]

    return render


def spec_sides(name: str, sides: tuple[str, str]) -> Callable[[Mapping[str, Record]], list[str]]:
    """The table of a record that sets two speculating sides against each other (bench/spec_stack.py,
    bench/spec_peer.py): its target as judged, then each side's speed and acceptance."""

    def render(records: Mapping[str, Record]) -> list[str]:
        data = records[name].data
        rows = [[line["target"], line["figure"], met(line["met"])] for line in data["targets"]]
        figures = [
            [side, f"{data[side]['tok_s']['median']:.1f}", f"{100 * data[side]['acceptance_rate']:.0f}%"]
            for side in sides
        ]
        return [
            *table(["target", "measured", ""], rows),
            "",
            *table(["", "tokens/s (median)", "drafts kept"], figures),
        ]

    return render


TABLES = (
    Table("spec", ("spec-cpu.json",), speculative_of("spec-cpu.json")),
    Table("spec-qwen", ("spec-qwen15-cpu.json",), speculative_of("spec-qwen15-cpu.json")),
    Table("spec-draft", ("spec-draft-qwen15-cpu.json",), speculative_of("spec-draft-qwen15-cpu.json")),
    Table("spec-stack", ("spec-stack-cpu.json",), spec_sides("spec-stack-cpu.json", ("engine", "stack"))),
    Table("spec-peer", ("spec-peer-cpu.json",), spec_sides("spec-peer-cpu.json", ("strata", "llama.cpp"))),
    Table(
        "spec-peer-qwen",
        ("spec-peer-qwen15-cpu.json",),
        spec_sides("spec-peer-qwen15-cpu.json", ("strata", "llama.cpp")),
    ),
    Table(
        "spec-peer-draft",
        ("spec-peer-draft-qwen15-cpu.json",),
        spec_sides("spec-peer-draft-qwen15-cpu.json", ("strata", "llama.cpp")),
    ),
    Table("kv-cache", ("kv-cache-cpu.json",), kv_cache),
    Table("kv-schemes", ("kv-schemes-cpu.json",), kv_schemes),
    Table("prefix-cache", ("prefix-cache-cpu.json",), prefix_cache),
    Table("prefix-routing", ("prefix-routing-cpu.json",), prefix_routing),
    Table("outputs-logprobs", ("outputs-logprobs-cpu.json",), logprobs),
    Table("outputs-samples", ("outputs-samples-cpu.json",), samples),
    Table(
        "grammar-cost",
        ("grammar-cost-cpu.json",),
        lambda records: grammar_cost(records, "grammar-cost-cpu.json"),
    ),
    Table(
        "grammar-cost-5runs",
        ("grammar-cost-cpu-5runs.json",),
        lambda records: grammar_cost(records, "grammar-cost-cpu-5runs.json"),
    ),
    Table("grammar-quality", ("grammar-quality-cpu.json",), grammar_quality),
    Table("grammar-libs", ("grammar-libs-cpu.json",), grammar_libs),
)
