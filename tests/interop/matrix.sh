#!/usr/bin/env bash
# The interop matrix: every (prefill language x decode language) pair of the interop programs
# (docs/bindings.md) moves the same two requests over tcp;ofi_rxm on 127.0.0.1, 25 pairs in all.
#
# usage: matrix.sh LAUNCHER_DIR [program args...]
#   LAUNCHER_DIR holds smartgen-interop-{c,go,java,rust,python}; program args go to both sides (e.g.
#   --layers 4 for a quicker run). Environment: SMARTGEN_INTEROP_PAIR_TIMEOUT (seconds per side,
#   default 120), SMARTGEN_INTEROP_REQUIRE_ALL=1 (a missing launcher fails instead of skipping).
# Exit status: 0 when every pair passed; 1 when a pair failed (or a launcher is missing under
# REQUIRE_ALL); 77 (skip) when the pairs that could run passed but a launcher is missing.
# shellcheck disable=SC2034  # cell and secs are read through print_table's nameref
set -u
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=pair.sh
. "$here/pair.sh"

if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  echo "usage: $0 LAUNCHER_DIR [program args...]  (LAUNCHER_DIR: ${1:-none given} is not a directory)" >&2
  [ $# -ge 1 ] && [ "${SMARTGEN_INTEROP_REQUIRE_ALL:-0}" != 1 ] && exit 77
  exit 1
fi
launchers=$1
shift
PAIR_ARGS=("$@")
limit=${SMARTGEN_INTEROP_PAIR_TIMEOUT:-120}

work=$(mktemp -d "${TMPDIR:-/tmp}/smartgen-interop.XXXXXX") || exit 1
trap 'interop_kill_children; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
interop_make_key "$work" || { echo "cannot write a key file in $work" >&2; exit 1; }

declare -A present cell secs
missing=()
for lang in "${INTEROP_LANGS[@]}"; do
  if [ -x "$launchers/smartgen-interop-$lang" ]; then
    present[$lang]=1
  else
    present[$lang]=0
    missing+=("$lang")
  fi
done

failed=0
failures=()
for p in "${INTEROP_LANGS[@]}"; do
  for d in "${INTEROP_LANGS[@]}"; do
    if [ "${present[$p]}" = 0 ] || [ "${present[$d]}" = 0 ]; then
      cell[$p,$d]=missing
      secs[$p,$d]=-
      continue
    fi
    dir="$work/$p-$d"
    mkdir -p "$dir"
    echo "pair prefill=$p decode=$d ..." >&2
    interop_run_pair "$launchers/smartgen-interop-$p" "$launchers/smartgen-interop-$d" "$dir" "$limit"
    why=$(interop_pair_verdict "$p" "$d" "$dir")
    secs[$p,$d]=$PAIR_SECONDS
    if [ -z "$why" ]; then
      cell[$p,$d]=ok
      continue
    fi
    cell[$p,$d]="FAIL: $why"
    failed=1
    failures+=("$p,$d")
    {
      echo "=== FAIL prefill=$p decode=$d ($PAIR_SECONDS s): $why"
      interop_print_logs "$dir"
    } >&2
  done
done

# The tables: rows are the prefill language, columns the decode language.
print_table() {
  local title=$1 array=$2 width=8 p d v
  local -n values=$array
  for v in "${values[@]}"; do [ ${#v} -gt "$width" ] && width=${#v}; done
  echo
  echo "$title"
  printf '%-16s' "prefill \\ decode"
  for d in "${INTEROP_LANGS[@]}"; do printf ' | %-*s' "$width" "$d"; done
  echo
  for p in "${INTEROP_LANGS[@]}"; do
    printf '%-16s' "$p"
    for d in "${INTEROP_LANGS[@]}"; do printf ' | %-*s' "$width" "${values[$p,$d]}"; done
    echo
  done
}
print_table "Result" cell
print_table "Seconds per pair" secs
echo

if [ "$failed" = 1 ]; then
  echo "interop matrix: ${#failures[@]} pair(s) failed: ${failures[*]}"
  exit 1
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "interop matrix: no launcher for ${missing[*]} in $launchers (build those bindings first)"
  [ "${SMARTGEN_INTEROP_REQUIRE_ALL:-0}" = 1 ] && exit 1
  exit 77
fi
echo "interop matrix: all $(( ${#INTEROP_LANGS[@]} * ${#INTEROP_LANGS[@]} )) pairs passed"
exit 0
