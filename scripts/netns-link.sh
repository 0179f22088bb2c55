#!/usr/bin/env bash
# A shaped network link on one host, for running SmartGen's prefill and decode sides as if on two:
# two network namespaces, sg-prefill (198.51.100.1/24, veth sg-pf) and sg-decode (198.51.100.2/24,
# veth sg-dc), joined by a veth pair whose two ends are each shaped by a token-bucket filter (tbf), so
# both directions carry at most the nominal rate. MTU: the veth default (1500). Needs root.
#
# Usage:
#   scripts/netns-link.sh up [--rate 10gbit] [--latency-ms 1] [--burst BYTES]
#                                      makes the link (replacing one that is already up)
#   scripts/netns-link.sh down         removes both namespaces and the veth pair
#   scripts/netns-link.sh run prefill|decode -- CMD [ARGS...]
#                                      runs CMD in sg-prefill or sg-decode (exit status: CMD's)
#   scripts/netns-link.sh status       addresses, rate, and each end's qdisc counters (tc -s)
#
# --rate: tc's rate syntax in bits per second (kbit, mbit, gbit, tbit), default 10gbit.
# --latency-ms: tbf's "latency", the longest a packet may wait in the shaper's queue before it is
#   dropped (it sizes the queue: rate x latency + burst). It is NOT a propagation delay: that needs
#   netem, which this kernel lacks, so the link adds no delay of its own. Default 1 ms.
# --burst: the bucket size in bytes. Default: what the rate sends in 4 ms (10gbit: 5,000,000 bytes),
#   at least 256 KiB. tbf refills the bucket from kernel timers, and the rule of thumb is a bucket of
#   at least rate/HZ (4 ms at HZ=250); veth also hands tbf GSO packets of up to 64 KiB, which
#   a bucket must hold whole. A smaller bucket caps the link below its nominal rate (at 10gbit, one
#   iperf3 stream here: 64 KiB carried 5.2 Gbit/s, 256 KiB 8.8, 1 MB 9.5, 5 MB 9.6); a larger one
#   lets that much leave at memory speed before the rate applies.
set -euo pipefail

NS_PREFILL=sg-prefill NS_DECODE=sg-decode
DEV_PREFILL=sg-pf DEV_DECODE=sg-dc
ADDR_PREFILL=198.51.100.1 ADDR_DECODE=198.51.100.2 PREFIX=24

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "netns-link.sh: $*" >&2; exit 1; }

need_root() {
  [[ $(id -u) -eq 0 ]] || die "needs root (network namespaces and tc)"
  if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    die "needs iproute2 (ip, tc): apt-get install iproute2"
  fi
}

ns_exists() { ip netns list | awk -v n="$1" '$1 == n { f = 1 } END { exit !f }'; }
is_up() { ns_exists "$NS_PREFILL" && ns_exists "$NS_DECODE"; }

# rate_bits RATE: bits per second of a tc rate such as 10gbit, 2.5gbit, 800mbit.
rate_bits() {
  local r=${1,,}
  [[ $r =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit|tbit)$ ]] ||
    die "--rate '$1': give bits per second with a unit: bit, kbit, mbit, gbit or tbit (e.g. 10gbit)"
  awk -v n="${BASH_REMATCH[1]}" -v u="${BASH_REMATCH[3]}" 'BEGIN {
    m["bit"] = 1; m["kbit"] = 1e3; m["mbit"] = 1e6; m["gbit"] = 1e9; m["tbit"] = 1e12
    printf "%.0f\n", n * m[u] }'
}

cmd_down() {
  need_root
  local ns
  for ns in "$NS_PREFILL" "$NS_DECODE"; do
    if ns_exists "$ns"; then ip netns del "$ns"; fi  # deleting a namespace deletes its veth end, so the pair
  done
  if ip link show "$DEV_PREFILL" >/dev/null 2>&1; then ip link del "$DEV_PREFILL"; fi
}

