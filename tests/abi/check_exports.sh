#!/usr/bin/env bash
# The library exports exactly the sg_* functions the header declares (plus its version nodes), the
# version script's per-node lists name exactly those exports, and its SONAME follows the header's
# ABI major.
set -euo pipefail
lib=$1
header=$2
fail=0
pass=0
ok() { pass=$((pass + 1)); }
bad() { echo "FAIL: $*"; fail=$((fail + 1)); }

exported=$(nm -D --defined-only "$lib" | awk '{print $3}' | sed 's/@.*//' | sort -u)
others=$(echo "$exported" | grep -v '^sg_' | grep -v '^SMARTGEN_' || true)
[ -z "$others" ] && ok || bad "exports outside sg_*: $others"

declared=$(grep -oE 'SG_API [^(]*\bsg_[a-z0-9_]+\(' "$header" | sed -E 's/.*\b(sg_[a-z0-9_]+)\($/\1/' | sort -u)
missing=$(comm -23 <(echo "$declared") <(echo "$exported" | grep '^sg_'))
extra=$(comm -13 <(echo "$declared") <(echo "$exported" | grep '^sg_'))
[ -z "$missing" ] && ok || bad "declared but not exported: $missing"
[ -z "$extra" ] && ok || bad "exported but not declared: $extra"

nodes=$(nm -D --defined-only "$lib" | awk '$2 == "A" {print $3}')
echo "$nodes" | grep -qx 'SMARTGEN_0.1' && ok || bad "version node SMARTGEN_0.1 missing (got: $nodes)"
# The map lists every symbol by name (no pattern): its lists together are exactly the library's
# exports, every node of the map is in the library, and each symbol carries the version of the node
# that lists it.
map=$(dirname "$0")/../../abi/smartgen.map
listed=""
for node in $(grep -oE '^SMARTGEN_[0-9.]+' "$map"); do
  echo "$nodes" | grep -qx "$node" && ok || bad "version node $node of the map missing (got: $nodes)"
  syms=$(sed -n "/^$node {/,/^}/p" "$map" | grep -oE '^\s+sg_[a-z0-9_]+;' | tr -d ' ;')
  [ -n "$syms" ] && ok || bad "version node $node lists no symbol"
  listed="$listed $syms"
  for sym in $syms; do
    got=$(objdump -T "$lib" | awk -v s="$sym" '$NF == s {print $(NF-1)}' | tr -d '()')
    echo "$got" | grep -qx "$node" && ok || bad "$sym has version(s) '$(echo $got)', the map puts it in $node"
  done
done
grep -qE '^\s+sg_[a-z0-9_]*\*' "$map" && bad "the map uses a pattern; list each symbol by name" || ok
listed=$(echo "$listed" | tr ' ' '\n' | grep . | sort)
# The symbols in several nodes are those the baseline-header programs bind to their old versions.
shim=$(dirname "$0")/bind_as_built_against_baseline.h
in_shim=$(grep -oE '\.symver (sg_[a-z0-9_]+),' "$shim" | sed -E 's/\.symver (.*),/\1/' | sort)
[ "$in_shim" = "$(echo "$listed" | uniq -d)" ] && ok ||
  bad "bind_as_built_against_baseline.h binds '$(echo $in_shim)', the map lists '$(echo "$listed" | uniq -d | tr '\n' ' ')' in several nodes"
# A symbol in several nodes is an _init whose struct grew: it must be exported in each (checked
# above), and its default version (the one a new program binds to) must be the newest node's.
for sym in $(echo "$listed" | uniq -d); do
  newest=$(grep -oE '^SMARTGEN_[0-9.]+' "$map" | while read -r n; do
    if sed -n "/^$n {/,/^}/p" "$map" | grep -qE "^\s+$sym;"; then echo "$n"; fi; done | tail -1)
  default=$(objdump -T "$lib" | awk -v s="$sym" '$NF == s && $(NF-1) !~ /^\(/ {print $(NF-1)}')
  [ "$default" = "$newest" ] && ok || bad "$sym's default version is '$default', the newest node listing it is $newest"
done
unlisted=$(comm -13 <(echo "$listed" | sort -u) <(echo "$exported" | grep '^sg_'))
notexported=$(comm -23 <(echo "$listed" | sort -u) <(echo "$exported" | grep '^sg_'))
[ -z "$unlisted" ] && ok || bad "exported but in no node of the map: $unlisted"
[ -z "$notexported" ] && ok || bad "listed in the map but not exported: $notexported"
# The Debian symbols file names every exported symbol with its version node (dpkg-gensymbols
# checks the same at package build; this catches it in every test run).
symbols=$(dirname "$0")/../../packaging/debian/libsmartgen0.symbols
if [ -f "$symbols" ]; then
  in_file=$(grep -oE '^ (sg_[a-z0-9_]+|SMARTGEN_[0-9.]+)@SMARTGEN_[0-9.]+' "$symbols" | tr -d ' ' | sort)
  in_lib=$(objdump -T "$lib" | awk '$NF ~ /^(sg_|SMARTGEN_)/ {v = $(NF-1); gsub(/[()]/, "", v); print $NF "@" v}' | sort -u)
  missing_sym=$(comm -13 <(echo "$in_file") <(echo "$in_lib"))
  stale_sym=$(comm -23 <(echo "$in_file") <(echo "$in_lib"))
  [ -z "$missing_sym" ] && ok || bad "exported but not in packaging/debian/libsmartgen0.symbols: $missing_sym"
  [ -z "$stale_sym" ] && ok || bad "in libsmartgen0.symbols but not exported so: $stale_sym"
fi
# nm shows versions only with --with-symbol-versions on older binutils; objdump always does.
unversioned=$(objdump -T "$lib" | awk '/ sg_/ && !/SMARTGEN_/ {print $NF}')
[ -z "$unversioned" ] && ok || bad "sg_ symbols without a version node: $unversioned"

# CUDA is a plugin loaded on demand (kernels/cuda): the library itself needs no CUDA library, so it
# loads and runs host transfers on machines without a driver or toolkit.
cuda_needed=$(readelf -d "$lib" | grep NEEDED | grep -iE 'cuda|cublas|nvrtc' || true)
[ -z "$cuda_needed" ] && ok || bad "the library needs a CUDA library: $cuda_needed"

abi=$(grep -oE '#define SG_ABI_VERSION [0-9]+' "$header" | awk '{print $3}')
soname=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[ "$soname" = "libsmartgen.so.$abi" ] && ok || bad "SONAME is '$soname', want libsmartgen.so.$abi"

echo "exports: $(echo "$declared" | wc -l) functions declared and exported; SONAME $soname"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
