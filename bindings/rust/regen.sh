#!/bin/sh
# Regenerates smartgen-sys/src/bindings.rs from include/smartgen/smartgen.h with bindgen, or with
# --check regenerates it into a temporary file and fails when it differs from the committed one
# (ctest: rust_sys_regen). Exit status: 0 same / regenerated, 1 different or failed, 77 skipped
# (a tool is missing or another bindgen version: its output differs for reasons of its own).
#
# Options, and why:
#   --default-enum-style consts   C enums become integer constants of the typedef's type, never Rust
#                                 enums: a newer library may hand back a status or event kind this
#                                 file does not name, and an undeclared value in a Rust enum is UB.
#   --no-prepend-enum-name        the constants keep their C names (SG_OK, SG_DTYPE_FP16).
#   --allowlist-{function,type,var} sg_.* / SG_.*
#                                 only the SmartGen API, not what <stdint.h>/<stddef.h> declare.
#   --size_t-is-usize             size_t is usize (bindgen 0.60 otherwise makes a c_ulong alias).
#   --rust-target 1.47            the newest target bindgen 0.60 knows at or below our minimum (1.63);
#                                 written out so the output does not follow bindgen's default.
#   rustfmt with rustfmt.toml     a reviewable file; rustfmt's formatting of stable code is stable.
#   layout tests kept             cargo test checks every struct's size and field offsets as clang
#                                 computed them, so a committed file that drifted from the target's
#                                 ABI fails there.
#   -- -std=c99                   the header's own language.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
header=${SMARTGEN_HEADER:-$here/../../include/smartgen/smartgen.h}
committed=$here/smartgen-sys/src/bindings.rs
BINDGEN=${BINDGEN:-bindgen}
PINNED_BINDGEN=0.60

check=0
case "${1:-}" in
  --check) check=1 ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

skip() {
  echo "SKIP: $*" >&2
  exit 77
}

command -v "$BINDGEN" >/dev/null 2>&1 || skip "bindgen not found (Debian: apt-get install bindgen)"
version=$("$BINDGEN" --version | awk '{print $2}')
case "$version" in
  "$PINNED_BINDGEN".*) ;;
  *) skip "bindgen $version; the committed file comes from bindgen $PINNED_BINDGEN.x" ;;
esac
# bindgen runs rustfmt itself: RUSTFMT names it, else the one on PATH.
RUSTFMT=${RUSTFMT:-$(command -v rustfmt || true)}
[ -n "$RUSTFMT" ] && [ -x "$RUSTFMT" ] || skip "rustfmt not found (set RUSTFMT or put it on PATH)"
export RUSTFMT

out=$(mktemp "${TMPDIR:-/tmp}/smartgen-bindings.XXXXXX")
trap 'rm -f "$out"' EXIT

"$BINDGEN" \
  --default-enum-style consts \
  --no-prepend-enum-name \
  --allowlist-function 'sg_.*' \
  --allowlist-type 'sg_.*' \
  --allowlist-var 'SG_.*' \
  --size_t-is-usize \
  --rust-target 1.47 \
  --rustfmt-configuration-file "$here/smartgen-sys/rustfmt.toml" \
  --output "$out" \
  "$header" -- -std=c99

if [ "$check" -eq 0 ]; then
  cp "$out" "$committed"
  echo "regenerated $committed"
  exit 0
fi
if ! diff -u "$committed" "$out"; then
  echo "FAIL: $committed differs from what bindgen makes of $header; run $0 and commit the result" >&2
  exit 1
fi
echo "ok: $committed matches $header"
