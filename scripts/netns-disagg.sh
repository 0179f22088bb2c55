#!/usr/bin/env bash
# smartgen-disagg across a shaped link (scripts/netns-link.sh): the prefill side runs in namespace
# sg-prefill and listens on 198.51.100.1, the decode side runs in sg-decode (198.51.100.2) and connects
# to it, so every byte of the KV cache crosses the veth pair and its tbf shapers. Before that, iperf3
# measures the plain TCP rate the link carries in the same direction (prefill -> decode, one stream),
# so SmartGen's figures can be read against what the link actually gives, not only its nominal rate.
#
# Usage:
#   scripts/netns-disagg.sh [OPTIONS] [--] [SMARTGEN-DISAGG ARGS...]
#     e.g. scripts/netns-disagg.sh --rate 10gbit -- --mode full --emulate llama3-8b --emulate-tokens 8192 --json
#
#   SMARTGEN-DISAGG ARGS go to the prefill side (default: --mode full); of them, --provider, --timeout,
#   --model and --quiet also go to the decode side, which takes everything else from the prefill side.
#   OPTIONS:
#     --rate R, --latency-ms L   (re)make the link with these (netns-link.sh up); without them an
#                                existing link is used as it is, and a missing one is made with
#                                netns-link.sh's defaults (10gbit, 1 ms)
#     --keep-link                leave a link this script made up at the end (default: take it down)
#     --port P                   SmartGen's bootstrap port on 198.51.100.1 (default 47000)
#     --iperf-seconds S          length of the iperf3 measurement (default 3); 0: no measurement
#
# Output: the prefill side's output on stdout. With --json it is the same JSON object with a "link"
# member added: nominal_bps (the tbf rate), tcp_bps and tcp_retransmits (iperf3, received rate),
# tbf burst and latency, and the prefill end's qdisc counters during the SmartGen run (bytes, packets,
# drops, overlimits). Without --json the same figures follow as text. Progress goes to stderr.
# The two sides share a fresh random key (64 hex characters, a file of mode 0600 that SG_AUTH_KEY_FILE
# names, removed at exit). Needs root; installs iperf3 and jq with apt-get when they are missing.
#
# Environment: SMARTGEN_DISAGG (the binary; default build/release/examples/disagg/smartgen-disagg,
# built with the release preset when it is missing).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
LINK=scripts/netns-link.sh
ADDR_PREFILL=198.51.100.1 ADDR_DECODE=198.51.100.2
IPERF_PORT=5201

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "netns-disagg.sh: $*" >&2; exit 1; }
say() { echo "netns-disagg.sh: $*" >&2; }

