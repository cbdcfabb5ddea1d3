"""What each quoted record measures: the paths its figures depend on, how long a run takes, how to rerun it.

The records the docs quote are the generator's (docs_tables.TABLES) plus those prose names; this
catalog adds what neither the record nor the docs say: the source paths a record's figures depend
on (for the staleness check), an estimated run time (for `make records --list`), the command to
use when a record's provenance names none, and the target that reruns it when `make records` does
not. A record that measured code no longer at HEAD (a before/after comparison) cannot be rerun and
is deleted, not catalogued. scripts/records.py and the generator's own tables of runs read it.
An entry's type and the shapes of its commands are docs_tables_entry.py's. This module must not run
anything or read records.
"""

from __future__ import annotations

from docs_tables_entry import DROPPED, ENGINE, GATEWAY, KERNELS, STACK, Entry, out, py, spawn

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
# bench.spec and bench.spec_peer on Qwen2.5-Coder-1.5B's Q4_K_M file, one stream.
QWEN15 = ("--model", "models/Qwen2.5-Coder-1.5B-Instruct")
QWEN05_DRAFT = ("--method", "draft", "--draft-model", "models/Qwen2.5-Coder-0.5B-Instruct")

CATALOG: dict[str, Entry] = {
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
    "stack-cpu.json": Entry(STACK, "bench/stack.py", 300, spawn("--engine-baseline", *out("stack-cpu.json"))),
    "stack-1-stream-cpu.json": Entry(
        STACK,
        "bench/stack.py",
        180,
        spawn("--concurrency", "1", "--runs", "3", "--engine-baseline", *out("stack-1-stream-cpu.json")),
    ),
    "stack-rate-qwen-cpu.json": Entry(
        (*STACK, "configs/qwen.yaml"),
        "bench/rate.py",
        900,
        spawn(
            "--config",
            "configs/qwen.yaml",
            "--rate",
            "auto",
            "--rate-factor",
            "4",
            "--ttft-slo-ms",
            "10000",
            *out("stack-rate-qwen-cpu.json"),
        ),
        target="make bench-fallback",
    ),
    "stack-rate-cpu.json": Entry(
        STACK, "bench/rate.py", 480, spawn("--rate", "14,28", *out("stack-rate-cpu.json"))
    ),
    "tenants-cpu.json": Entry(STACK, "bench/tenants.py", 540, py("bench.tenants", *out("tenants-cpu.json"))),
    "http-vs-grpc-cpu.json": Entry(
        STACK, "bench/http_vs_grpc.py", 180, py("bench.http_vs_grpc", *out("http-vs-grpc-cpu.json"))
    ),
    "trace-overhead-cpu.json": Entry(
        STACK, "bench/trace_overhead.py", 480, py("bench.trace_overhead", *out("trace-overhead-cpu.json"))
    ),
    "kv-cache-cpu.json": Entry(
        ENGINE,
        "bench/kv_cache.py",
        1500,
        py("bench.kv_cache", *out("kv-cache-cpu.json")),
        target="make bench-kv",
    ),
    "spec-cpu.json": Entry(
        ENGINE, "bench/spec.py", 1800, py("bench.spec", *out("spec-cpu.json")), target="make bench-spec"
    ),
    "spec-qwen15-cpu.json": Entry(
        ENGINE,
        "bench/spec.py",
        3600,
        py("bench.spec", *QWEN15, "--streams", "0", *out("spec-qwen15-cpu.json")),
        target="make bench-spec-qwen",
    ),
    "spec-draft-qwen15-cpu.json": Entry(
        ENGINE,
        "bench/spec.py",
        4200,
        py("bench.spec", *QWEN15, *QWEN05_DRAFT, "--streams", "0", *out("spec-draft-qwen15-cpu.json")),
        target="make bench-spec-draft",
    ),
    "spec-peer-cpu.json": Entry(
        ENGINE,
        "bench/spec_peer.py",
        1500,
        py("bench.spec_peer", *out("spec-peer-cpu.json")),
        target="make bench-spec-peer",
    ),
    "spec-peer-qwen15-cpu.json": Entry(
        ENGINE,
        "bench/spec_peer.py",
        3600,
        py("bench.spec_peer", *QWEN15, *out("spec-peer-qwen15-cpu.json")),
        target="make bench-spec-peer",
    ),
    "spec-peer-draft-qwen15-cpu.json": Entry(
        ENGINE,
        "bench/spec_peer.py",
        6000,
        py("bench.spec_peer", *QWEN15, *QWEN05_DRAFT[2:], *out("spec-peer-draft-qwen15-cpu.json")),
        target="make bench-spec-peer-draft",
    ),
    "spec-stack-cpu.json": Entry(
        STACK,
        "bench/spec_stack.py",
        900,
        py("bench.spec_stack", *out("spec-stack-cpu.json")),
        target="make bench-spec-stack",
    ),
    "tp-cpu.json": Entry(ENGINE, "bench/tp.py", 480, py("bench.tp", *out("tp-cpu.json"))),
    "kv-schemes-cpu.json": Entry(
        ENGINE, "bench/kv_schemes.py", 240, py("bench.kv_schemes", *out("kv-schemes-cpu.json"))
    ),
    "prefix-cache-cpu.json": Entry(
        ENGINE, "bench/prefix_cache.py", 960, py("bench.prefix_cache", *out("prefix-cache-cpu.json"))
    ),
    "prefix-routing-cpu.json": Entry(
        STACK, "bench/prefix_routing.py", 900, py("bench.prefix_routing", *out("prefix-routing-cpu.json"))
    ),
    "outputs-logprobs-cpu.json": Entry(
        ENGINE, "bench/outputs.py", 360, py("bench.outputs", "--part", "logprobs")
    ),
    "outputs-samples-cpu.json": Entry(
        ENGINE, "bench/outputs.py", 60, py("bench.outputs", "--part", "samples")
    ),
    "grammar-cost-cpu.json": Entry(
        ENGINE, "bench/grammar_cost.py", 240, py("bench.grammar_cost", *out("grammar-cost-cpu.json"))
    ),
    "grammar-cost-cpu-5runs.json": Entry(
        ENGINE,
        "bench/grammar_cost.py",
        300,
        py("bench.grammar_cost", "--runs", "5", *out("grammar-cost-cpu-5runs.json")),
    ),
    "grammar-quality-cpu.json": Entry(
        ENGINE,
        "bench/grammar_quality.py",
        120,
        py("bench.grammar_quality", *out("grammar-quality-cpu.json")),
    ),
    "grammar-libs-cpu.json": Entry(
        ENGINE,
        "bench/grammar_libs.py",
        60,
        py("bench.grammar_libs", *out("grammar-libs-cpu.json")),
        target=DROPPED,
    ),
    "images-cpu.json": Entry(
        ("deploy/docker/", "requirements.lock", "scripts/container_engine.py", "scripts/local_base.py"),
        "scripts/images.py",
        180,
        ("python", "scripts/images.py", "--cold", *out("images-cpu.json")),
        target='make images IMAGES_ARGS="--cold --json bench/results/images-cpu.json"',
    ),
    "compose-cpu.json": Entry(
        ("docker-compose.yml", "configs/compose.yaml", "deploy/docker/", *STACK),
        "tests/containers/test_compose.py",
        120,
        ("python", "-m", "pytest", "tests/containers"),
        target="make compose-test COMPOSE_RECORD=bench/results/compose-cpu.json",
    ),
    "request-path.json": Entry(
        GATEWAY,
        "scripts/request_path.py",
        60,
        ("python", "scripts/request_path.py", *out("request-path.json")),
    ),
    "stack-before-after-cpu.json": Entry(
        STACK,
        "bench/before_after.py",
        3600,
        py("bench.before_after", "--before", "../before", "--after", ".", "--rounds", "5"),
        target="python -m bench.before_after, with a checkout of the before commit beside this one",
    ),
}

LONG_RUNS = (
    ("the reliability report (docs/reliability.md)", "make reliability", 1200),
    ("the chaos soak's full version (its row of docs/reliability.md)", "make chaos", 600),
)
"""Runs with a target of their own, left out of `make records` for their length."""
