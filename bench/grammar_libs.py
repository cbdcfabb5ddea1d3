"""Which grammar library: llguidance against xgrammar on this CPU, with the model's own tokenizer.

Measures, per library: what installing it pulls in (its declared requirements, which of them this
environment lacks, its installed size; wheel sizes when `--wheels DIR` holds the downloaded wheels),
the one-off tokenizer setup and first compile (llguidance builds its token trie then), the cold
compile time of each schema in bench/grammar_schemas.py (no
cache: a new compiler each time, up to the first mask), and the mask time per token at `--streams`
streams (every stream walks a sample document token by token; each step fills all streams' masks
into one bitmask). The two contestants alternate round by round (bench/README.md rule 7). Both run
with the same thread count. xgrammar is not a dependency of the project: `make bench-grammar-libs`
installs it into build/xgrammar (without its requirements, triton among them) for this run alone.

This module must not be imported by the service: it is a program that writes one JSON record.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench.grammar_schemas import SCHEMAS, sample_text
from bench.provenance import finish_provenance, start_provenance
from bench.stats import DEFAULT_MODEL, save_record, summarize

SEPARATORS = (", ", ": ")


def _dist_facts(name: str, wheels: Path | None) -> dict[str, Any]:
    dist = importlib.metadata.distribution(name)
    requires = [r for r in dist.requires or [] if "extra ==" not in r]
    missing = []
    for req in requires:
        base = req.split(";")[0].split(" ")[0]
        for sep in "<>=!~[":
            base = base.split(sep)[0]
        try:
            importlib.metadata.distribution(base)
        except importlib.metadata.PackageNotFoundError:
            missing.append(base)
    size = sum(f.size or 0 for f in dist.files or [])
    facts: dict[str, Any] = {
        "version": dist.version,
        "requires": requires,
        "requires_missing_here": missing,
        "installed_bytes": size,
    }
    if wheels is not None:
        facts["wheels_bytes"] = {p.name: p.stat().st_size for p in sorted(wheels.glob("*.whl"))}
    return facts


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: int, threads: int) -> None:
        import llguidance

        self.ll = llguidance
        started = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        self.setup_s = time.perf_counter() - started
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.vocab = self.tokenizer.vocab_size

    def grammar(self, schema: dict[str, Any]) -> str:
        options = {
            "item_separator": SEPARATORS[0],
            "key_separator": SEPARATORS[1],
            "whitespace_flexible": False,
        }
        return str(self.ll.LLMatcher.grammar_from_json_schema(schema, overrides=options))  # type: ignore[arg-type]

    def compile(self, schema: dict[str, Any]) -> Any:
        matcher = self.ll.LLMatcher(self.tokenizer, self.grammar(schema))
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.tokenize_str(text))

    def fill(self, matchers: list[Any], bitmask: torch.Tensor, parallel: bool) -> None:
        from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

        if parallel:
            fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        else:
            for i, m in enumerate(matchers):
                fill_next_token_bitmask(m, bitmask, i)

    def consume(self, matcher: Any, token: int) -> None:
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_dir: Path, eos: int, threads: int) -> None:
        import xgrammar
        from transformers import AutoTokenizer

        self.xgr = xgrammar
        self.hf = AutoTokenizer.from_pretrained(tokenizer_dir)
        started = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(self.hf, stop_token_ids=[eos])
        self.setup_s = time.perf_counter() - started
        self.threads = threads
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.vocab = self.info.vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        compiled = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS
        )
        return self.xgr.GrammarMatcher(compiled)

    def tokenize(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def fill(self, matchers: list[Any], bitmask: torch.Tensor, parallel: bool) -> None:
        if parallel:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)

    def consume(self, matcher: Any, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")


def _first_compile(lib: Any) -> float:
    """The first grammar after the tokenizer: one-off work that a worker pays at load, not per schema."""
    started = time.perf_counter()
    matcher = lib.compile({"type": "object"})
    lib.fill([matcher], torch.zeros((1, (lib.vocab + 31) // 32), dtype=torch.int32), parallel=False)
    return time.perf_counter() - started


def _compile_round(lib: Any, first_mask: torch.Tensor) -> dict[str, float]:
    times = {}
    for name, schema in SCHEMAS.items():
        started = time.perf_counter()
        matcher = lib.compile(schema)
        lib.fill([matcher], first_mask, parallel=False)
        times[name] = time.perf_counter() - started
    return times


def _mask_round(lib: Any, streams: int, parallel: bool) -> tuple[float, int]:
    """Seconds spent filling masks per token (all streams' fills of a step, over its streams)."""
    names = list(SCHEMAS)
    prototypes = {n: lib.compile(SCHEMAS[n]) for n in names}
    docs = {n: lib.tokenize(sample_text(n)) for n in names}
    rows = [(n, docs[n]) for n in (names[i % len(names)] for i in range(streams))]
    matchers = [
        lib.compile(SCHEMAS[n]) if lib.name == "xgrammar" else prototypes[n].deep_copy() for n, _ in rows
    ]
    bitmask = torch.zeros((streams, (lib.vocab + 31) // 32), dtype=torch.int32)
    spent, tokens = 0.0, 0
    for step in range(max(len(d) for _, d in rows)):
        live = [i for i, (_, d) in enumerate(rows) if step < len(d)]
        batch = [matchers[i] for i in live]
        started = time.perf_counter()
        lib.fill(batch, bitmask[: len(batch)], parallel)
        spent += time.perf_counter() - started
        tokens += len(batch)
        for i in live:
            lib.consume(matchers[i], rows[i][1][step])
    return spent / tokens, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--wheels", type=Path, default=None, help="folder of downloaded wheels to size")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    provenance = start_provenance()
    config = json.loads((args.model / "config.json").read_text())
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], int) else config["eos_token_id"][0]
    libs: list[Any] = [Llguidance((args.model / "tokenizer.json").read_text(), eos, args.threads)]
    try:
        libs.append(Xgrammar(args.model, eos, args.threads))
    except ImportError as exc:
        print(f"xgrammar not importable ({exc}); measuring llguidance alone")
    first_s = {lib.name: _first_compile(lib) for lib in libs}
    compile_s: dict[str, dict[str, list[float]]] = {lib.name: {n: [] for n in SCHEMAS} for lib in libs}
    mask_s: dict[str, dict[str, list[float]]] = {lib.name: {"serial": [], "parallel": []} for lib in libs}
    for run in range(args.runs):
        for lib in libs if run % 2 == 0 else reversed(libs):
            first = torch.zeros((1, (lib.vocab + 31) // 32), dtype=torch.int32)
            for n, t in _compile_round(lib, first).items():
                compile_s[lib.name][n].append(t)
            for mode in ("serial", "parallel"):
                per_token, _ = _mask_round(lib, args.streams, mode == "parallel")
                mask_s[lib.name][mode].append(per_token)
    record: dict[str, Any] = {"benchmark": "grammar-libs", "streams": args.streams, "runs": args.runs}
    for lib in libs:
        dist = "llguidance" if lib.name == "llguidance" else "xgrammar"
        record[lib.name] = {
            "package": _dist_facts(dist, args.wheels),
            "tokenizer_setup_s": lib.setup_s,
            "first_compile_s": first_s[lib.name],
            "vocab": lib.vocab,
            "cold_compile_ms": {n: _ms(v) for n, v in compile_s[lib.name].items()},
            "mask_us_per_token": {m: _us(v) for m, v in mask_s[lib.name].items()},
        }
    record["provenance"] = finish_provenance(provenance)
    record["valid"] = args.runs >= 3
    for lib in libs:
        r = record[lib.name]
        print(
            f"{lib.name:11s} setup {r['tokenizer_setup_s']:.2f} s first {r['first_compile_s']:.2f} s "
            + " ".join(f"{n}={v['median']:.1f}ms" for n, v in r["cold_compile_ms"].items())
            + f"  mask/token serial {r['mask_us_per_token']['serial']['median']:.1f} us"
            + f" parallel {r['mask_us_per_token']['parallel']['median']:.1f} us"
        )
    save_record(record, args.json)
    return 0


def _ms(values: list[float]) -> dict[str, float]:
    s = summarize([v * 1e3 for v in values])
    return {"median": s.median, "low": s.low, "high": s.high}


def _us(values: list[float]) -> dict[str, float]:
    s = summarize([v * 1e6 for v in values])
    return {"median": s.median, "low": s.low, "high": s.high}


if __name__ == "__main__":
    raise SystemExit(main())
