#!/usr/bin/env bash
# Builds and tests SmartGen the way CI does:
#   1. scripts/setup-deps.sh (installs missing Debian packages)
#   2. release preset: configure, build, ctest (every test)
#   2b. (in the release ctest) smartgen-bench's five subcommands with --quick, their JSON checked
#   2c. fuzz:          scripts/fuzz.sh builds the libFuzzer fuzzers (clang) and runs each for 9 s
#                      from its committed seeds (fixed -seed, corpus in a temporary copy)
#   3. asan preset:    configure, build, ctest with AddressSanitizer + LeakSanitizer (not the benches)
#   4. tsan preset:    configure, build, the concurrency, session, failure, transfer-path, bootstrap,
#                      reconnect and graceful-close tests
#                      under ThreadSanitizer
# Prints the duration of each phase; exits nonzero when any step fails.
# SMARTGEN_CTEST_ARGS: extra ctest arguments for every phase (e.g. "-j2" or "--repeat until-pass:2").
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
JOBS=$(nproc)

PHASE_NAMES=()
PHASE_TIMES=()
PHASE_RESULTS=()

now_ms() { date +%s%3N; }

print_timings() {
  local i
  echo
  echo "==== test.sh timings ===="
  for i in "${!PHASE_NAMES[@]}"; do
    printf '  %-16s %8.1f s  %s\n' "${PHASE_NAMES[$i]}" "$(awk "BEGIN{print ${PHASE_TIMES[$i]}/1000}")" \
      "${PHASE_RESULTS[$i]}"
  done
}
trap print_timings EXIT

# run_phase NAME FUNCTION: runs FUNCTION, records its duration and result, fails the script on error.
run_phase() {
  local name=$1 fn=$2 start rc=0
  echo
  echo "==== [$name] starting ($(date '+%H:%M:%S')) ===="
  start=$(now_ms)
  # A subshell with errexit on: `fn || rc=$?` would switch errexit off inside fn.
  set +e
  (set -e; "$fn")
  rc=$?
  set -e
  PHASE_NAMES+=("$name")
  PHASE_TIMES+=("$(( $(now_ms) - start ))")
  if [[ $rc -ne 0 ]]; then
    PHASE_RESULTS+=("FAILED (exit $rc)")
    echo "==== [$name] FAILED (exit $rc) ====" >&2
    exit "$rc"
  fi
  PHASE_RESULTS+=("ok")
  echo "==== [$name] ok ===="
}

# configure + build + ctest of one preset (CMakePresets.json); extra args go to ctest.
preset_build_and_test() {
  local preset=$1
  shift
  cmake --preset "$preset" &&
    cmake --build --preset "$preset" --parallel "$JOBS" &&
    # shellcheck disable=SC2086 # word splitting of SMARTGEN_CTEST_ARGS is intended
    ctest --preset "$preset" ${SMARTGEN_CTEST_ARGS:-} "$@"
}

run_deps_phase() {
  bash "$ROOT/scripts/setup-deps.sh"
}

run_release_phase() {
  preset_build_and_test release
}

# Five fuzzers x 9 s (scripts/fuzz.sh, docs/fuzzing.md; about 55 s once built): any crash, leak or
# sanitizer report fails.
run_fuzz_phase() {
  SG_FUZZ_FRESH=1 SG_FUZZ_SEED=1 bash "$ROOT/scripts/fuzz.sh" 9
}

run_asan_phase() {
  # detect_leaks: LeakSanitizer at exit of every test process; abort_on_error: a report fails the
  # test with a core-less abort instead of a plain exit code that a harness might ignore.
  ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:check_initialization_order=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}" \
  LSAN_OPTIONS="print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}" \
    preset_build_and_test asan -LE bench
}

# ThreadSanitizer: the tests that run threads against each other (concurrency, sessions, failures).
# die_after_fork=0: the failure tests fork a peer process that starts its own threads, which is
# allowed by SmartGen's fork rule (a child makes its own context) but TSan refuses by default.
run_tsan_phase() {
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:die_after_fork=0${TSAN_OPTIONS:+:$TSAN_OPTIONS}" \
    preset_build_and_test tsan -R '^(Concurrency|Session|Failure|Paths|Bootstrap|Reconnect|GracefulClose)\.'
}

TOTAL_START=$(now_ms)
run_phase deps run_deps_phase
run_phase release run_release_phase
run_phase fuzz run_fuzz_phase
run_phase asan run_asan_phase
run_phase tsan run_tsan_phase
PHASE_NAMES+=("total")
PHASE_TIMES+=("$(( $(now_ms) - TOTAL_START ))")
PHASE_RESULTS+=("ok")
echo
echo "test.sh: all phases passed"
