#!/usr/bin/env bash
# A prefill and a decode process in two network namespaces joined by a veth pair
# (198.51.100.0/24, made here and removed on exit). Once layer 0 is across, the link is taken down
# with `ip link set down`; both survivors must report SG_ERR_PEER_LOST within 3 s (within the
# runtime's cap of four peer timeouts under a sanitizer: link_peer.c).
# Exit 77 (ctest: skipped) when namespaces cannot be made here (netns_pair.sh).
set -euo pipefail
peer_bin=$1
. "$(dirname "$0")/netns_pair.sh"
netns_pair_up sg

port=$((40000 + $$ % 20000))
mkfifo "$tmp/in_dec" "$tmp/in_pre"
ip netns exec "$b" "$peer_bin" decode 198.51.100.2 "$port" <"$tmp/in_dec" >"$tmp/dec.out" 2>&1 &
pids+=($!)
exec 3>"$tmp/in_dec"
# The prefill side connects once the decode side listens (a fixed 0.3 s was too short under
# ThreadSanitizer: "connection refused").
netns_wait_listener "$b" "$port" || true
ip netns exec "$a" "$peer_bin" prefill 198.51.100.1 198.51.100.2 "$port" <"$tmp/in_pre" >"$tmp/pre.out" 2>&1 &
pids+=($!)
exec 4>"$tmp/in_pre"

for _ in $(seq 100); do
  if grep -q READY "$tmp/dec.out" && grep -q READY "$tmp/pre.out"; then break; fi
  sleep 0.1
done
if ! grep -q READY "$tmp/dec.out" || ! grep -q READY "$tmp/pre.out"; then
  echo "FAIL: layer 0 did not get across"; cat "$tmp/dec.out" "$tmp/pre.out"; echo "0 passed, 1 failed"; exit 1
fi
ip -n "$a" link set "$va" down
echo down >&3
echo down >&4
fail=0
wait "${pids[0]}" || fail=$((fail + 1))
wait "${pids[1]}" || fail=$((fail + 1))
pids=()
grep -v READY "$tmp/dec.out" "$tmp/pre.out" | sed 's/^.*\.out://'
echo "$((2 - fail)) passed, $fail failed"
[ "$fail" = 0 ]
