#!/usr/bin/env bash
# Builds the release preset's KV demo (quietly) and runs it; arguments go to the demo
# (--tokens N, --layers N, --iters N, --provider NAME, --contiguous, --json, --help).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup-deps.sh >/dev/null

log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! { cmake --preset release && cmake --build --preset release --parallel "$(nproc)" --target smartgen-kv-demo; } \
    >"$log" 2>&1; then
  cat "$log" >&2
  echo "demo.sh: building the release preset failed" >&2
  exit 1
fi

rm -f "$log"
trap - EXIT
exec build/release/examples/smartgen-kv-demo "$@"
