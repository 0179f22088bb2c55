#!/bin/sh
# check_sides.sh BINARY: the two sides of smartgen-disagg started as separate processes, as
# scripts/netns-disagg.sh starts them (loopback here):
#   1. an emulated run opens no checkpoint on either side: SMARTGEN_MODEL and SMARTGEN_MODEL_DIR point
#      at nothing and both sides still finish;
#   2. a decode side that cannot start (a real-model run, and no checkpoint on its side) makes the
#      prefill side stop at once with the decode side's reason, not after its --timeout.
# Exit status: 0 both hold, 1 otherwise.
set -u
bin=$1
work=$(mktemp -d)
trap 'kill $pre_pid 2>/dev/null; rm -rf "$work"' EXIT
pre_pid=
head -c 32 /dev/urandom >"$work/key"
chmod 600 "$work/key"
export SG_AUTH_KEY_FILE="$work/key"

# start_prefill ARGS...: starts the prefill side on a free loopback port; sets pre_pid and port.
start_prefill() {
    "$bin" --role prefill --listen 127.0.0.1:0 --timeout 60 --json --quiet "$@" >"$work/pre.out" 2>"$work/pre.err" &
    pre_pid=$!
    port=
    for _ in $(seq 1 200); do
        port=$(sed -n 's/.*listening on 127\.0\.0\.1:\([0-9]*\);.*/\1/p' "$work/pre.err" | head -1)
        [ -n "$port" ] && return 0
        kill -0 "$pre_pid" 2>/dev/null || break
        sleep 0.05
    done
    echo "FAIL: the prefill side did not listen:"; cat "$work/pre.err"; exit 1
}

echo "== 1. emulated: neither side opens a checkpoint"
SMARTGEN_MODEL=/nonexistent/stories260K.bin SMARTGEN_MODEL_DIR=/nonexistent \
    start_prefill --mode full --emulate llama3-8b --emulate-tokens 1024
SMARTGEN_MODEL=/nonexistent/stories260K.bin SMARTGEN_MODEL_DIR=/nonexistent \
    "$bin" --role decode --peer "127.0.0.1:$port" --timeout 60 --quiet >"$work/dec.out" 2>"$work/dec.err"
drc=$?
wait "$pre_pid"
prc=$?
pre_pid=
if [ $prc -ne 0 ] || [ $drc -ne 0 ]; then
    echo "FAIL: emulated run without a checkpoint: prefill exit $prc, decode exit $drc"
    cat "$work/pre.err" "$work/dec.err"
    exit 1
fi
grep -q '"emulated": true' "$work/pre.out" || { echo "FAIL: no emulated result: $(cat "$work/pre.out")"; exit 1; }
echo "ok: both sides finished, no checkpoint anywhere"

echo "== 2. a decode side without its checkpoint stops the prefill side at once, with the reason"
start_prefill --mode full
t0=$(date +%s%N)
SMARTGEN_MODEL=/nonexistent/stories260K.bin SMARTGEN_MODEL_DIR=/nonexistent SMARTGEN_REQUIRE_DATA=0 \
    "$bin" --role decode --peer "127.0.0.1:$port" --timeout 60 --quiet >"$work/dec.out" 2>"$work/dec.err"
drc=$?
wait "$pre_pid"
prc=$?
pre_pid=
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
cat "$work/dec.err"
cat "$work/pre.err"
[ $drc -eq 77 ] || { echo "FAIL: the decode side exited $drc, expected 77 (model missing)"; exit 1; }
[ $prc -ne 0 ] || { echo "FAIL: the prefill side exited 0"; exit 1; }
grep -q "model file not found" "$work/pre.err" ||
    { echo "FAIL: the prefill side's error does not carry the decode side's reason"; exit 1; }
[ "$ms" -lt 15000 ] || { echo "FAIL: the prefill side took $ms ms to stop (its timeout is 60 s)"; exit 1; }
echo "ok: the prefill side stopped $ms ms after the decode side started, naming its reason"
