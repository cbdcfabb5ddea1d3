"""llama.cpp's side of bench.peer: its tools run on a workload, and what they print, parsed.

`batched` runs llama-batched-bench with every stream count listed twice (`-npl 1,1,64,64`): the
tool clears its KV memory before each entry, so the first of each pair is that shape's untimed
warm-up, exactly the one our engine gets (bench/peer_engine.py runs each shape once untimed too),
and only the second is kept. The tool's own 16-token warm-up decode before the first entry is the
only extra it gets. Its prefill (T_PP, S_PP) and decode (T_TG, S_TG) times are kept beside the
combined rate, which counts generated tokens over both, as our side does. `perplexity` runs
llama-perplexity on a text file (default windows: chunks of -c tokens, second half scored) and
`token_ids` runs llama-tokenize on the same text, so bench.peer can check both sides scored the same
ids. This module runs and parses; it must not build anything (bench/peer_setup.py does) nor decide
rounds or ratios.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from bench.peer_setup import Peer

FINAL_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")
SYSTEM_INFO = re.compile(r"^.*(system_info: .*)$", re.MULTILINE)


def warmed_npl(npl: list[int]) -> str:
    """-npl with every count twice: the first of each pair is the untimed warm-up."""
    return ",".join(str(n) for n in npl for _ in range(2))


def parse_batched(stdout: str, npl: list[int]) -> dict[str, dict[str, float]]:
    """The timed entry of each stream count from llama-batched-bench's JSONL (the second of its pair)."""
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if [row["pl"] for row in rows] != [n for n in npl for _ in range(2)]:
        raise SystemExit(f"bench.peer: llama-batched-bench printed streams {[r['pl'] for r in rows]}")
    timed = rows[1::2]
    return {
        str(row["pl"]): {
            # Generated tokens over prefill plus decode time, as our side counts them.
            "tok_s": row["pl"] * row["tg"] / row["t"],
            "seconds": row["t"],
            "prefill_seconds": row["t_pp"],
            "prefill_tok_s": row["speed_pp"],
            "decode_seconds": row["t_tg"],
            "decode_tok_s": row["speed_tg"],
            "warm_up_tok_s": warm["pl"] * warm["tg"] / warm["t"],
        }
        for warm, row in zip(rows[0::2], timed, strict=True)
    }


def batched(
    peer: Peer, gguf_type: str, npl: list[int], prompt_tokens: int, new_tokens: int, threads: int
) -> dict[str, dict[str, float]]:
    command = [
        str(peer.tool("llama-batched-bench")),
        "-m",
        str(peer.models[gguf_type]),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-b",
        "2048",
        "-ub",
        "512",
        "-c",
        str(max(npl) * (prompt_tokens + new_tokens)),
        "-npp",
        str(prompt_tokens),
        "-ntg",
        str(new_tokens),
        "-npl",
        warmed_npl(npl),
        "--output-format",
        "jsonl",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"bench.peer: llama-batched-bench on {gguf_type} exited {done.returncode}:\n{done.stderr[-2000:]}"
        )
    return parse_batched(done.stdout, npl)


def parse_perplexity(log: str) -> dict[str, Any]:
    """llama-perplexity's final estimate, its window, and the system_info line it logs."""
    final, chunks = FINAL_PPL.search(log), CHUNKS.search(log)
    if final is None or chunks is None:
        raise SystemExit(f"bench.peer: llama-perplexity printed no final estimate:\n{log[-2000:]}")
    info = SYSTEM_INFO.search(log)
    return {
        "perplexity": float(final.group(1)),
        "plus_minus": float(final.group(2)),
        "chunks": int(chunks.group(1)),
        "context": int(chunks.group(2)),
        "system_info": info.group(1).strip() if info else None,
    }


def perplexity(peer: Peer, gguf_type: str, text: Path, context: int, threads: int) -> dict[str, Any]:
    command = [
        str(peer.tool("llama-perplexity")),
        "-m",
        str(peer.models[gguf_type]),
        "-f",
        str(text),
        "-c",
        str(context),
        "-b",
        str(context),
        "-t",
        str(threads),
        "-tb",
        str(threads),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"bench.peer: llama-perplexity on {gguf_type} exited {done.returncode}:\n{done.stderr[-2000:]}"
        )
    return parse_perplexity(done.stdout + done.stderr)


def parse_ids(stdout: str) -> list[int]:
    """llama-tokenize --ids prints one Python-style list: [1, 2, 3]."""
    found = re.search(r"\[[0-9, ]*\]", stdout)
    if found is None:
        raise SystemExit(f"bench.peer: llama-tokenize printed no id list:\n{stdout[-500:]}")
    return [int(value) for value in found.group(0).strip("[]").split(",") if value.strip()]


def token_ids(peer: Peer, text: str) -> list[int]:
    """The text's ids as llama.cpp's tokenizer makes them (BOS added when the GGUF says so), fed on
    stdin as llama-perplexity's -f has read it already."""
    command = [
        str(peer.tool("llama-tokenize")),
        "-m",
        str(peer.models["f32"]),
        "--stdin",
        "--ids",
        "--log-disable",
    ]
    done = subprocess.run(command, input=text, capture_output=True, text=True, check=True)
    return parse_ids(done.stdout)
