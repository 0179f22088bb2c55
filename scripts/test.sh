#!/usr/bin/env bash
# Builds and tests SmartGen the way CI does (.ci/run calls this). What runs where:
#   deps     scripts/setup-deps.sh (installs missing Debian packages)
#   release  release preset: configure, build everything, ctest in parallel (-j<cores>) of unit,
#            abi, example, layering (the folder layering refused by the build, tests/layering),
#            soak (smartgen-soak --short) and bench (the --quick runs of smartgen-bench
#            xfer|ttst|cold and smartgen-microbench select|plan: the only place the benches run),
#            and of the integration tests whose checks differ in release (RELEASE_BOUND_TESTS; the
#            rest run under ASan). Tests that assert a time (soak, deadlines, the timed failure,
#            bootstrap and recovery tests) carry RUN_SERIAL and run alone. Then the model and
#            quality tests (MODEL_TESTS below) and scripts/demo.sh, from a view in which the repository
#            has nothing beside it (scripts/isolated.sh): what they read must be in the clone.
#   fuzz     scripts/fuzz.sh builds the libFuzzer fuzzers (clang, ASan + UBSan) and runs each for
#            9 s from its committed seeds (fixed -seed, corpus in a temporary copy)
#   asan     asan preset: AddressSanitizer + LeakSanitizer, every test but bench, layering, soak and
#            three model-quality sweeps (the benches measure nothing useful under ASan; the layering
#            is the same include graph), in parallel: the one run of most integration tests; then
#            smartgen-soak --short --verify (several processes, cancels, SIGKILL + restart,
#            LeakSanitizer at every worker's exit, SG_TRANSFER_VERIFY=1) with the RSS bound raised
#            for ASan's quarantine
#   tsan     tsan preset: builds only what the subset needs (integration_tests, link_peer) and runs
#            the concurrency, session, failure, transfer-path, reconnect and
#            graceful-close tests under ThreadSanitizer, in parallel
#   package  scripts/package.sh builds the .debs and .rpms from one source tarball (lintian and
#            rpmlint: no errors), then tests/packaging installs the .debs into a debootstrapped
#            bookworm root (dependencies from Debian's archive; pkg-config and find_package
#            consumers built and run inside it) and the .rpms into a scratch rpm root
#   quick    (scripts/test.sh --quick only: phases deps and quick) the release configuration without
#            bindings in build/quick, ctest -L 'unit|integration': the inner loop between commits
# Every tree compiles through ccache (scripts/ccache-env.sh); each phase prints its hit rate.
# The release phase also builds the bindings (SMARTGEN_BINDINGS: Go, Java, Rust, Python; docs/bindings.md)
# and runs their tests and the 25-pair interop matrix (ctest label "bindings"), the install test
# (label "install") and the ABI gate (label "abi": exports, the Debian symbols file, abidiff).
# Prints the duration of each phase; exits nonzero when any step fails.
# Environment:
#   SMARTGEN_CTEST_ARGS   extra ctest arguments for every phase (e.g. "--repeat until-pass:2")
#   SMARTGEN_CTEST_JOBS   ctest parallelism (default: the number of cores)
#   SMARTGEN_BUILD_PREFIX build trees go to <prefix><preset> (default build/, the presets' own
#                         binaryDir; e.g. build/mine- for a tree of one's own)
#   SMARTGEN_PHASES       the phases to run, in order (default "deps release fuzz asan tsan package")
# Every phase runs with SMARTGEN_REQUIRE_DATA=1: a test whose checkpoint or cases are missing fails.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
JOBS=$(nproc)
CTEST_JOBS=${SMARTGEN_CTEST_JOBS:-$JOBS}
BUILD_PREFIX=${SMARTGEN_BUILD_PREFIX:-build/}

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
  local name=$1 fn=$2 start rc=0 cache
  echo
  echo "==== [$name] starting ($(date '+%H:%M:%S')) ===="
  start=$(now_ms)
  ccache_phase_start
  # A subshell with errexit on: `fn || rc=$?` would switch errexit off inside fn.
  set +e
  (set -e; "$fn")
  rc=$?
  set -e
  PHASE_NAMES+=("$name")
  PHASE_TIMES+=("$(( $(now_ms) - start ))")
  cache=$(ccache_phase_report)
  [[ -n $cache ]] && echo "==== [$name] $cache ===="
  if [[ $rc -ne 0 ]]; then
    PHASE_RESULTS+=("FAILED (exit $rc)${cache:+; $cache}")
    echo "==== [$name] FAILED (exit $rc) ====" >&2
    exit "$rc"
  fi
  PHASE_RESULTS+=("ok${cache:+; $cache}")
  echo "==== [$name] ok ===="
}

