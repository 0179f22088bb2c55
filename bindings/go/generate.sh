#!/bin/sh
# Regenerates the raw layer (internal/raw/smartgen.go, smartgen_wrap.c) from the one SWIG interface,
# bindings/swig/smartgen.i, and the public header. Run it after either changes; the ctest test
# go_raw_current fails while the files here differ from what SWIG makes of the current header.
#   usage: [SWIG=/path/to/swig] generate.sh [OUTDIR]   (default: internal/raw next to this script)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:-$here/internal/raw}
mkdir -p "$out"
out=$(cd "$out" && pwd)
# From the repository root with relative paths: SWIG writes the interface's path into the files,
# and an absolute one would differ between checkouts.
cd "$repo"
"${SWIG:-swig}" -go -cgo -intgosize 64 -package raw -Iinclude -Ibindings/swig \
    -outdir "$out" -o "$out/smartgen_wrap.c" bindings/swig/smartgen.i
