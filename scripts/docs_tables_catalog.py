"""What each quoted record measures: the paths its figures depend on, how long a run takes, how to rerun it.

The records the docs quote are the generator's (docs_tables.TABLES) plus those prose names; this
catalog adds what neither the record nor the docs say: the source paths a record's figures depend
on (for the staleness check), an estimated run time (for `make records --list`), the command to
use when a record's provenance names none, and the target that reruns it when `make records` does
not. A record that measured code no longer at HEAD (a before/after comparison) cannot be rerun and
is deleted, not catalogued. scripts/records.py and the generator's own tables of runs read it.
This module must not run anything or read records.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINE = ("services/worker/",)
KERNELS = ("services/worker/model/",)
STACK = ("gateway/", "services/", "strata/", "configs/local.yaml")
GATEWAY = ("gateway/", "strata/")


@dataclass(frozen=True)
class Entry:
    paths: tuple[str, ...]
    """What its figures depend on, besides its own benchmark module."""
    bench: str
    """Its benchmark's module (bench/X.py) or script."""
    estimate_s: int
    """Seconds a run takes here: a `make records` record's last whole run (bench/results/records-run.json)
    plus 30% for these machines' swings; for the others, their last run or a guess."""
    command: tuple[str, ...]
    """Used only when the record's provenance names no command."""
    target: str = "make records"

    @property
    def depends_on(self) -> tuple[str, ...]:
        return (*self.paths, self.bench)


def _py(module: str, *args: str) -> tuple[str, ...]:
    return ("python", "-m", module, *args)


def _strata(*args: str) -> tuple[str, ...]:
    return ("python", "-m", "strata.cli", "bench", "--spawn", *args)


def _json(name: str) -> tuple[str, ...]:
    return ("--json", f"bench/results/{name}")


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

