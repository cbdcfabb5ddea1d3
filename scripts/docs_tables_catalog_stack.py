"""The catalog's entries for the records of the whole stack and of the features (speculative decoding,
the KV cache, prefix caching, outputs, structured output, containers, the request path): what each
depends on, how long a run takes, how to rerun it (see docs_tables_catalog.py, which merges them into
CATALOG after the engine's and the models'). This module must not run anything or read records.
"""

from __future__ import annotations

from docs_tables_entry import DROPPED, ENGINE, GATEWAY, STACK, Entry, out, py, spawn

# bench.spec and bench.spec_peer on Qwen2.5-Coder-1.5B's Q4_K_M file, one stream.
QWEN15 = ("--model", "models/Qwen2.5-Coder-1.5B-Instruct")
QWEN05_DRAFT = ("--method", "draft", "--draft-model", "models/Qwen2.5-Coder-0.5B-Instruct")

STACK_AND_FEATURES: dict[str, Entry] = {
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
    "lora-cpu.json": Entry(
        ENGINE, "bench/lora.py", 1200, py("bench.lora", *out("lora-cpu.json")), target="make bench-lora"
    ),
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
    "request-path-before.json": Entry(
        GATEWAY,
        "scripts/request_path.py",
        60,
        ("python", "scripts/request_path.py", "--tree", "../before", *out("request-path-before.json")),
        target="scripts/request_path.py --tree, with a checkout of the before commit beside this one",
    ),
    "cached-admission-cpu.json": Entry(
        STACK,
        "bench/cached_admission.py",
        1200,
        py("bench.cached_admission", *out("cached-admission-cpu.json")),
        target="make bench-cached",
    ),
    "itl-admission-cpu.json": Entry(
        STACK,
        "bench/itl_admission.py",
        900,
        py("bench.itl_admission", *out("itl-admission-cpu.json")),
        target="make bench-itl",
    ),
    "flood-cpu.json": Entry(
        STACK,
        "bench/flood.py",
        1500,
        py("bench.flood", *out("flood-cpu.json")),
        target="make bench-flood",
    ),
    "stack-before-after-cpu.json": Entry(
        STACK,
        "bench/before_after.py",
        3600,
        py("bench.before_after", "--before", "../before", "--after", ".", "--rounds", "5"),
        target="python -m bench.before_after, with a checkout of the before commit beside this one",
    ),
}
