#!/usr/bin/env bash
# Regenerates the Python code for protos/ into strata/v1/ (or into $1, for the staleness check).
# One command, pinned tools (grpcio-tools and mypy-protobuf from requirements.lock): the output is
# byte-for-byte reproducible, and `make protos-check` fails CI when the committed copy is stale.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
bin="$(dirname "$(command -v python)")"
if [ -x .venv/bin/python ]; then bin=.venv/bin; fi
mkdir -p "$out/strata/v1"
"$bin/python" -m grpc_tools.protoc -I protos \
  --python_out="$out" --grpc_python_out="$out" \
  --plugin=protoc-gen-mypy="$bin/protoc-gen-mypy" --mypy_out="$out" \
  --plugin=protoc-gen-mypy_grpc="$bin/protoc-gen-mypy_grpc" --mypy_grpc_out="$out" \
  protos/strata/v1/*.proto