CATALOG: dict[str, Entry] = {
    "engine-cpu.json": Entry(
        ENGINE,
        "bench/engine.py",
        480,
        _py(
            "bench.engine",
            "--requests",
            "64",
            "--prompt-tokens",
            "64",
            "--new-tokens",
            "64",
            *_json("engine-cpu.json"),
        ),
    ),
    "engine-cpu-native.json": Entry(
        ENGINE,
        "bench/engine.py",
        300,
        _py(
            "bench.engine",
            "--requests",
            "64",
            "--no-hf-cb",
            "--compare-native",
            *_json("engine-cpu-native.json"),
        ),
    ),
    "engine-cpu-1-stream.json": Entry(
        ENGINE,
        "bench/engine.py",
        120,
        _py(
            "bench.engine",
            "--requests",
            "1",
            "--runs",
            "9",
            "--no-hf-cb",
            "--no-asyncio",
            "--compare-native",
            *_json("engine-cpu-1-stream.json"),
        ),
    ),
    "engine-cpu-one-team.json": Entry(
        ENGINE,
        "bench/engine.py",
        240,
        _py("bench.engine", "--requests", "64", "--no-hf-cb", *_json("engine-cpu-one-team.json")),
    ),
    "facade-cpu.json": Entry(
        ENGINE,
        "bench/facade.py",
        300,
        _py(
            "bench.facade",
            "--requests",
            "64",
            "--prompt-tokens",
            "64",
            "--new-tokens",
            "64",
            *_json("facade-cpu.json"),
        ),
    ),
    "mixing-cpu.json": Entry(
        ENGINE,
        "bench/mixing.py",
        120,
        _py(
            "bench.mixing",
            "--requests",
            "64",
            "--prompt-tokens",
            "64",
            "--new-tokens",
            "64",
            *_json("mixing-cpu.json"),
        ),
    ),
    "step-cost-cpu.json": Entry(
        ENGINE, "bench/step_cost.py", 120, _py("bench.step_cost", *_json("step-cost-cpu.json"))
    ),
    # bench.peer sets these perplexities beside its ratios, so they are rerun first.
    "run-memory-cpu.json": Entry(
        STACK, "bench/run_memory.py", 60, _py("bench.run_memory", *_json("run-memory-cpu.json"))
    ),
    "model-parity-cpu.json": Entry(
        ENGINE, "bench/model_parity.py", 240, _py("bench.model_parity", *_json("model-parity-cpu.json"))
    ),
    "models-cpu.json": Entry(
        ENGINE, "bench/model_cost.py", 1200, _py("bench.model_cost", *_json("models-cpu.json"))
    ),
    "perplexity-cpu.json": Entry(
        ENGINE, "bench/perplexity.py", 60, _py("bench.perplexity", *_json("perplexity-cpu.json"))
    ),
    # Five rounds of three pairs; the first run also probes the CPU and builds llama.cpp (about 12 minutes).
    "peer-cpu.json": Entry(ENGINE, "bench/peer.py", 1980, _py("bench.peer", *_json("peer-cpu.json"))),
    # 64 streams only: the one-stream rounds are the record below.
    "peer-qwen05-cpu.json": Entry(
        ENGINE,
        "bench/peer.py",
        3600,
        _py(
            "bench.peer",
            *QWEN05_PEER,
            "--npl",
            "64",
            *_json("peer-qwen05-cpu.json"),
        ),
        target="make bench-peer",
    ),
    # One stream only, so a sitting can take it without the hour of 64-stream rounds above.
    "peer-qwen05-1-stream-cpu.json": Entry(
        ENGINE,
        "bench/peer.py",
        960,
        _py(
            "bench.peer",
            *QWEN05_PEER,
            "--npl",
            "1",
            *_json("peer-qwen05-1-stream-cpu.json"),
        ),
    ),
    "serve-peer-cpu.json": Entry(
        STACK,
        "bench/serve_peer.py",
        900,
        _py("bench.serve_peer", *_json("serve-peer-cpu.json")),
        target="make bench-serve-peer",
    ),
    # make bench-peer-avx2: the three runs of a machine without AVX-512, capped on this one.
    "perplexity-avx2-cpu.json": Entry(
        ENGINE,
        "bench/perplexity.py",
        300,
        _py("bench.perplexity", *AVX2, *_json("perplexity-avx2-cpu.json")),
        target="make bench-peer-avx2",
    ),
    "peer-avx2-cpu.json": Entry(
        ENGINE,
        "bench/peer.py",
        1200,
        _py(
            "bench.peer",
            *AVX2,
            "--perplexity-record",
            "bench/results/perplexity-avx2-cpu.json",
            *_json("peer-avx2-cpu.json"),
        ),
        target="make bench-peer-avx2",
    ),
    "serve-peer-avx2-cpu.json": Entry(
        STACK,
        "bench/serve_peer.py",
        900,
        _py("bench.serve_peer", *AVX2, *_json("serve-peer-avx2-cpu.json")),
        target="make bench-peer-avx2",
    ),
    "serve-peer-qwen05-cpu.json": Entry(
        STACK,
        "bench/serve_peer.py",
        1500,
        _py(
            "bench.serve_peer",
            "--config",
            "bench/serve_peer_qwen.yaml",
            "--shapes",
            "64x64",
            "--rounds",
            "5",
            *_json("serve-peer-qwen05-cpu.json"),
        ),
        target="make bench-serve-peer-qwen",
    ),
    "small-linear-cpu.json": Entry(
        KERNELS, "bench/small_linear.py", 60, _py("bench.small_linear", *_json("small-linear-cpu.json"))
    ),
    "generate-cli-cpu.json": Entry(
        ("services/worker/", "strata/cli/"),
        "bench/generate_cli.py",
        300,
        _py("bench.generate_cli", *_json("generate-cli-cpu.json")),
        target="make bench-peer",
    ),
    "gguf-linear-cpu.json": Entry(
        KERNELS, "bench/gguf_linear.py", 60, _py("bench.gguf_linear", *_json("gguf-linear-cpu.json"))
    ),
    "large-linear-cpu.json": Entry(
        KERNELS, "bench/large_linear.py", 60, _py("bench.large_linear", *_json("large-linear-cpu.json"))
    ),
    "torch-compile-cpu.json": Entry(
        KERNELS, "bench/torch_compile.py", 60, _py("bench.torch_compile", *_json("torch-compile-cpu.json"))
    ),
    "busy-neighbour-cpu.json": Entry(
        ENGINE, "bench/busy_neighbour.py", 420, _py("bench.busy_neighbour", *_json("busy-neighbour-cpu.json"))
    ),
    "memory-profile-cpu.json": Entry(
        ENGINE, "bench/memory_profile.py", 60, _py("bench.memory_profile", *_json("memory-profile-cpu.json"))
    ),
    "memory-soak-cpu.json": Entry(
        ENGINE,
        "bench/memory_soak.py",
        240,
        _py("bench.memory_soak", "--seconds", "120", *_json("memory-soak-cpu.json")),
    ),
    "stack-cpu.json": Entry(
        STACK, "bench/stack.py", 300, _strata("--engine-baseline", *_json("stack-cpu.json"))
    ),
    "stack-1-stream-cpu.json": Entry(
        STACK,
        "bench/stack.py",
        180,
        _strata("--concurrency", "1", "--runs", "3", "--engine-baseline", *_json("stack-1-stream-cpu.json")),
    ),
    "stack-rate-qwen-cpu.json": Entry(
        (*STACK, "configs/qwen.yaml"),
        "bench/rate.py",
        900,
        _strata(
            "--config",
            "configs/qwen.yaml",
            "--rate",
            "auto",
            "--rate-factor",
            "4",
            "--ttft-slo-ms",
            "10000",
            *_json("stack-rate-qwen-cpu.json"),
        ),
        target="make bench-fallback",
    ),
    "stack-rate-cpu.json": Entry(
        STACK, "bench/rate.py", 480, _strata("--rate", "14,28", *_json("stack-rate-cpu.json"))
    ),
    "tenants-cpu.json": Entry(
        STACK, "bench/tenants.py", 540, _py("bench.tenants", *_json("tenants-cpu.json"))
    ),
    "http-vs-grpc-cpu.json": Entry(
        STACK, "bench/http_vs_grpc.py", 180, _py("bench.http_vs_grpc", *_json("http-vs-grpc-cpu.json"))
    ),
    "trace-overhead-cpu.json": Entry(
        STACK, "bench/trace_overhead.py", 480, _py("bench.trace_overhead", *_json("trace-overhead-cpu.json"))
    ),
    "kv-cache-cpu.json": Entry(
        ENGINE,
        "bench/kv_cache.py",
        1500,
        _py("bench.kv_cache", *_json("kv-cache-cpu.json")),
        target="make bench-kv",
    ),
    "spec-cpu.json": Entry(
        ENGINE, "bench/spec.py", 1800, _py("bench.spec", *_json("spec-cpu.json")), target="make bench-spec"
    ),
    "spec-qwen15-cpu.json": Entry(
        ENGINE,
        "bench/spec.py",
        3600,
        _py(
            "bench.spec",
            "--model",
            "models/Qwen2.5-Coder-1.5B-Instruct",
            "--streams",
            "0",
            *_json("spec-qwen15-cpu.json"),
        ),
        target="make bench-spec-qwen",
    ),
    "spec-peer-cpu.json": Entry(
        ENGINE,
        "bench/spec_peer.py",
        1500,
        _py("bench.spec_peer", *_json("spec-peer-cpu.json")),
        target="make bench-spec-peer",
    ),
    "spec-peer-qwen15-cpu.json": Entry(
        ENGINE,
        "bench/spec_peer.py",
        3600,
        _py(
            "bench.spec_peer",
            "--model",
            "models/Qwen2.5-Coder-1.5B-Instruct",
            *_json("spec-peer-qwen15-cpu.json"),
        ),
        target="make bench-spec-peer",
    ),
    "spec-stack-cpu.json": Entry(
        STACK,
        "bench/spec_stack.py",
        900,
        _py("bench.spec_stack", *_json("spec-stack-cpu.json")),
        target="make bench-spec-stack",
    ),
    "tp-cpu.json": Entry(ENGINE, "bench/tp.py", 480, _py("bench.tp", *_json("tp-cpu.json"))),
    "kv-schemes-cpu.json": Entry(
        ENGINE, "bench/kv_schemes.py", 240, _py("bench.kv_schemes", *_json("kv-schemes-cpu.json"))
    ),
    "prefix-cache-cpu.json": Entry(
        ENGINE, "bench/prefix_cache.py", 960, _py("bench.prefix_cache", *_json("prefix-cache-cpu.json"))
    ),
    "prefix-routing-cpu.json": Entry(
        STACK, "bench/prefix_routing.py", 900, _py("bench.prefix_routing", *_json("prefix-routing-cpu.json"))
    ),
    "outputs-logprobs-cpu.json": Entry(
        ENGINE, "bench/outputs.py", 360, _py("bench.outputs", "--part", "logprobs")
    ),
    "outputs-samples-cpu.json": Entry(
        ENGINE, "bench/outputs.py", 60, _py("bench.outputs", "--part", "samples")
    ),
    "grammar-cost-cpu.json": Entry(
        ENGINE, "bench/grammar_cost.py", 240, _py("bench.grammar_cost", *_json("grammar-cost-cpu.json"))
    ),
    "grammar-cost-cpu-5runs.json": Entry(
        ENGINE,
        "bench/grammar_cost.py",
        300,
        _py("bench.grammar_cost", "--runs", "5", *_json("grammar-cost-cpu-5runs.json")),
    ),
    "grammar-quality-cpu.json": Entry(
        ENGINE,
        "bench/grammar_quality.py",
        120,
        _py("bench.grammar_quality", *_json("grammar-quality-cpu.json")),
    ),
    "grammar-libs-cpu.json": Entry(
        ENGINE,
        "bench/grammar_libs.py",
        60,
        _py("bench.grammar_libs", *_json("grammar-libs-cpu.json")),
        target="make bench-grammar-libs",
    ),
    "images-cpu.json": Entry(
        ("deploy/docker/", "requirements.lock", "scripts/container_engine.py", "scripts/local_base.py"),
        "scripts/images.py",
        180,
        ("python", "scripts/images.py", "--cold", *_json("images-cpu.json")),
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
        ("python", "scripts/request_path.py", *_json("request-path.json")),
    ),
}

LONG_RUNS = (
    ("the reliability report (docs/reliability.md)", "make reliability", 1200),
    ("the chaos soak's full version (its row of docs/reliability.md)", "make chaos", 600),
)
"""Runs with a target of their own, left out of `make records` for their length."""
