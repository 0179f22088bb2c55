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
if (( rc & 8 )); then
  old=$(grep -oE "soname='[^']+'" "$baseline" | head -1 | cut -d"'" -f2)
  new=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
  if [[ "$old" != "$new" ]]; then
    echo "ok: incompatible ABI change with a new SONAME ($old -> $new); move the baseline (--update)"
    exit 0
  fi
  echo "FAIL: incompatible ABI change against the 0.2 baseline with the SONAME unchanged ($new)."
  echo "Restore compatibility (append fields, add a function in a new version node: docs/abi.md) or"
  echo "bump SG_ABI_VERSION. abidiff says:"
  echo "$report"
  exit 1
fi
if (( rc & 4 )); then
  echo "ok: compatible ABI changes against the baseline:"
  echo "$report"
else
  echo "ok: the ABI is the baseline's"
fi
