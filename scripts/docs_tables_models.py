"""The models' tables: each fetched model's cost and quality, the real models' parity, make run's memory.

Each function turns quotable records (docs_tables_common.Record, by file name) into markdown lines;
`TABLES` declares which record each table of docs/models.md and docs/deployment.md reads. This module
must not read files or judge a figure against a target the record does not state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from docs_tables_common import Record, Table, met, ratio, stats, table

if TYPE_CHECKING:
    from collections.abc import Mapping


def models(records: Mapping[str, Record]) -> list[str]:
    data = records["models-cpu.json"].data
    work = data["workload"]
    many = str(work["streams"][1])
    entries = data["models"]
    base = next(iter(entries.values()))
    rows = []
    for name, entry in entries.items():
        one = entry["streams"]["1"]["decode_tok_s"]
        batch = entry["streams"][many]["tok_s"]
        rows.append(
            [
                f"`{name}`",
                f"{entry['weights_bytes'] / 1e9:.2f}",
                f"{1000 / one['median']:.1f}",
                stats(one),
                stats(batch),
                ratio(base["streams"][many]["tok_s"]["median"] / batch["median"]),
                f"{entry['perplexity']:.2f}",
            ]
        )
    header = [
        "model (float32)",
        "weights, GB",
        "ms per token, 1 stream",
        "decode tok/s, 1 stream",
        f"tok/s, {many} streams",
        f"cost per token against `{next(iter(entries))}` at {many} streams",
        "perplexity",
    ]
    text = next(iter(entries.values()))["text"]
    return [
        *table(header, rows),
        "",
        f"{work['prompt_tokens']} prompt and {work['new_tokens']} new tokens a stream, median (min-max) of "
        f"{work['rounds']} alternated rounds; perplexity on `bench/data/{text['path']}` in windows of "
        f"{work['perplexity_context']} tokens (each model's own tokenizer), as bench.perplexity counts it.",
    ]


def model_parity(records: Mapping[str, Record]) -> list[str]:
    data = records["model-parity-cpu.json"].data
    rows = [
        [
            f"`{name}`",
            f"{entry['prompts']} / {entry['positions']}",
            f"{entry['max_abs_logit_error']:.2e}",
            f"{entry['max_error_over_logit_range']:.2e}",
            f"{entry['top1_agreement']:.1%}",
        ]
        for name, entry in data["models"].items()
    ]
    header = [
        "model",
        "prompts / positions",
        "largest logit difference",
        "largest difference over the position's logit range",
        "same top token",
    ]
    return [
        *table(header, rows),
        "",
        f"Our float32 logits against transformers' at each of its {data['new_tokens']} greedy steps per "
        "prompt (its tokens fed to ours in one prefill).",
    ]


def run_memory(records: Mapping[str, Record]) -> list[str]:
    data = records["run-memory-cpu.json"].data
    mib = 2**20
    rows = [
        [
            f"`{name}`",
            f"{e['rss_bytes'] / mib:.0f}",
            f"{e['pss_bytes'] / mib:.0f}",
            f"{e['hwm_bytes'] / mib:.0f}",
        ]
        for name, e in data["services"].items()
    ]
    pss, rss = data["total_pss_bytes"] / 1e9, data["total_rss_bytes"] / 1e9
    rows.append(["**in all**", f"{rss:.2f} GB", f"**{pss:.2f} GB**", "-"])
    caches = ", ".join(
        f"`{name}` {cache['kv_cache_bytes'] / mib:.0f} MiB = {cache['kv_tokens']:,} tokens "
        f"(sized by {cache['sized_by']})"
        for name, cache in data["kv_caches"].items()
    )
    work, target = data["workload"], data["target"]
    return [
        *table(["service", "resident (RSS), MiB", "proportional (PSS), MiB", "peak RSS, MiB"], rows),
        "",
        f"`{data['config']}` after {work['requests']} requests of {work['new_tokens']} tokens. "
        f"KV caches: {caches}. Target: at most {target['total_pss_bytes'] / 1e9:g} GB in all, each page "
        f"counted once (PSS): {met(target['met'])}; summed per process (RSS) the stack holds {rss:.2f} GB.",
    ]


def generate_cli(records: Mapping[str, Record]) -> list[str]:
    data = records["generate-cli-cpu.json"].data
    rows = [
        [
            f"`{folder}`",
            stats(entry["decode_tok_s"]),
            stats(entry["first_token_ms"], digits=0),
            "/".join(str(n) for n in entry["new_tokens"]),
            ratio(entry["vs_last"]),
        ]
        for folder, entry in data["folders"].items()
    ]
    last = f"`{next(reversed(data['folders']))}`"
    header = ["model folder", "decode tok/s", "first token, ms", "new tokens per round", f"against {last}"]
    return [
        *table(header, rows),
        "",
        f"`strata generate --local --chat`, greedy, at most {data['max_new_tokens']} new tokens, one "
        f"process a run, median (min-max) of {data['rounds']} alternated rounds; the decode rate leaves "
        "out the first token (prompt and start-up).",
    ]


TABLES = (
    Table("generate-cli", ("generate-cli-cpu.json",), generate_cli),
    Table("models", ("models-cpu.json",), models),
    Table("model-parity", ("model-parity-cpu.json",), model_parity),
    Table("run-memory", ("run-memory-cpu.json",), run_memory),
)