cmd_up() {
  local rate=10gbit latency_ms=1 burst=""
  while [[ $# -gt 0 ]]; do
    case $1 in
      --rate) [[ $# -ge 2 ]] || die "--rate needs a value"; rate=$2; shift 2 ;;
      --latency-ms) [[ $# -ge 2 ]] || die "--latency-ms needs a value"; latency_ms=$2; shift 2 ;;
      --burst) [[ $# -ge 2 ]] || die "--burst needs a value"; burst=$2; shift 2 ;;
      *) die "up: unknown argument '$1' (see --help)" ;;
    esac
  done
  need_root
  local bits
  bits=$(rate_bits "$rate")
  [[ $latency_ms =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--latency-ms '$latency_ms': give milliseconds"
  if [[ -z $burst ]]; then
    burst=$(awk -v b="$bits" 'BEGIN { x = b / 8 * 0.004; if (x < 262144) x = 262144; printf "%.0f\n", x }')
  fi
  [[ $burst =~ ^[0-9]+$ ]] || die "--burst '$burst': give bytes"

  cmd_down
  trap 'cmd_down' ERR
  ip netns add "$NS_PREFILL"
  ip netns add "$NS_DECODE"
  ip link add "$DEV_PREFILL" type veth peer name "$DEV_DECODE"
  ip link set "$DEV_PREFILL" netns "$NS_PREFILL"
  ip link set "$DEV_DECODE" netns "$NS_DECODE"
  ip -n "$NS_PREFILL" addr add "$ADDR_PREFILL/$PREFIX" dev "$DEV_PREFILL"
  ip -n "$NS_DECODE" addr add "$ADDR_DECODE/$PREFIX" dev "$DEV_DECODE"
  local ns dev
  for ns in "$NS_PREFILL" "$NS_DECODE"; do ip -n "$ns" link set lo up; done
  ip -n "$NS_PREFILL" link set "$DEV_PREFILL" up
  ip -n "$NS_DECODE" link set "$DEV_DECODE" up
  # Each end shapes what it sends: together, both directions.
  for pair in "$NS_PREFILL:$DEV_PREFILL" "$NS_DECODE:$DEV_DECODE"; do
    ns=${pair%%:*} dev=${pair#*:}
    tc -n "$ns" qdisc add dev "$dev" root tbf rate "$bits" burst "$burst" latency "${latency_ms}ms"
  done
  trap - ERR
  echo "netns-link.sh: up: $NS_PREFILL ($ADDR_PREFILL) <-> $NS_DECODE ($ADDR_DECODE), tbf rate $rate" \
    "($bits bit/s) burst $burst bytes latency ${latency_ms} ms, each direction"
}

cmd_run() {
  [[ $# -ge 1 ]] || die "run: which side? run prefill|decode -- CMD..."
  local side=$1 ns
  shift
  case $side in
    prefill) ns=$NS_PREFILL ;;
    decode) ns=$NS_DECODE ;;
    *) die "run: '$side': give prefill or decode" ;;
  esac
  [[ ${1:-} == -- ]] && shift
  [[ $# -ge 1 ]] || die "run $side: no command (run $side -- CMD...)"
  need_root
  is_up || die "the link is not up (scripts/netns-link.sh up)"
  exec ip netns exec "$ns" "$@"
}

cmd_status() {
  need_root
  if ! is_up; then
    echo "netns-link.sh: down (no $NS_PREFILL / $NS_DECODE namespaces)"
    return 0
  fi
  local pair ns dev
  for pair in "$NS_PREFILL:$DEV_PREFILL" "$NS_DECODE:$DEV_DECODE"; do
    ns=${pair%%:*} dev=${pair#*:}
    echo "== $ns: $(ip -n "$ns" -br addr show dev "$dev")"
    tc -n "$ns" -s qdisc show dev "$dev"
  done
}

case ${1:-} in
  up) shift; cmd_up "$@" ;;
  down) shift; [[ $# -eq 0 ]] || die "down takes no arguments"; cmd_down ;;
  run) shift; cmd_run "$@" ;;
  status) shift; cmd_status ;;
  -h|--help) usage ;;
  "") usage >&2; exit 2 ;;
  *) echo "netns-link.sh: unknown command '$1'" >&2; usage >&2; exit 2 ;;
esac
