#!/usr/bin/env bash
# Runs the ctest tests matching REGEX in a build tree N times, optionally beside a CPU hog, and
# counts the failures: the check that a test once seen to fail on timing no longer does.
#   scripts/repeat-tests.sh TREE REGEX N [HOG_THREADS]
# e.g. scripts/repeat-tests.sh build/tsan '^KvPairTcp\.ARailKilled' 20 1
# Sanitizer trees get scripts/sanitizer-env.sh's options (and the tsan phase's peer timeout), as in
# scripts/test.sh. Prints one line per round and a summary; exits 1 when any round failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ $# -ge 3 ]] || { echo "usage: $0 TREE REGEX N [HOG_THREADS]" >&2; exit 2; }
tree=$1 regex=$2 n=$3 hog=${4:-0}
[[ -f $tree/CTestTestfile.cmake ]] || { echo "$0: $tree is no ctest tree" >&2; exit 2; }
# shellcheck source=scripts/sanitizer-env.sh
. scripts/sanitizer-env.sh
if [[ $tree == *tsan* ]]; then export SG_PEER_TIMEOUT_MS=${SG_PEER_TIMEOUT_MS:-10000}; fi
hog_pid=
if [[ $hog -gt 0 ]]; then
  bash scripts/cpu-hog.sh "$hog" 7200 2>/dev/null &
  hog_pid=$!
  trap 'kill $hog_pid 2>/dev/null || true' EXIT
fi
failed=0
start=$(date +%s)
for ((i = 1; i <= n; i++)); do
  t0=$(date +%s)
  if ctest --test-dir "$tree" -R "$regex" --output-on-failure >"/tmp/repeat-tests.$$.log" 2>&1; then
    verdict=ok
  else
    verdict=FAILED
    failed=$((failed + 1))
    cp "/tmp/repeat-tests.$$.log" "/tmp/repeat-tests.$$.fail$i.log"
  fi
  tests=$(grep -cE 'Test +#' "/tmp/repeat-tests.$$.log" || true)
  echo "round $i/$n: $verdict ($tests tests, $(( $(date +%s) - t0 )) s, CPU hog threads: $hog)"
done
rm -f "/tmp/repeat-tests.$$.log"
echo "repeat-tests: $regex in $tree: $n rounds, $failed failed, $(( $(date +%s) - start )) s, CPU hog threads: $hog"
[[ $failed -eq 0 ]] || { echo "failed rounds' logs: /tmp/repeat-tests.$$.fail*.log" >&2; exit 1; }
