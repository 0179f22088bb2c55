#!/usr/bin/env bash
# A busy host for liveness and flake checks (issue 37): N processes that spin at normal priority
# until SECONDS pass or the hog is killed. Bounded, so a forgotten one ends by itself.
#   scripts/cpu-hog.sh [N] [SECONDS]     (defaults: 2 threads, 3600 s)
# e.g.  scripts/cpu-hog.sh 2 1800 & hog=$!; ctest --test-dir build/release; kill $hog
set -euo pipefail
n=${1:-2}
seconds=${2:-3600}
[[ $n =~ ^[0-9]+$ && $seconds =~ ^[0-9]+$ ]] || { echo "usage: $0 [N] [SECONDS]" >&2; exit 2; }
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT INT TERM
for ((i = 0; i < n; i++)); do
  timeout "$seconds" bash -c 'while :; do :; done' &
  pids+=($!)
done
echo "cpu-hog: $n spinning process(es) for up to $seconds s: ${pids[*]}" >&2
wait