# configure + build + ctest of one preset (CMakePresets.json) in <prefix><preset>.
#   preset_build_and_test PRESET [--targets "T1 T2"] [CTEST ARGS...]
# The sanitizer options of the test presets are set by the phases themselves.
preset_build_and_test() {
  local preset=$1 dir targets=()
  shift
  if [[ ${1:-} == --targets ]]; then
    read -r -a targets <<<"$2"
    shift 2
  fi
  dir="$ROOT/${BUILD_PREFIX}${preset}"
  # shellcheck disable=SC2086 # word splitting of SMARTGEN_CTEST_ARGS is intended
  cmake --preset "$preset" -B "$dir" &&
    cmake --build "$dir" --parallel "$JOBS" ${targets[@]:+--target "${targets[@]}"} &&
    ctest --test-dir "$dir" --output-on-failure --no-tests=error -j "$CTEST_JOBS" ${SMARTGEN_CTEST_ARGS:-} "$@"
}

run_deps_phase() {
  bash "$ROOT/scripts/setup-deps.sh"
}

run_release_phase() {
  # The interop matrix fails, instead of skipping, when a language's launcher is missing: this
  # script installed every language's tools. The integration tests run in the asan phase (below),
  # but for RELEASE_BOUND_TESTS; the model tests run last, apart.
  # shellcheck disable=SC2086 # word splitting of SMARTGEN_CTEST_ARGS is intended
  SMARTGEN_INTEROP_REQUIRE_ALL=1 preset_build_and_test release -E "$MODEL_TESTS" -LE '^(integration|tsan)$' &&
    ctest --test-dir "$ROOT/${BUILD_PREFIX}release" --output-on-failure --no-tests=error -j "$CTEST_JOBS" \
      ${SMARTGEN_CTEST_ARGS:-} -R "$RELEASE_BOUND_TESTS" &&
    run_out_of_the_box
}

# The integration tests (labels integration and tsan: two processes or threads, real transports)
# run once, under AddressSanitizer in the asan phase, built at the same -O2: each one ran in both
# phases before, 460 of the release phase's 1,270 test-seconds (2 vCPU AMD EPYC) spent on the same
# checks. Release runs those whose checks differ in a release build: bounds a sanitizer's
# allocator or slowdown would void (a surviving process's mappings and heap after a peer's kill, RSS
# after a refused answer, address space at SG_ERR_NO_MEMORY, idle CPU, staging throughput, how soon
# the other side of a killed rail is told, and the rail tests' full-size pools). Of the ten kill
# points, the two mid-transfer ones: the mappings and heap check is the same after each, and each
# takes 4 s alone on the cores (the asan phase runs all ten). The quick phase and a developer's
# whole ctest run every integration test in release.
RELEASE_BOUND_TESTS='^(Failure/KillAt\..*/(Prefill|Decode)_mid_transfer|KvPairTcp\.ARail|DirectoryHostile\.AnAnswerTooLarge|SelectorApi\.OutOfAddressSpace|Idle\.|StagingPolicy\.)'

# The tests that read the checkpoints (examples/models) or run smartgen-disagg: the engine, quality,
# calibration and selective-run tests (disagg.*), the two-process comparisons (example.disagg.*) and
# the checksums (models.*). A regular expression, not a label: labels given to gtest_discover_tests
# cannot hold a list.
MODEL_TESTS='^(disagg|example\.disagg|models)\.'

# The model-quality sweeps (tests over every case of a model's prompts) the asan phase leaves out.
ASAN_SKIPPED_TESTS='^disagg\.(Retrieval2k\.GreedyAnswersOnAllCases|Quality\.OnRetrieval2k|Quality\.OnStories260K)'

# The model and quality tests and the demo, from a view of the repository with nothing beside it
# (scripts/isolated.sh: a private mount namespace; needs root, which CI has): a default path that
# leads outside the repository fails here. Without root (a developer's own run) they run in place.
run_out_of_the_box() {
  local dir="$ROOT/${BUILD_PREFIX}release" wrap=()
  if [[ $(id -u) -eq 0 ]] && command -v unshare >/dev/null; then
    wrap=(bash "$ROOT/scripts/isolated.sh")
  else
    echo "test.sh: not root: the model tests and the demo run beside whatever is next to this clone" >&2
  fi
  # shellcheck disable=SC2086 # word splitting of SMARTGEN_CTEST_ARGS is intended
  "${wrap[@]}" ctest --test-dir "$dir" --output-on-failure --no-tests=error -j "$CTEST_JOBS" \
    ${SMARTGEN_CTEST_ARGS:-} -R "$MODEL_TESTS" &&
    SMARTGEN_BUILD_DIR=$dir "${wrap[@]}" bash scripts/demo.sh --no-build
}

# Six fuzzers x 9 s (scripts/fuzz.sh, docs/fuzzing.md; about 55 s once built): any crash, leak or
# sanitizer report fails.
run_fuzz_phase() {
  SG_FUZZ_FRESH=1 SG_FUZZ_SEED=1 bash "$ROOT/scripts/fuzz.sh" 9
}

