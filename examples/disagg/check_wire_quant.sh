#!/bin/sh
# check_wire_quant.sh BINARY "ARGS" MAX_RATIO: runs smartgen-disagg with ARGS (which carry --wire-quant)
# and --json between two processes, and checks what the decode side reports: every payload byte came
# quantized (quantized_bytes = kv_bytes for a full transfer, > 0 for a selective one), the wire bytes
# are at most MAX_RATIO of them (codes plus scales), and the run generated its tokens.
# Exit status: 0 as stated, 1 otherwise, 77 (skip) when the model file is absent.
set -u
bin=$1
args=$2
max_ratio=$3
# shellcheck disable=SC2086
out=$("$bin" $args --json --quiet) || {
    rc=$?
    [ "$rc" = 77 ] && exit 77
    echo "FAIL: smartgen-disagg $args exited $rc"
    exit 1
}
printf '%s\n' "$out"
field() { printf '%s\n' "$out" | sed -n "s/.*\"$1\": \"\{0,1\}\([^,\"]*\)\"\{0,1\}[,}].*/\1/p" | head -1; }
mode=$(field mode)
kv=$(field kv_bytes)
q=$(field quantized_bytes)
w=$(field quantized_wire_bytes)
wire=$(field wire_quant)
new=$(field new_tokens)
got=$(printf '%s\n' "$out" | sed -n 's/.*"tokens": \[\([^]]*\)\].*/\1/p' | tr ',' '\n' | grep -c .)
echo "mode $mode wire_quant $wire: kv_bytes $kv quantized_bytes $q quantized_wire_bytes $w tokens $got/$new"
[ -n "$q" ] && [ "$q" -gt 0 ] || { echo "FAIL: nothing travelled quantized"; exit 1; }
[ "$wire" != none ] || { echo "FAIL: the run reports wire_quant none"; exit 1; }
if [ "$mode" = full ] && [ "$q" != "$kv" ]; then
    echo "FAIL: a full transfer quantized $q of $kv bytes"
    exit 1
fi
awk -v w="$w" -v q="$q" -v m="$max_ratio" 'BEGIN { exit !(w <= q * m) }' ||
    { echo "FAIL: $w wire bytes for $q pool bytes is more than $max_ratio of them"; exit 1; }
[ "$got" = "$new" ] || { echo "FAIL: $got tokens, asked for $new"; exit 1; }
echo "ok"
