#!/usr/bin/env bash
# CI's contract checks: buf lint, buf breaking against main, and that strata/v1/ matches what
# scripts/gen_protos.sh generates from protos/ now.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
"$bin/buf" lint protos
# Compare with main's protos when main has them (a branch is checked against main; main itself against
# its previous commit, so CI on main still catches a breaking change that landed).
against=""
if git rev-parse --verify --quiet main >/dev/null; then
  base=main
  if [ "$(git rev-parse HEAD)" = "$(git rev-parse main)" ]; then base=HEAD~1; fi
  if git rev-parse --verify --quiet "$base" >/dev/null && git cat-file -e "$base:protos/buf.yaml" 2>/dev/null; then
    against="$base"
  fi
fi
if [ -n "$against" ]; then
  echo "buf breaking: protos/ against $against"
  "$bin/buf" breaking protos --against ".git#ref=$against,subdir=protos"
else
  echo "buf breaking: no earlier protos/ to compare with (first contract commit); skipped"
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
scripts/gen_protos.sh "$tmp" >/dev/null 2>&1
for f in "$tmp"/strata/v1/*; do
  name="strata/v1/$(basename "$f")"
  if ! cmp -s "$f" "$name"; then
    echo "stale generated code: $name differs from protos/; run 'make protos' and commit" >&2
    exit 1
  fi
done
echo "protos: lint clean, generated code current"
