#!/usr/bin/env bash
# The one prepared device run (an H200 when a session is lent one): correctness first, then speed.
#   bash bench/gpu.sh [OUT_DIR]      (default: bench/results/gpu)
# The device's python has torch and transformers but not pydantic: carry its wheels in .whl/
# (see /work/.library/device/README.md); they are installed into /tmp/site when present.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

# 1. Correctness: graph replay equals eager decode, the sampler's noise equals the CPU's.
python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu-tests.log"

# 2. Speed, per architecture: the engine against transformers (parity-checked on 16 requests), then the
#    floor (transformers' one decode step at batch 256 from a CUDA graph).
for arch in llama-135m llama-1b; do
  python3 -m bench.engine --device cuda --dtype bfloat16 --random-weights "$arch" --requests 256 \
    --prompt-tokens 64 --new-tokens 128 --naive-requests 16 --check-requests 16 \
    --max-num-batched-tokens 8192 --json "$out/engine-cuda-$arch.json"
  python3 -m bench.cuda_floor --random-weights "$arch" --batch 256 --context 192 \
    --json "$out/floor-cuda-$arch.json"
done
