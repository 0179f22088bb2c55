# Sourced by matrix.sh and bench.sh: runs one pair of interop programs (docs/bindings.md, "The
# interop program") on 127.0.0.1 over tcp;ofi_rxm, the decode side listening, and checks what each
# side printed. Needs bash, coreutils (timeout, od) and /proc/net/tcp.
# shellcheck shell=bash
# shellcheck disable=SC2034  # the PAIR_* and INTEROP_* globals are read by the scripts that source it

INTEROP_LANGS=(c go java rust python)

# Arguments given to both sides, and to the decode side only (set by the caller).
PAIR_ARGS=()
PAIR_DECODE_ARGS=()

# A fresh random key (64 hex characters), readable by this user only, for both sides of every pair.
interop_make_key() {
  local dir=$1
  (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$dir/key") || return 1
  export SG_AUTH_KEY_FILE="$dir/key"
}

# Lines of /proc/net/tcp{,6} whose local port is $1 (in any state, or in state $2: 0A = LISTEN).
interop_port_lines() {
  local hex state=${2:-}
  hex=$(printf '%04X' "$1")
  cat /proc/net/tcp /proc/net/tcp6 2>/dev/null |
    awk -v port=":$hex" -v state="$state" 'substr($2, length($2) - 4) == port && (state == "" || $4 == state)'
}

# A port nothing on this host uses now, below the kernel's ephemeral range (32768-60999) so that
# outgoing connections do not take it meanwhile. Someone may still bind it before the decode side
# does: interop_run_pair then tries another.
interop_free_port() {
  local port
  for _ in $(seq 1 200); do
    port=$((20000 + RANDOM % 12000))
    if [ -z "$(interop_port_lines "$port")" ]; then
      echo "$port"
      return 0
    fi
  done
  echo "no free port found in 20000-31999" >&2
  return 1
}

# True while process $1 runs (a zombie, exited but not yet waited for, does not count).
interop_alive() {
  local state
  state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [ -n "$state" ] && [ "$state" != Z ]
}

interop_now() { date +%s.%N; }

# interop_run_pair PREFILL_LAUNCHER DECODE_LAUNCHER DIR LIMIT_S
# The decode side listens on a free port; the prefill side starts once the port is in LISTEN state
# (a program need not retry a refused connect). Each side runs under `timeout LIMIT_S`. Sets
# PAIR_PREFILL_RC and PAIR_DECODE_RC (empty: that side never ran), PAIR_LISTENED (0 when the decode
# side never listened, so the prefill side did not run) and PAIR_SECONDS; the outputs are
# DIR/{prefill,decode}.{out,err}.
interop_run_pair() {
  local prefill=$1 decode=$2 dir=$3 limit=$4
  local attempt port dpid start deadline
  PAIR_PREFILL_RC=
  PAIR_DECODE_RC=
  PAIR_SECONDS=0
  PAIR_LISTENED=0
  : >"$dir/prefill.out"
  : >"$dir/prefill.err"
  for attempt in 1 2 3; do
    port=$(interop_free_port) || return 1
    start=$(interop_now)
    deadline=$(awk -v s="$start" -v l="$limit" 'BEGIN { printf "%d", s + l }')
    timeout -k 5 "$limit" "$decode" --role decode --listen "127.0.0.1:$port" "${PAIR_ARGS[@]}" \
      "${PAIR_DECODE_ARGS[@]}" >"$dir/decode.out" 2>"$dir/decode.err" &
    dpid=$!
    INTEROP_CHILDREN="$dpid"
    while interop_alive "$dpid" && [ "$(date +%s)" -lt "$deadline" ]; do
      if [ -n "$(interop_port_lines "$port" 0A)" ]; then
        PAIR_LISTENED=1
        break
      fi
      sleep 0.05
    done
    if [ "$PAIR_LISTENED" = 0 ]; then
      kill "$dpid" 2>/dev/null
      wait "$dpid"
      PAIR_DECODE_RC=$?
      INTEROP_CHILDREN=
      # Someone took the port between the pick and the bind: the listener reports SG_ERR_CONNECT.
      if [ "$attempt" -lt 3 ] && grep -q 'SG_ERR_CONNECT' "$dir/decode.out"; then
        echo "port $port was taken before the decode side bound it; trying another" >>"$dir/decode.err"
        continue
      fi
      PAIR_SECONDS=$(awk -v s="$start" -v e="$(interop_now)" 'BEGIN { printf "%.1f", e - s }')
      return 0
    fi
    timeout -k 5 "$limit" "$prefill" --role prefill --peer "127.0.0.1:$port" "${PAIR_ARGS[@]}" \
      >"$dir/prefill.out" 2>"$dir/prefill.err"
    PAIR_PREFILL_RC=$?
    wait "$dpid"
    PAIR_DECODE_RC=$?
    INTEROP_CHILDREN=
    PAIR_SECONDS=$(awk -v s="$start" -v e="$(interop_now)" 'BEGIN { printf "%.1f", e - s }')
    return 0
  done
}

# Kills a decode side still running when the caller is interrupted.
interop_kill_children() {
  if [ -n "${INTEROP_CHILDREN:-}" ]; then
    kill "$INTEROP_CHILDREN" 2>/dev/null
    wait "$INTEROP_CHILDREN" 2>/dev/null
  fi
}

# interop_check_side ROLE LANG RC OUT_FILE: prints nothing when the side succeeded as the spec
# says, else a short reason. The decode side must also say full=ok and selective=ok (selective=
# skipped when PAIR_ARGS holds --no-selective).
interop_check_side() {
  local role=$1 lang=$2 rc=$3 out=$4 lines line want_sel=ok a
  for a in "${PAIR_ARGS[@]}"; do [ "$a" = --no-selective ] && want_sel=skipped; done
  if [ -z "$rc" ]; then
    echo "$role never started"
    return
  fi
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "$role timed out"
    return
  fi
  lines=$(wc -l <"$out")
  line=$(tail -n 1 "$out")
  case "$line" in
    *" result=FAILED reason=\""*)
      a=${line#* result=FAILED reason=\"}
      echo "$role: ${a%%[: \"]*}"
      return
      ;;
  esac
  if [ "$rc" != 0 ]; then
    echo "$role exit $rc"
  elif [ "$lines" != 1 ]; then
    echo "$role printed $lines stdout lines"
  elif [[ "$line" != "interop lang=$lang role=$role result=ok "* ]]; then
    echo "$role: unexpected result line"
  elif [[ " $line " != *" full=ok "* ]]; then
    echo "$role: full not ok"
  elif [ "$role" = decode ] && [[ " $line " != *" selective=$want_sel "* ]]; then
    echo "$role: selective not $want_sel"
  fi
}

# interop_pair_verdict PREFILL_LANG DECODE_LANG DIR: after interop_run_pair, prints nothing when
# both sides succeeded, else a short reason (the decode side's first: it checks the bytes).
interop_pair_verdict() {
  local why
  if [ "$PAIR_LISTENED" = 0 ] && ! grep -q ' result=FAILED ' "$3/decode.out"; then
    echo "decode never listened"
    return
  fi
  why=$(interop_check_side decode "$2" "$PAIR_DECODE_RC" "$3/decode.out")
  [ -z "$why" ] && why=$(interop_check_side prefill "$1" "$PAIR_PREFILL_RC" "$3/prefill.out")
  echo "$why"
}

# interop_print_logs DIR: both sides' stdout and the last 40 lines of their stderr.
interop_print_logs() {
  local side
  for side in decode prefill; do
    echo "--- $side stdout:"
    cat "$1/$side.out"
    echo "--- $side stderr (last 40 lines):"
    tail -n 40 "$1/$side.err"
  done
}

# interop_field LINE_FILE NAME: the value of NAME=... in the result line.
interop_field() {
  tail -n 1 "$1" | tr ' ' '\n' | sed -n "s/^$2=//p"
}
