"""What each quoted record measures: the paths its figures depend on, how long a run takes, how to rerun it.

The records the docs quote are the generator's (docs_tables.TABLES) plus those prose names; this
catalog adds what neither the record nor the docs say: the source paths a record's figures depend
on (for the staleness check), an estimated run time (for `make records --list`), the command to
use when a record's provenance names none, and the target that reruns it when `make records` does
not. A before/after comparison is catalogued while its after side is HEAD's code (its target says
what rerunning it needs); once it measured code no longer at HEAD it cannot be rerun and is deleted.
The entries of the stack and of the features are docs_tables_catalog_stack.py's. scripts/records.py
and the generator's own tables of runs read it. An entry's type and the shapes of its commands are
docs_tables_entry.py's. This module must not run anything or read records.
"""

from __future__ import annotations

from docs_tables_catalog_stack import STACK_AND_FEATURES
from docs_tables_entry import DROPPED, ENGINE, KERNELS, STACK, Entry, out, py

# bench.peer on Qwen2.5-Coder-0.5B: its float32 conversion for llama.cpp's converter, its Q4_K_M
# file as shipped for both sides' Q4_K_M contestants (make bench-peer fetches both).
AVX2 = ("--native-isa", "avx2")
QWEN05_PEER = (
    "--model",
    "models/float32/Qwen2.5-Coder-0.5B-Instruct",
    "--shipped-q4-k-m",
    "models/Qwen2.5-Coder-0.5B-Instruct/Qwen2.5-Coder-0.5B-Instruct.gguf",
    "--perplexity-record",
    "bench/results/perplexity-qwen05-cpu.json",
)