link_args=() keep_link=0 port=47000 iperf_s=3
while [[ $# -gt 0 ]]; do
  case $1 in
    --rate|--latency-ms) [[ $# -ge 2 ]] || die "$1 needs a value"; link_args+=("$1" "$2"); shift 2 ;;
    --keep-link) keep_link=1; shift ;;
    --port) [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || die "--port needs a number"; port=$2; shift 2 ;;
    --iperf-seconds) [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || die "--iperf-seconds needs whole seconds"
                     iperf_s=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
disagg_args=("$@")
[[ ${#disagg_args[@]} -gt 0 ]] || disagg_args=(--mode full)
json=0 decode_args=()
for ((i = 0; i < ${#disagg_args[@]}; i++)); do
  a=${disagg_args[$i]}
  case $a in
    --json) json=1 ;;
    --quiet) decode_args+=("$a") ;;
    --provider|--timeout|--model) decode_args+=("$a" "${disagg_args[$((i + 1))]:-}"); i=$((i + 1)) ;;
    --role|--listen|--peer|--local-addr) die "$a: this script sets it" ;;
  esac
done

[[ $(id -u) -eq 0 ]] || die "needs root (network namespaces)"

# Tools: jq (the results) and iperf3 (the plain TCP rate), from Debian when missing.
missing=()
command -v jq >/dev/null || missing+=(jq)
[[ $iperf_s -eq 0 ]] || command -v iperf3 >/dev/null || missing+=(iperf3)
if [[ ${#missing[@]} -gt 0 ]]; then
  say "installing ${missing[*]} (apt-get)"
  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"; } \
    >/dev/null || die "apt-get could not install ${missing[*]}"
fi

BIN=${SMARTGEN_DISAGG:-build/release/examples/disagg/smartgen-disagg}
if [[ ! -x $BIN ]]; then
  say "building smartgen-disagg (release preset)"
  bash scripts/setup-deps.sh >/dev/null
  log=$(mktemp)
  if ! { cmake --preset release && cmake --build --preset release --target smartgen-disagg; } >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    die "building smartgen-disagg failed"
  fi
  rm -f "$log"
fi
BIN=$(realpath "$BIN")

work=$(mktemp -d)
chmod 700 "$work"
made_link=0 pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
  if [[ $made_link -eq 1 && $keep_link -eq 0 ]]; then bash "$LINK" down || true; fi
}
trap cleanup EXIT

if [[ ${#link_args[@]} -gt 0 ]] || ! ip netns list | awk '$1 == "sg-prefill" { f = 1 } END { exit !f }'; then
  bash "$LINK" up "${link_args[@]}" >&2
  made_link=1
fi

# The tbf the prefill end sends through: rate, burst, latency.
qdisc=$(tc -n sg-prefill qdisc show dev sg-pf)
[[ $qdisc == *" tbf "* || $qdisc == "qdisc tbf "* ]] || die "no tbf on sg-pf in sg-prefill: $qdisc"
tc_field() { awk -v k="$1" '{ for (i = 1; i < NF; i++) if ($i == k) { print $(i + 1); exit } }' <<<"$qdisc"; }
# to_number 10Gbit -> 10000000000, 4998750b -> 4998750, 1ms -> 1 (ms).
to_number() {
  awk -v s="$1" 'BEGIN {
    n = s + 0; u = substr(s, length(n "") + 1); m = 1
    if (u ~ /^Kbit|^K/) m = 1e3; else if (u ~ /^Mbit|^M/) m = 1e6; else if (u ~ /^Gbit|^G/) m = 1e9
    else if (u ~ /^Tbit|^T/) m = 1e12; else if (u == "us") m = 1e-3; else if (u == "s") m = 1e3
    printf "%.6g\n", n * m }'
}
nominal_bps=$(printf '%.0f' "$(to_number "$(tc_field rate)")")
burst_bytes=$(printf '%.0f' "$(to_number "$(tc_field burst)")")
latency_ms=$(to_number "$(tc_field lat)")

# qdisc_counters: bytes packets dropped overlimits of the prefill end's tbf.
qdisc_counters() {
  tc -n sg-prefill -s qdisc show dev sg-pf | awk '/Sent/ {
    gsub(/[(),]/, " "); for (i = 1; i < NF; i++) {
      if ($i == "Sent") b = $(i + 1); if ($i == "bytes") p = $(i + 1)
      if ($i == "dropped") d = $(i + 1); if ($i == "overlimits") o = $(i + 1) }
    print b, p, d, o; exit }'
}

# wait_listen NS PORT PID: until something listens on PORT in NS (PID must stay alive), 60 s at most.
wait_listen() {
  local ns=$1 p=$2 pid=$3 i
  for ((i = 0; i < 600; i++)); do
    [[ -n $(ip netns exec "$ns" ss -Hltn "sport = :$p") ]] && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

tcp_bps=null tcp_retrans=null
if [[ $iperf_s -gt 0 ]]; then
  say "measuring plain TCP, prefill -> decode, one stream, $iperf_s s (iperf3)"
  ip netns exec sg-decode iperf3 -s -1 -B "$ADDR_DECODE" -p "$IPERF_PORT" >"$work/iperf-server.out" 2>&1 &
  iperf_pid=$!
  pids+=("$iperf_pid")
  wait_listen sg-decode "$IPERF_PORT" "$iperf_pid" || { cat "$work/iperf-server.out" >&2; die "iperf3 -s did not start"; }
  if ! ip netns exec sg-prefill iperf3 -c "$ADDR_DECODE" -p "$IPERF_PORT" -t "$iperf_s" -J >"$work/iperf.json" \
      2>"$work/iperf.err"; then
    cat "$work/iperf.err" "$work/iperf.json" >&2
    die "iperf3 failed"
  fi
  wait "$iperf_pid" || true  # -1: the server exits after one test
  pids=()
  tcp_bps=$(jq -e '.end.sum_received.bits_per_second' "$work/iperf.json") || die "iperf3 gave no received rate"
  tcp_retrans=$(jq -e '.end.sum_sent.retransmits // 0' "$work/iperf.json")
fi

# A fresh key both sides hold: 32 random bytes as 64 hex characters (no newline for the library to trim).
key=$work/session.key
(umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$key")
chmod 600 "$key"

read -r b0 p0 d0 o0 < <(qdisc_counters)
say "SmartGen: prefill in sg-prefill ($ADDR_PREFILL:$port), decode in sg-decode ($ADDR_DECODE): ${disagg_args[*]}"
SG_AUTH_KEY_FILE=$key ip netns exec sg-prefill "$BIN" --role prefill --listen "$ADDR_PREFILL:$port" \
  "${disagg_args[@]}" >"$work/prefill.out" 2>"$work/prefill.err" &
prefill_pid=$!
pids+=("$prefill_pid")
if ! wait_listen sg-prefill "$port" "$prefill_pid"; then
  rc=0
  wait "$prefill_pid" || rc=$?
  cat "$work/prefill.err" >&2
  die "the prefill side did not listen on $ADDR_PREFILL:$port (exit $rc)"
fi
SG_AUTH_KEY_FILE=$key ip netns exec sg-decode "$BIN" --role decode --peer "$ADDR_PREFILL:$port" \
  --local-addr "$ADDR_DECODE" "${decode_args[@]}" >"$work/decode.out" 2>"$work/decode.err" &
decode_pid=$!
pids+=("$decode_pid")
prc=0 drc=0
# A decode side that fails before it connects cannot tell the prefill side (one that fails later sends
# FAIL with its reason): stop the prefill side at once instead of letting it wait out its timeout.
while kill -0 "$prefill_pid" 2>/dev/null; do
  if ! kill -0 "$decode_pid" 2>/dev/null; then
    wait "$decode_pid" || drc=$?
    decode_pid=
    if [[ $drc -ne 0 ]]; then
      sleep 1  # a FAIL just sent is read and reported by the prefill side itself
      kill "$prefill_pid" 2>/dev/null || true
    fi
    break
  fi
  sleep 0.1
done
wait "$prefill_pid" || prc=$?
[[ -n $decode_pid ]] && { wait "$decode_pid" || drc=$?; }
pids=()
read -r b1 p1 d1 o1 < <(qdisc_counters)
if [[ $prc -ne 0 || $drc -ne 0 ]]; then
  echo "---- prefill (exit $prc) stderr ----" >&2
  cat "$work/prefill.err" >&2
  echo "---- decode (exit $drc) stderr ----" >&2
  cat "$work/decode.err" "$work/decode.out" >&2
  die "smartgen-disagg failed (prefill exit $prc, decode exit $drc)"
fi
# Progress (without --quiet) is worth keeping.
cat "$work/prefill.err" >&2

link=$(jq -n --argjson nominal "$nominal_bps" --argjson tcp "$tcp_bps" --argjson rt "$tcp_retrans" \
  --argjson burst "$burst_bytes" --argjson lat "$latency_ms" --argjson secs "$iperf_s" \
  --argjson b "$((b1 - b0))" --argjson p "$((p1 - p0))" --argjson d "$((d1 - d0))" --argjson o "$((o1 - o0))" \
  '{nominal_bps: $nominal, tcp_bps: $tcp, tcp_retransmits: $rt, tcp_measure: (if $secs > 0 then "iperf3, prefill -> decode, 1 stream, \($secs) s" else null end),
    tbf_burst_bytes: $burst, tbf_latency_ms: $lat,
    qdisc_prefill_end: {sent_bytes: $b, sent_packets: $p, dropped: $d, overlimits: $o}}')
gbit() { awk -v b="$1" 'BEGIN { printf "%.2f Gbit/s", b / 1e9 }'; }
if [[ $json -eq 1 ]]; then
  jq -c --argjson link "$link" '. + {link: $link}' "$work/prefill.out" ||
    { cat "$work/prefill.out"; die "the prefill side's --json output did not parse"; }
else
  cat "$work/prefill.out"
  echo "link: nominal $(gbit "$nominal_bps") each way (tbf burst $burst_bytes bytes, latency $latency_ms ms)"
  if [[ $tcp_bps != null ]]; then
    echo "link: plain TCP measured $(gbit "$tcp_bps") (iperf3, prefill -> decode, 1 stream, $iperf_s s," \
      "$tcp_retrans retransmits)"
  fi
  echo "link: during the SmartGen run the prefill end sent $((b1 - b0)) bytes in $((p1 - p0)) packets," \
    "$((d1 - d0)) dropped, $((o1 - o0)) overlimits"
fi
