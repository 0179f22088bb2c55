# Sourced by the network-namespace tests: two namespaces $a and $b joined by a veth pair $va/$vb,
# 198.51.100.1 in $a and .2 in $b, loopback up in both, a scratch folder $tmp, and a trap that
# kills $pids and removes it all on exit. Exits 77 (ctest: skipped) when namespaces cannot be made
# here (not root, no iproute2).
#   netns_pair_up PREFIX
netns_pair_up() {
  local p=$1 id=$$
  a=${p}A$id b=${p}B$id va=${p}a$id vb=${p}b$id
  if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null || ! ip netns add "$a" 2>/dev/null; then
    echo "SKIP: needs root, iproute2 and tc to create network namespaces"
    exit 77
  fi
  pids=()
  tmp=$(mktemp -d)
  trap netns_pair_down EXIT
  ip netns add "$b"
  ip link add "$va" type veth peer name "$vb"
  ip link set "$va" netns "$a"
  ip link set "$vb" netns "$b"
  ip -n "$a" addr add 198.51.100.1/24 dev "$va"
  ip -n "$b" addr add 198.51.100.2/24 dev "$vb"
  for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
  ip -n "$a" link set "$va" up
  ip -n "$b" link set "$vb" up
}

netns_pair_down() {
  exec 3>&- 4>&- 2>/dev/null || true
  kill "${pids[@]}" 2>/dev/null || true
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
  rm -rf "$tmp"
}

# Waits up to 10 s for a listener on PORT in namespace NS.
netns_wait_listener() {
  for _ in $(seq 100); do
    ip netns exec "$1" ss -ltnH "sport = :$2" 2>/dev/null | grep -q . && return 0
    sleep 0.1
  done
  return 1
}
