#!/usr/bin/env bash
# The library exports exactly the sg_* functions the header declares (plus its version nodes), and
# its SONAME follows the header's ABI major.
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
# Every node of the version script is in the library, and each symbol a node names (nodes after
# 0.1 list theirs; 0.1 keeps a pattern) carries that node's version, not the pattern's.
map=$(dirname "$0")/../../abi/smartgen.map
for node in $(grep -oE '^SMARTGEN_[0-9.]+' "$map"); do
  echo "$nodes" | grep -qx "$node" && ok || bad "version node $node of the map missing (got: $nodes)"
  for sym in $(sed -n "/^$node {/,/^}/p" "$map" | grep -oE '^\s+sg_[a-z0-9_]+;' | tr -d ' ;'); do
    got=$(objdump -T "$lib" | awk -v s="$sym" '$NF == s {print $(NF-1)}' | tr -d '()')
    [ "$got" = "$node" ] && ok || bad "$sym has version '$got', the map puts it in $node"
  done
done
# nm shows versions only with --with-symbol-versions on older binutils; objdump always does.
unversioned=$(objdump -T "$lib" | awk '/ sg_/ && !/SMARTGEN_/ {print $NF}')
[ -z "$unversioned" ] && ok || bad "sg_ symbols without a version node: $unversioned"

abi=$(grep -oE '#define SG_ABI_VERSION [0-9]+' "$header" | awk '{print $3}')
soname=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[ "$soname" = "libsmartgen.so.$abi" ] && ok || bad "SONAME is '$soname', want libsmartgen.so.$abi"

echo "exports: $(echo "$declared" | wc -l) functions declared and exported; SONAME $soname"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
