#!/bin/sh
# Checks that internal/raw is what SWIG makes of the current header and bindings/swig/go.i: it
# regenerates into OUTDIR and compares. Another SWIG version writes other (equally valid) code, so
# a version other than the one that made the committed files skips the check (exit 77).
#   usage: [SWIG=/path/to/swig] check_raw.sh OUTDIR
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=$1
swig=${SWIG:-swig}
committed=$(sed -n 's/^ \* Version \(.*\)$/\1/p' "$here/internal/raw/smartgen.go" | head -n 1)
found=$("$swig" -version | sed -n 's/^SWIG Version \(.*\)$/\1/p')
if [ "$committed" != "$found" ]; then
    echo "go_raw_current skipped: internal/raw was made by SWIG $committed, this is SWIG $found"
    exit 77
fi
SWIG=$swig sh "$here/generate.sh" "$out"
for f in smartgen.go smartgen_wrap.c; do
    if ! diff -u "$here/internal/raw/$f" "$out/$f"; then
        echo "bindings/go/internal/raw/$f is stale: run bindings/go/generate.sh"
        exit 1
    fi
done
echo "internal/raw matches SWIG $found's output for the current header"