_ENGINE_AND_MODELS: dict[str, Entry] = {
    "engine-cpu.json": Entry(
        ENGINE,
        "bench/engine.py",
        480,
        py(
            "bench.engine",
            "--requests",
            "64",
            "--prompt-tokens",
            "64",
            "--new-tokens",
            "64",
            *out("engine-cpu.json"),
        ),
    ),
    "engine-cpu-native.json": Entry(
        ENGINE,
        "bench/engine.py",
        300,
        py(
            "bench.engine",
            "--requests",
            "64",
            "--no-hf-cb",
            "--compare-native",
            *out("engine-cpu-native.json"),
        ),
    ),
    "engine-cpu-1-stream.json": Entry(
        ENGINE,
        "bench/engine.py",
        120,
        py(
            "bench.engine",
            "--requests",
            "1",
            "--runs",
            "9",
            "--no-hf-cb",
            "--no-asyncio",
            "--compare-native",
            *out("engine-cpu-1-stream.json"),
        ),
    ),
    "engine-cpu-one-team.json": Entry(
        ENGINE,
        "bench/engine.py",
        240,
        py("bench.engine", "--requests", "64", "--no-hf-cb", *out("engine-cpu-one-team.json")),
    ),
    "facade-cpu.json": Entry(
        ENGINE,
        "bench/facade.py",
        300,
        py(
            "bench.facade",
            "--requests",
            "64",
            "--prompt-tokens",
            "64",
            "--new-tokens",
            "64",
            *out("facade-cpu.json"),
        ),
    ),
    "mixing-cpu.json": Entry(
        ENGINE,
        "bench/mixing.py",
        120,
        py(
            "bench.mixing",
            "--requests",
            "64",
            "--prompt-tokens",
            "64",
            "--new-tokens",
            "64",
            *out("mixing-cpu.json"),
        ),
    ),
    "step-cost-cpu.json": Entry(
        ENGINE, "bench/step_cost.py", 120, py("bench.step_cost", *out("step-cost-cpu.json"))
    ),
    # bench.peer sets these perplexities beside its ratios, so they are rerun first.
    "run-memory-cpu.json": Entry(
        STACK, "bench/run_memory.py", 60, py("bench.run_memory", *out("run-memory-cpu.json"))
    ),
    "model-parity-cpu.json": Entry(
        ENGINE, "bench/model_parity.py", 240, py("bench.model_parity", *out("model-parity-cpu.json"))
    ),
    "models-cpu.json": Entry(
        ENGINE, "bench/model_cost.py", 1200, py("bench.model_cost", *out("models-cpu.json"))
    ),
    "perplexity-cpu.json": Entry(
        ENGINE, "bench/perplexity.py", 60, py("bench.perplexity", *out("perplexity-cpu.json"))
    ),
    # Five rounds of three pairs; the first run also probes the CPU and builds llama.cpp (about 12 minutes).
    "peer-cpu.json": Entry(ENGINE, "bench/peer.py", 1980, py("bench.peer", *out("peer-cpu.json"))),
    # 64 streams only: the one-stream rounds are the record below.
    "peer-qwen05-cpu.json": Entry(
        ENGINE,
        "bench/peer.py",
        3600,
        py(
            "bench.peer",
            *QWEN05_PEER,
            "--npl",
            "64",
            *out("peer-qwen05-cpu.json"),
        ),
        target="make bench-peer",
    ),
    # One stream only, so a sitting can take it without the hour of 64-stream rounds above.
    "peer-qwen05-1-stream-cpu.json": Entry(
        ENGINE,
        "bench/peer.py",
        960,
        py(
            "bench.peer",
            *QWEN05_PEER,
            "--npl",
            "1",
            *out("peer-qwen05-1-stream-cpu.json"),
        ),
    ),
    "serve-peer-cpu.json": Entry(
        STACK,
        "bench/serve_peer.py",
        900,
        py("bench.serve_peer", *out("serve-peer-cpu.json")),
        target="make bench-serve-peer",
    ),
    # make bench-peer-avx2: the three runs of a machine without AVX-512, capped on this one.
    "perplexity-avx2-cpu.json": Entry(
        ENGINE,
        "bench/perplexity.py",
        300,
        py("bench.perplexity", *AVX2, *out("perplexity-avx2-cpu.json")),
        target="make bench-peer-avx2",
    ),
    "peer-avx2-cpu.json": Entry(
        ENGINE,
        "bench/peer.py",
        1200,
        py(
            "bench.peer",
            *AVX2,
            "--perplexity-record",
            "bench/results/perplexity-avx2-cpu.json",
            *out("peer-avx2-cpu.json"),
        ),
        target="make bench-peer-avx2",
    ),
    "serve-peer-avx2-cpu.json": Entry(
        STACK,
        "bench/serve_peer.py",
        900,
        py("bench.serve_peer", *AVX2, *out("serve-peer-avx2-cpu.json")),
        target="make bench-peer-avx2",
    ),
    "serve-peer-qwen05-cpu.json": Entry(
        STACK,
        "bench/serve_peer.py",
        1500,
        py(
            "bench.serve_peer",
            "--config",
            "bench/serve_peer_qwen.yaml",
            "--shapes",
            "64x64",
            "--rounds",
            "5",
            *out("serve-peer-qwen05-cpu.json"),
        ),
        target="make bench-serve-peer-qwen",
    ),
    "small-linear-cpu.json": Entry(
        KERNELS, "bench/small_linear.py", 60, py("bench.small_linear", *out("small-linear-cpu.json"))
    ),
    "generate-cli-cpu.json": Entry(
        ("services/worker/", "strata/cli/"),
        "bench/generate_cli.py",
        300,
        py("bench.generate_cli", *out("generate-cli-cpu.json")),
        target="make bench-peer",
    ),
    "gguf-linear-cpu.json": Entry(
        KERNELS, "bench/gguf_linear.py", 60, py("bench.gguf_linear", *out("gguf-linear-cpu.json"))
    ),
    "large-linear-cpu.json": Entry(
        KERNELS,
        "bench/large_linear.py",
        60,
        py("bench.large_linear", *out("large-linear-cpu.json")),
        target=DROPPED,
    ),
    "torch-compile-cpu.json": Entry(
        KERNELS,
        "bench/torch_compile.py",
        60,
        py("bench.torch_compile", *out("torch-compile-cpu.json")),
        target=DROPPED,
    ),
    "busy-neighbour-cpu.json": Entry(
        ENGINE, "bench/busy_neighbour.py", 420, py("bench.busy_neighbour", *out("busy-neighbour-cpu.json"))
    ),
    "memory-profile-cpu.json": Entry(
        ENGINE, "bench/memory_profile.py", 60, py("bench.memory_profile", *out("memory-profile-cpu.json"))
    ),
    "memory-soak-cpu.json": Entry(
        ENGINE,
        "bench/memory_soak.py",
        240,
        py("bench.memory_soak", "--seconds", "120", *out("memory-soak-cpu.json")),
    ),
}

CATALOG: dict[str, Entry] = {**_ENGINE_AND_MODELS, **STACK_AND_FEATURES}
"""Every catalogued record, the engine's and the models' first (the order `make records` runs them)."""

LONG_RUNS = (
    ("the reliability report (docs/reliability.md)", "make reliability", 1200),
    ("the chaos soak's full version (its row of docs/reliability.md)", "make chaos", 600),
)
"""Runs with a target of their own, left out of `make records` for their length."""
