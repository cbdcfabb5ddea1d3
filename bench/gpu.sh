#!/usr/bin/env bash
# The one prepared device run (an H200 when a session is lent one): correctness first, then speed.
#   bash bench/gpu.sh [OUT_DIR]              (default: bench/results/gpu)
#   PYTHON=.venv/bin/python bash bench/gpu.sh --dry-run [OUT_DIR]
#                                            the same steps on the CPU, tiny shapes (default: /tmp/strata-gpu-dry)
# It needs no network and no models/ folder (random weights of real shapes) and fits in 8 minutes:
# every step has its own time limit (60 + 2 x (170 + 30) = 460 s in all). The device's python has torch and
# transformers but not pydantic: carry its wheels in .whl/ (see /work/.library/device/README.md); they
# are installed into /tmp/site when present.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry=1
  shift
fi
py=${PYTHON:-python3}  # the dry run on a development machine: PYTHON=.venv/bin/python
out=${1:-$([[ $dry == 1 ]] && echo /tmp/strata-gpu-dry || echo bench/results/gpu)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
"$py" -c "import torch, transformers, pydantic; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'cuda', torch.cuda.is_available())" | tee "$out/versions.txt"
started=$SECONDS

if [[ $dry == 1 ]]; then
  kind=cpu device=(--device cpu --dtype float32) archs=(tiny)
  shape=(--requests 8 --prompt-tokens 16 --new-tokens 8 --naive-requests 2 --check-requests 8 --runs 1 --smoke)
  floor=(--device cpu --dtype float32 --batch 8 --context 32 --reps 2)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
  kind=cuda device=(--device cuda --dtype bfloat16) archs=(llama-135m llama-1b)
  # Naive generate on 4 requests: its rate does not depend on how many, and it is the slowest contestant.
  shape=(--requests 256 --prompt-tokens 64 --new-tokens 128 --naive-requests 4 --check-requests 16
    --max-num-batched-tokens 8192)
  floor=(--device cuda --dtype bfloat16 --batch 256 --context 192)
fi

# 1. Correctness (60 s): warm-up capture, graph replay and eager against transformers, the sampler's noise.
timeout 60 "$py" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu-tests.log"

# 2. Speed, per architecture (170 + 30 s each): the engine against transformers (parity-checked), then
#    the floor (transformers' one decode step at the full batch from a CUDA graph).
for arch in "${archs[@]}"; do
  timeout 170 "$py" -m bench.engine "${device[@]}" --random-weights "$arch" "${shape[@]}" \
    --json "$out/engine-$kind-$arch.json"
  timeout 30 "$py" -m bench.cuda_floor --random-weights "$arch" "${floor[@]}" --json "$out/floor-$kind-$arch.json"
done
echo "bench/gpu.sh: done in $((SECONDS - started)) s; results in $out"