# The sanitizers' options come from scripts/sanitizer-env.sh (sourced in the phase's subshell), the one
# place they are set; the test sanitizer.options_reach_tests fails the phase when they do not reach
# the test processes (a comment line inside a backslash-continued command once dropped them).
run_asan_phase() {
  # shellcheck source=scripts/sanitizer-env.sh
  . "$ROOT/scripts/sanitizer-env.sh"
  # Not here: the benches, the layering check and the soak's ctest entry (release-only figures; the
  # soak runs below with the sanitizers' bounds), and the three model-quality sweeps
  # (ASAN_SKIPPED_TESTS), which run the same engine code as the disagg tests that do run here, over
  # many more prompts (85 of the phase's 722 test-seconds on a 2 vCPU AMD EPYC); release runs them.
  preset_build_and_test asan -LE 'bench|layering|soak' -E "$ASAN_SKIPPED_TESTS" &&
    # The soak's short form with LeakSanitizer in every worker; ASan's quarantine keeps freed memory,
    # so the RSS growth bound is raised as docs/soak.md says (everything else is checked as in release).
    # With the runtime's end-to-end verification on (the release soak runs without it).
    "$ROOT/${BUILD_PREFIX}asan/tools/soak/smartgen-soak" --short --verify --rss-bound-mib 512
}

# ThreadSanitizer: the tests labelled tsan (tests/CMakeLists.txt: those that run threads against
# each other: concurrency, sessions, failures, and a rail killed under the lanes' threads);
# they all live in integration_tests (and link_peer for Failure.NetnsLinkDown), so only those are
# built. die_after_fork=0: the failure tests fork a peer process that starts its own threads, which is
# allowed by SmartGen's fork rule (a child makes its own context) but TSan refuses by default.
# No test is retried: a failure fails the phase. The contexts of these tests get a 10 s default peer
# timeout (SG_PEER_TIMEOUT_MS; the Failure tests that time peer-loss detection set theirs in their
# options), as a scale for ThreadSanitizer's 5-15x slowdown, like the tests' own waits
# (tests/support/test_time.hpp); the runtime's liveness no longer counts its own stalls as the
# peer's silence (runtime/core/liveness.hpp).
run_tsan_phase() {
  # shellcheck source=scripts/sanitizer-env.sh
  . "$ROOT/scripts/sanitizer-env.sh"
  SG_PEER_TIMEOUT_MS=10000 \
    preset_build_and_test tsan --targets "integration_tests link_peer" \
      -L '^tsan$'
}

# The inner loop between commits (scripts/test.sh --quick): the release configuration without the
# bindings, in its own tree (build/quick; ccache makes its compile nearly free after a release
# build), and only the unit and integration tests. No sanitizers, fuzzers, examples' model runs,
# benches, bindings or packages: run the whole suite before a submission.
run_quick_phase() {
  preset_build_and_test quick -L '^(unit|integration)$'
}

# Packages and the clean-machine install tests. A test that cannot run here (no root, no archive)
# exits 77 and is reported as skipped; any other failure fails the phase.
run_package_phase() {
  local out="$ROOT/${BUILD_PREFIX}packages" rc t
  bash "$ROOT/scripts/package.sh" --out "$out"
  for t in clean_root_deb rpm_root; do
    echo "---- tests/packaging/$t.sh"
    rc=0
    bash "$ROOT/tests/packaging/$t.sh" "$out" "$ROOT" || rc=$?
    if [[ $rc -eq 77 ]]; then
      echo "---- $t: SKIPPED (reason above)"
    elif [[ $rc -ne 0 ]]; then
      return "$rc"
    fi
  done
}

# A test that needs a checkpoint or case file fails, instead of skipping, when it is missing
# (examples/models/README.md): the repository carries them, so a missing one is a defect.
export SMARTGEN_REQUIRE_DATA=1

# Every tree compiles through ccache (scripts/ccache-env.sh); each phase prints its hit rate.
# shellcheck source=scripts/ccache-env.sh
. "$ROOT/scripts/ccache-env.sh"
ccache_env "$ROOT"

DEFAULT_PHASES="deps release fuzz asan tsan package"
case ${1:-} in
  "") ;;
  --quick) DEFAULT_PHASES="deps quick" ;;
  -h | --help)
    trap - EXIT
    echo "usage: scripts/test.sh [--quick]"
    echo "  (none)   every phase, as CI runs it: $DEFAULT_PHASES (each prints its time and ccache hit rate)"
    echo "  --quick  release build without bindings, unit + integration tests only (between commits)"
    exit 0 ;;
  *) trap - EXIT; echo "test.sh: unknown argument '$1' (--quick, --help)" >&2; exit 2 ;;
esac

TOTAL_START=$(now_ms)
for phase in ${SMARTGEN_PHASES:-$DEFAULT_PHASES}; do
  case $phase in
    deps | release | fuzz | asan | tsan | package | quick) run_phase "$phase" "run_${phase}_phase" ;;
    *) echo "test.sh: unknown phase '$phase' (deps release fuzz asan tsan package quick)" >&2; exit 2 ;;
  esac
done
PHASE_NAMES+=("total")
PHASE_TIMES+=("$(( $(now_ms) - TOTAL_START ))")
PHASE_RESULTS+=("ok")
echo
echo "test.sh: all phases passed"
