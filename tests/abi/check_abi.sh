#!/usr/bin/env bash
# The ABI gate (docs/abi.md): the library's ABI against the committed baseline of the release it
# must stay compatible with (abi/baseline: abidw's description of libsmartgen.so.0 at 0.2.0 and the
# header it came from). An incompatible change (abidiff's bit 8: a changed struct layout, a removed
# or retyped function, ...) fails unless the SONAME major changed with it; compatible changes (added
# functions) pass and are listed. The library must carry DWARF (CMake's smartgen_abi_dwarf target).
#   check_abi.sh LIBRARY SOURCE_DIR            check
#   check_abi.sh LIBRARY SOURCE_DIR --update   rewrite the baseline from LIBRARY (at a release only)
set -euo pipefail
lib=$1
src=$2
baseline=$src/abi/baseline/smartgen-0.2.abi
baseline_headers=$src/abi/baseline/include/smartgen

if ! command -v abidiff >/dev/null 2>&1; then
  echo "SKIP: abidiff not found (Debian package abigail-tools; scripts/setup-deps.sh installs it)"
  exit 77
fi
if [[ ${3:-} == --update ]]; then
  cp "$src/include/smartgen/smartgen.h" "$baseline_headers/smartgen.h"
  abidw --no-corpus-path --drop-private-types --headers-dir "$baseline_headers" --out-file "$baseline" "$lib"
  echo "baseline rewritten from $lib"
  exit 0
fi

set +e
report=$(abidiff --headers-dir1 "$baseline_headers" --headers-dir2 "$src/include/smartgen" "$baseline" "$lib" 2>&1)
rc=$?
set -e
if (( rc & 3 )); then
  echo "FAIL: abidiff could not compare (exit $rc):"
  echo "$report"
  exit 1
fi
# abidiff sets its incompatible bit (8) for a removed function, but reports a struct reached through
# a pointer (all of SmartGen's) as an "indirect sub-type change" (bit 4 only), even when a field
# moved. So bit 4's report is read line by line: the only changes allowed are functions added,
# fields appended (inserted at or past the old size) and the struct growing with them, enumerators
# added. Any other line, a line this script does not know included, counts as incompatible.
incompatible_lines() {
  awk '
    /^[[:space:]]*$/ { next }
    /Functions changes summary: 0 Removed, [0-9]+ Changed( \([0-9]+ filtered out\))?, [0-9]+ Added functions?/ { next }
    /Variables changes summary: 0 Removed, [0-9]+ Changed, [0-9]+ Added variables?/ { next }
    /^[0-9]+ (Added|Changed) functions?:?$/ || /^[0-9]+ functions? with (some )?(indirect )?sub-type changes?:$/ { next }
    /^[[:space:]]*\[A\] .function / { next }
    /^[[:space:]]*\[C\] .function .* has some (indirect )?sub-type changes:$/ { next }
    /^[[:space:]]*parameter [0-9]+ of type .* has sub-type changes:$/ { next }
    /^[[:space:]]*in pointed to type .*:$/ { next }
    /^[[:space:]]*in unqualified underlying type .*:$/ { next }
    /^[[:space:]]*underlying type .* changed:$/ { next }
    /^[[:space:]]*type size changed from [0-9]+ to [0-9]+ \(in bits\)$/ {
      match($0, /from [0-9]+/); size = substr($0, RSTART + 5, RLENGTH - 5) + 0
      match($0, /to [0-9]+/); grown = substr($0, RSTART + 3, RLENGTH - 3) + 0
      if (grown > size) next
    }
    /^[[:space:]]*[0-9]+ data member insertions?:$/ { next }
    /^[[:space:]]*.*, at offset [0-9]+ \(in bits\)/ && size > 0 {
      match($0, /at offset [0-9]+/); off = substr($0, RSTART + 10, RLENGTH - 10) + 0
      if (off >= size) next
    }
    /^[[:space:]]*[0-9]+ enumerator insertions?:$/ { next }
    /^[[:space:]]*.[A-Z0-9_]+. value .[-0-9]+.$/ { next }
    { print }
  '
}

old_soname=$(grep -oE "soname='[^']+'" "$baseline" | head -1 | cut -d"'" -f2)
new_soname=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
bad_lines=""
if (( rc & 4 )); then
  bad_lines=$(echo "$report" | incompatible_lines)
fi
if (( rc & 8 )) || [[ -n "$bad_lines" ]]; then
  if [[ "$old_soname" != "$new_soname" ]]; then
    echo "ok: incompatible ABI change with a new SONAME ($old_soname -> $new_soname); move the baseline (--update)"
    exit 0
  fi
  echo "FAIL: incompatible ABI change against the 0.2 baseline with the SONAME unchanged ($new_soname)."
  echo "Restore compatibility (append fields, add a function in a new version node: docs/abi.md) or"
  echo "bump SG_ABI_VERSION."
  [[ -n "$bad_lines" ]] && { echo "Not an append or an addition:"; echo "$bad_lines"; }
  echo "abidiff (exit $rc) says:"
  echo "$report"
  exit 1
fi
if (( rc & 4 )); then
  echo "ok: compatible ABI changes against the baseline (appends and additions only):"
  echo "$report"
else
  echo "ok: the ABI is the baseline's"
fi
