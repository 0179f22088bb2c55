#!/usr/bin/env bash
# Nothing stale lands: a prefill and a decode process (fence_peer) in two network namespaces joined
# by a veth pair shaped to 400 Mbit/s (198.51.100.0/24, made here, removed on exit) move 128 MiB.
# Once layer 0 is across, the link drops every packet for 4 s (`tc qdisc replace ... pfifo limit
# 0`; this kernel has no netem), then heals. One side has a 2 s peer timeout and loses the session;
# the other has 12 s and keeps going through the outage.
#   netns_fence.sh FENCE_PEER LOST_SIDE LANES MODE RUNS
# LOST_SIDE decode: the decode side loses the session, releases (MODE destroy: and destroys the
#   session and deregisters the pool), fills its blocks with a pattern; nothing may change them for
#   SG_FENCE_WATCH_S (10) seconds after the link heals.
# LOST_SIDE prefill: the prefill side loses it, releases and fills its source blocks with a
#   pattern; the pattern must never reach the decode blocks.
# Exit 77 (ctest: skipped) when namespaces cannot be made here (netns_pair.sh).
set -euo pipefail
peer_bin=$1 lost_side=${2:-decode} lanes=${3:-1} mode=${4:-release} runs=${5:-1}
. "$(dirname "$0")/netns_pair.sh"
netns_pair_up sgf
shape() { # shape | drop
  for pair in "$a $va" "$b $vb"; do
    set -- $pair
    if [ "$shape_to" = drop ]; then
      ip netns exec "$1" tc qdisc replace dev "$2" root pfifo limit 0
    else
      ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate 400mbit burst 256kb latency 50ms
    fi
  done
}

# The long side outlives the 4 s outage (its timeout stretches to 3x the gaps it has seen, up to 4x).
if [ "$lost_side" = decode ]; then dec_timeout=2000 pre_timeout=12000; else dec_timeout=12000 pre_timeout=2000; fi
passed=0 failed=0
for run in $(seq "$runs"); do
  shape_to=rate shape
  port=$((40000 + ($$ + run) % 20000))
  rm -f "$tmp"/*
  mkfifo "$tmp/in_dec" "$tmp/in_pre"
  ip netns exec "$b" "$peer_bin" decode 198.51.100.2 "$port" "$dec_timeout" "$lanes" "$mode" <"$tmp/in_dec" >"$tmp/dec.out" 2>&1 &
  pids=($!)
  exec 3>"$tmp/in_dec"
  netns_wait_listener "$b" "$port" || true
  ip netns exec "$a" "$peer_bin" prefill 198.51.100.1 198.51.100.2 "$port" "$pre_timeout" "$lanes" <"$tmp/in_pre" >"$tmp/pre.out" 2>&1 &
  pids+=($!)
  exec 4>"$tmp/in_pre"
  for _ in $(seq 300); do
    if grep -q READY "$tmp/dec.out" && grep -q READY "$tmp/pre.out"; then break; fi
    sleep 0.1
  done
  verdict=ok
  if ! grep -q READY "$tmp/dec.out" || ! grep -q READY "$tmp/pre.out"; then
    verdict="layer 0 did not get across"
  else
    shape_to=drop shape
    down=$(date +%s.%N)
    echo down >&3
    echo down >&4
    out=$tmp/dec.out
    [ "$lost_side" = prefill ] && out=$tmp/pre.out
    for _ in $(seq 300); do grep -q RELEASED "$out" && break; sleep 0.05; done
    grep -q RELEASED "$out" || verdict="the $lost_side side never released"
    # The outage lasts 4 s from the drop, however soon the release came.
    rest=$(awk -v d="$down" -v n="$(date +%s.%N)" 'BEGIN { r = 4 - (n - d); print (r > 0 ? r : 0) }')
    sleep "$rest"
    shape_to=rate shape
    echo healed >&3 || true
    echo healed >&4 || true
  fi
  exec 3>&- 4>&-
  wait "${pids[0]}" || { [ "$verdict" = ok ] && verdict="decode side failed"; }
  wait "${pids[1]}" || { [ "$verdict" = ok ] && verdict="prefill side failed"; }
  pids=()
  echo "run $run ($lost_side side lost, $lanes lane(s), $mode): $verdict"
  grep -v -e READY -e RELEASED "$tmp/dec.out" "$tmp/pre.out" | sed 's/^.*\///; s/^/  /'
  if [ "$verdict" = ok ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
done
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
