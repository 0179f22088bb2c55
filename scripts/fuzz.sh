#!/usr/bin/env bash
# Builds the libFuzzer fuzzers (tests/fuzz, docs/fuzzing.md) in build/fuzz with clang and runs each
# for a fixed time, one after the other.
#
# Usage: scripts/fuzz.sh [--seeds] [SECONDS_PER_FUZZER] [FUZZER...]
#   SECONDS_PER_FUZZER  default 300
#   FUZZER              wire handlers metadata profile bootstrap directory_json (default: all six)
#   --seeds             first regenerate the committed seed corpora (tests/fuzz/corpus) with fuzz_seeds
#
# Each fuzzer starts from its committed seeds (tests/fuzz/corpus/NAME, only read) and a working corpus
# that keeps what earlier runs found (build/fuzz/corpus/NAME). Crashes, leaks, timeouts and
# out-of-memory inputs are written to build/fuzz/findings/NAME-*. Prints, per fuzzer, its executions,
# executions per second, corpus size and findings; exits 1 when any fuzzer found something.
#
# Environment:
#   SG_FUZZ_FRESH=1    work in a temporary corpus copied from the seeds, removed afterwards (test.sh)
#   SG_FUZZ_SEED=N     libFuzzer's -seed (default: a random one, printed in each log)
#   SG_FUZZ_ARGS       more libFuzzer flags, e.g. "-max_len=8192 -jobs=2"
#   SG_FUZZ_CC/CXX     the compilers (default clang-14 / clang++-14)
#   UBSAN_OPTIONS      e.g. suppressions=FILE to hold a known, reported finding back in a long run
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
BUILD="$ROOT/build/fuzz"
ALL=(wire handlers metadata profile bootstrap directory_json)

regen=0
if [[ ${1:-} == --seeds ]]; then
  regen=1
  shift
fi
seconds=${1:-300}
if ! [[ $seconds =~ ^[0-9]+$ ]]; then
  echo "usage: $0 [--seeds] [SECONDS_PER_FUZZER] [FUZZER...]   (fuzzers: ${ALL[*]})" >&2
  exit 2
fi
[[ $# -gt 0 ]] && shift
fuzzers=("$@")
[[ ${#fuzzers[@]} -eq 0 ]] && fuzzers=("${ALL[@]}")
for f in "${fuzzers[@]}"; do
  [[ " ${ALL[*]} " == *" $f "* ]] || { echo "$0: unknown fuzzer '$f' (${ALL[*]})" >&2; exit 2; }
done

# ---- build (configured once; ninja rebuilds what changed) ----
# Line tables only: a crash's stack names file and line, and the units compile in about half the
# time full debug information takes.
if [[ ! -f "$BUILD/build.ninja" ]] || ! grep -q '^SMARTGEN_FUZZ:BOOL=ON' "$BUILD/CMakeCache.txt" 2>/dev/null; then
  CC=${SG_FUZZ_CC:-clang-14} CXX=${SG_FUZZ_CXX:-clang++-14} cmake -S "$ROOT" -B "$BUILD" -G Ninja \
    -DSMARTGEN_FUZZ=ON -DSMARTGEN_MIMALLOC=OFF -DSMARTGEN_BUILD_TESTS=OFF -DSMARTGEN_BUILD_EXAMPLES=OFF \
    -DSMARTGEN_BUILD_TOOLS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -gline-tables-only -DNDEBUG" \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -gline-tables-only -DNDEBUG" >/dev/null
fi
cmake --build "$BUILD" --target fuzzers --parallel "$(nproc)"

# libinfinipath (pulled in by libfabric's psm provider) installs signal handlers that print their
# own backtrace and exit(); without this libFuzzer cannot report a crash as one.
export IPATH_NO_BACKTRACE=1

if [[ $regen -eq 1 ]]; then
  rm -rf "$ROOT/tests/fuzz/corpus"
  "$BUILD/tests/fuzz/fuzz_seeds" "$ROOT/tests/fuzz/corpus" "$ROOT"
fi

mkdir -p "$BUILD/findings" "$BUILD/logs"
tmp=""
if [[ ${SG_FUZZ_FRESH:-0} == 1 ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
fi

failed=0
summary=()
for f in "${fuzzers[@]}"; do
  if [[ -n $tmp ]]; then
    work="$tmp/$f"
  else
    work="$BUILD/corpus/$f"
  fi
  mkdir -p "$work"
  log="$BUILD/logs/$f.log"
  before=$(find "$BUILD/findings" -maxdepth 1 -name "$f-*" | wc -l)
  args=(-max_total_time="$seconds" -print_final_stats=1 -max_len=4096 -timeout=30 -rss_limit_mb=4096
        -artifact_prefix="$BUILD/findings/$f-")
  [[ -n ${SG_FUZZ_SEED:-} ]] && args+=(-seed="$SG_FUZZ_SEED")
  # The handler fuzzer's sessions persist between inputs, so nearly every input ends with more
  # allocations than frees and libFuzzer would run it twice plus a leak scan each time (2/3 of its
  # time, finding only the fixture's growth). LeakSanitizer still checks the whole run at exit.
  [[ $f == handlers ]] && args+=(-detect_leaks=0)
  echo "fuzz.sh: $f for ${seconds}s (log $log)"
  rc=0
  # shellcheck disable=SC2086 # SG_FUZZ_ARGS holds several flags
  "$BUILD/tests/fuzz/fuzz_$f" "${args[@]}" ${SG_FUZZ_ARGS:-} "$work" "$ROOT/tests/fuzz/corpus/$f" >"$log" 2>&1 || rc=$?
  execs=$(awk '/^stat::number_of_executed_units:/ {print $2}' "$log" | tail -1)
  rate=$(awk '/^stat::average_exec_per_sec:/ {print $2}' "$log" | tail -1)
  corpus=$(find "$work" -type f | wc -l)
  found=$(( $(find "$BUILD/findings" -maxdepth 1 -name "$f-*" | wc -l) - before ))
  if [[ $rc -ne 0 || $found -ne 0 ]]; then
    failed=1
    [[ $found -eq 0 ]] && found="exit $rc"
    grep -m1 -E 'ERROR: |runtime error|SUMMARY' "$log" >&2 || true
  fi
  summary+=("$(printf '%-10s %12s execs %8s exec/s  corpus %6s  findings %s' "$f" "${execs:-?}" "${rate:-?}" "$corpus" "$found")")
done

echo
echo "==== fuzz.sh: ${seconds}s per fuzzer ===="
printf '  %s\n' "${summary[@]}"
if [[ $failed -ne 0 ]]; then
  echo "fuzz.sh: FINDINGS (inputs in $BUILD/findings, logs in $BUILD/logs)" >&2
  exit 1
fi
echo "fuzz.sh: no findings"
