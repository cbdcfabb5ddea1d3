"""`python -m bench.spec_peer` (`make bench-spec-peer`): Strata's speculative decoding against llama.cpp's
own (built as `make bench-peer` builds llama.cpp), one stream, on the same model and prompts: prompt
lookup against `llama-lookup`, or with `--draft-model` a draft model against `llama-speculative`
drafting with that model's GGUF file.

The model is `--model`'s: a float checkpoint's folder (llama.cpp gets its F32 conversion, so both
sides compute in float32) or a folder holding a GGUF file (both sides serve that file as it is).
Each round runs bench/data/spec-prompts.json's 32 prompts, through the model's chat template, one at
a time on both sides, the order flipped every round: here through LLMEngine.generate with
engine.speculative `{method: ngram, num_tokens: --draft-max}` (or `{method: draft, ...,
draft_model_path}`), there one `llama-lookup` (or `llama-speculative -md`) run per prompt
(`--draft-max` drafts, greedy, `--threads`, llama.cpp's other drafting settings as it ships them),
up to `--new-tokens` tokens each, EOS ending one early on both sides. A side's rate is its generated
tokens over its time: our wall time around the engine's calls, llama.cpp's own encode-plus-decode
seconds as it prints them (its model load is left out, ours was done before). Acceptance is each
side's kept drafts over drafted tokens. The two models' numerics differ, so their texts may too: the
record keeps both sides' token counts.
Target: ours at least 1.0x llama.cpp's. It writes `--json` (bench/results/spec-peer-cpu.json) with
bench/provenance.py's block; the verdict is arithmetic on the record.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.peer_setup import Peer, build_info, prepare, prepare_file
from bench.provenance import finish_provenance, start_provenance
from bench.spec import WORKLOAD, engine, ratio_figure, run, two_sides, workload_ids, workload_texts
from bench.stats import DEFAULT_MODEL, print_targets, save_record

SIDES = ("strata", "llama.cpp")
RATIO_TARGET = 1.0
_TIMES = re.compile(r"(?P<kind>encoded|decoded)\s+(?P<tokens>\d+) tokens in\s+(?P<seconds>[\d.]+) seconds")
_COUNTS = re.compile(r"\b(?P<name>n_predict|n_drafted|n_accept)\s+= (?P<value>\d+)$", re.MULTILINE)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.spec_peer", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--draft-model", type=Path, default=None, help="the draft model's folder (a GGUF inside)")
    p.add_argument("--draft-max", type=int, default=4, help="most drafted tokens a step, both sides")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--json", type=Path, default=Path("bench/results/spec-peer-cpu.json"))
    args = p.parse_args(argv)
    if args.rounds < 5:
        p.error(f"--rounds {args.rounds}: ratios need at least 5 alternated rounds")
    return args


def peer_for(model: Path) -> tuple[Peer, Path]:
    """llama.cpp prepared for the model folder, and the GGUF file it serves."""
    shipped = sorted(model.glob("*.gguf"))
    if shipped:
        peer = prepare_file(shipped[0])
        return peer, peer.models["gguf"]
    peer = prepare(model, ("f32",))
    return peer, peer.models["f32"]


def draft_file(draft_model: Path) -> Path:
    """The GGUF file llama-speculative drafts with: the one in the draft model's folder, as shipped."""
    shipped = sorted(draft_model.glob("*.gguf"))
    if not shipped:
        raise SystemExit(f"--draft-model {draft_model}: no .gguf file in it; fetch a GGUF draft model")
    return shipped[0].resolve()


def parse_lookup(log: str) -> dict[str, float]:
    """llama-lookup's (or llama-speculative's, which prints the same) figures: seconds to encode the
    prompt and to decode, tokens predicted, drafted and accepted; a missing one is an error naming
    what the run printed."""
    times = {m["kind"]: float(m["seconds"]) for m in _TIMES.finditer(log)}
    counts = {m["name"]: int(m["value"]) for m in _COUNTS.finditer(log)}
    if set(times) != {"encoded", "decoded"} or set(counts) != {"n_predict", "n_drafted", "n_accept"}:
        raise RuntimeError(f"llama.cpp printed no timings and counts; its log ends: {log[-800:]}")
    return {"seconds": times["encoded"] + times["decoded"], **counts}


def llama_command(peer: Peer, gguf: Path, prompt: Path, args: argparse.Namespace) -> list[str]:
    """One prompt's llama-lookup run, or llama-speculative's when a draft model drafts."""
    tool = peer.tool("llama-lookup" if args.draft_model is None else "llama-speculative")
    command = [
        str(tool), "-m", str(gguf), "-f", str(prompt), "-n", str(args.new_tokens),
        "-t", str(args.threads), "-c", "4096", "--temp", "0",
        "--spec-draft-n-max", str(args.draft_max),
    ]  # fmt: skip
    if args.draft_model is not None:
        command += ["-md", str(draft_file(args.draft_model)), "-td", str(args.threads)]
    return command


def llama_round(peer: Peer, gguf: Path, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Every prompt through one llama.cpp run each: tokens over its own seconds, its drafts."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="strata-spec-peer-") as scratch:
        prompt = Path(scratch) / "prompt.txt"
        for text in texts:
            prompt.write_text(text)
            command = llama_command(peer, gguf, prompt, args)
            done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1200)
            if done.returncode != 0:
                raise RuntimeError(f"{command[0]} exited with {done.returncode}: {done.stderr[-800:]}")
            runs.append(parse_lookup(done.stderr))
    tokens = sum(int(run["n_predict"]) for run in runs)
    seconds = sum(run["seconds"] for run in runs)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "draft_tokens": sum(int(run["n_drafted"]) for run in runs),
        "accepted_draft_tokens": sum(int(run["n_accept"]) for run in runs),
        "tokens_per_prompt": [int(run["n_predict"]) for run in runs],
    }


def strata_round(eng: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Every prompt through the engine, one at a time: tokens over the wall time, its drafts."""
    from strata.sampling import SamplingParams

    found = run(eng, prompts, SamplingParams(max_new_tokens=new_tokens), one_at_a_time=True)
    outputs = found.pop("outputs")
    return found | {"tokens_per_prompt": [len(out) for out in outputs]}


def verdicts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The one target: {"target", "figure", "met"}."""
    if record["workload"]["method"] == "draft":
        target = f"one stream, draft model: >= {RATIO_TARGET}x llama.cpp's llama-speculative"
    else:
        target = f"one stream, prompt lookup: >= {RATIO_TARGET}x llama.cpp's llama-lookup"
    met = record["ratio"]["median"] >= RATIO_TARGET
    return [{"target": target, "figure": ratio_figure(record, *SIDES), "met": met}]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from services.worker.model.loader import load_model

    peer, gguf = peer_for(args.model)
    provenance = start_provenance(threads=args.threads)
    loaded = load_model(args.model)
    speculative: dict[str, Any] = {"method": "ngram", "num_tokens": args.draft_max}
    if args.draft_model is not None:
        speculative |= {"method": "draft", "draft_model_path": str(args.draft_model)}
    eng = engine(loaded, speculative, 1)
    prompts, texts = workload_ids(args.model), workload_texts(args.model)
    # Untimed: the engine's first steps, llama.cpp's page cache.
    strata_round(eng, prompts[:1], 16)
    llama_round(peer, gguf, texts[:1], argparse.Namespace(**{**vars(args), "new_tokens": 16}))
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for index in range(args.rounds):
        for side in SIDES if index % 2 == 0 else SIDES[::-1]:
            if side == "strata":
                runs[side].append(strata_round(eng, prompts, args.new_tokens))
            else:
                runs[side].append(llama_round(peer, gguf, texts, args))
        ratio = runs["strata"][-1]["tok_s"] / runs["llama.cpp"][-1]["tok_s"]
        print(
            f"bench.spec_peer: round {index + 1}/{args.rounds}: strata/llama.cpp {ratio:.2f}x",
            file=sys.stderr,
        )
    record: dict[str, Any] = {
        "benchmark": "spec-peer",
        "provenance": finish_provenance(provenance),
        "workload": {
            "model": str(args.model),
            "llama_cpp_model": str(gguf),
            "method": speculative["method"],
            "draft_model": None if args.draft_model is None else str(args.draft_model),
            "llama_cpp_draft_model": None if args.draft_model is None else str(draft_file(args.draft_model)),
            "prompts": str(WORKLOAD),
            "new_tokens": args.new_tokens,
            "draft_max": args.draft_max,
            "rounds": args.rounds,
            "threads": args.threads,
        },
        "llama_cpp_build": build_info(peer),
    }
    record |= two_sides(runs, *SIDES)
    record["targets"] = verdicts(record)
    save_record(record, args.json)
    print_targets("bench.spec_peer", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
