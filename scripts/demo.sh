#!/usr/bin/env bash
# SmartGen demo for a fresh Debian 12, from a clone with nothing beside it. Installs what it needs
# (scripts/setup-deps.sh --for demo: the build's packages, jq, iproute2; apt-get, root or sudo), builds
# smartgen-disagg with the demo preset (release, no tests or bindings; quietly: the build log is shown
# only when the build fails), runs
# smartgen-disagg (examples/disagg/README.md) in eleven configurations and prints two tables of what
# each run measured, every value parsed from that run's --json output:
#
#   stories260K (the real model, 100-token prompt, 64 new tokens; examples/models/stories260K.bin):
#     colocated                 one process, no transfer: the reference tokens
#     full, after prefill       --mode full --full-stream off: the whole KV moves once prefill is done
#     full, streamed            --mode full --full-stream on: the whole KV moves layer by layer
#     selective, spec. on       --mode selective --budget 0.125 --on-demand on --speculative on: the
#                               latency of the selective paths. Decode is sparse only until the
#                               speculative path has delivered everything, which for this small cache
#                               over shm usually happens before step 2: no sparse step, full
#                               attention's tokens (the count depends on timing: see the sparse column)
#     selective, spec. off      --mode selective --budget 0.125 --on-demand on --speculative off:
#                               sparse decoding. Every step attends to P u S_t u G within the budget
#                               (--attend budget, the default); its tokens may differ from colocated
#   llama3-8b emulated, 8192-token prompt (a real 1 GiB fp16 KV cache moves; compute is modelled):
#     full, after prefill / full, streamed / selective, spec. on / selective, spec. off (same flags)
#   the same emulated model over a 10 Gbit/s link (two network namespaces joined by a tbf-shaped veth
#   pair, scripts/netns-disagg.sh; needs root, and says so and leaves the rows out without it):
#     full, streamed / selective, spec. on
#   The two regimes: on this host's fast local path streaming the whole cache during prefill already
#   hides most of it, and the selective run's decode attends whole every layer that has arrived
#   (--seamless on), so it should cost what streaming costs; over the 10 Gbit/s link streaming cannot
#   keep up and the selective paths win.
#
# First table: TTFT, TTST, stall = TTST - TTFT, TPOT (ms); sparse decode steps of all decode steps; P,
# the proactive set's mean share of the prompt's blocks; the mean share a sparse step attended to
# (P u S_t, per layer); whether the run's tokens equal the colocated run's (real-model rows only: the
# emulated model has no tokens). Second table: bytes moved per path (full, proactive, on-demand,
# speculative), the page digests, the total (every path and the digests: sg_transfer_stats' bytes)
# and that total over the prompt's whole KV cache; KiB/MiB/GiB are powers of 1024.
#
# No row is ever made up: a run that fails (any nonzero exit, 77 included: the model file is missing,
# or the library lacks the selective paths) has its stderr printed, the rows that did succeed go to
# stderr as a partial table, and the script exits 1. The table goes to stdout only when every run
# succeeded. Takes well under 2 minutes on 2 cores once built.
#
# Usage:
#   scripts/demo.sh [--provider NAME] [--budget X] [--emulate-tokens N] [--rows LIST] [--no-build]
#       --provider NAME      libfabric provider for the transfer runs (tcp, shm; default automatic,
#                            which is shm between two processes of this host)
#       --budget X           selective budget, tokens or fraction (default 0.125)
#       --emulate-tokens N   prompt length of the emulated llama3-8b rows (default 8192)
#       --rows LIST          comma-separated subset of: colocated, full-after, full-streamed, selective,
#                            selective-sparse, emu-full-after, emu-full-streamed, emu-selective,
#                            emu-selective-sparse, link-full-streamed, link-selective (default: all;
#                            the colocated run is always made, as the token reference)
#       --no-build           skip set-up and build; run smartgen-disagg as it is in build/demo (or
#                            in $SMARTGEN_BUILD_DIR, e.g. build/release)
#   scripts/demo.sh kv [ARGS...]
#       the previous demo, smartgen-kv-demo: a Llama-3-8B-shaped KV cache moved between two processes,
#       next to a plain TCP stream (ARGS: --tokens N, --layers N, --iters N, --provider NAME,
#       --contiguous, --json, --help)
#   scripts/demo.sh --help
#
# Environment: SMARTGEN_BUILD_JOBS (parallel build jobs, default nproc); SMARTGEN_BUILD_DIR (with
# --no-build: an already built build directory instead of build/demo).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

# build TARGET: configures and builds the demo preset's TARGET; the log is printed only on failure.
build() {
  local target=$1 log t0
  t0=$(date +%s)
  echo "demo.sh: installing what the demo needs (scripts/setup-deps.sh --for demo)" >&2
  bash scripts/setup-deps.sh --for demo >/dev/null
  echo "demo.sh: building $target (cmake --preset demo; about 3 minutes on 2 cores the first time)" >&2
  log=$(mktemp)
  if ! { cmake --preset demo &&
         cmake --build --preset demo --parallel "${SMARTGEN_BUILD_JOBS:-$(nproc)}" --target "$target"; } \
      >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "demo.sh: building $target (demo preset) failed" >&2
    exit 1
  fi
  rm -f "$log"
  echo "demo.sh: set-up and build took $(( $(date +%s) - t0 )) s" >&2
}

if [[ ${1:-} == kv ]]; then
  shift
  build smartgen-kv-demo
  exec build/demo/examples/smartgen-kv-demo "$@"
fi

provider=() budget=0.125 emu_tokens=8192 do_build=1
rows=colocated,full-after,full-streamed,selective,selective-sparse,emu-full-after,emu-full-streamed,emu-selective
rows+=,emu-selective-sparse,link-full-streamed,link-selective
while [[ $# -gt 0 ]]; do
  case $1 in
    --provider) [[ $# -ge 2 ]] || { echo "demo.sh: --provider needs a value" >&2; exit 2; }
                provider=(--provider "$2"); shift 2 ;;
    --budget) [[ $# -ge 2 ]] || { echo "demo.sh: --budget needs a value" >&2; exit 2; }
              budget=$2; shift 2 ;;
    --emulate-tokens) [[ $# -ge 2 ]] || { echo "demo.sh: --emulate-tokens needs a value" >&2; exit 2; }
                      emu_tokens=$2; shift 2 ;;
    --rows) [[ $# -ge 2 ]] || { echo "demo.sh: --rows needs a value" >&2; exit 2; }
            rows=$2; shift 2 ;;
    --no-build) do_build=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "demo.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

# Every row: id, label, smartgen-disagg flags.
ROW_IDS=(colocated full-after full-streamed selective selective-sparse emu-full-after emu-full-streamed emu-selective
         emu-selective-sparse link-full-streamed link-selective)
declare -A LABEL=(
  [colocated]="stories260K colocated"
  [full-after]="stories260K full, after prefill"
  [full-streamed]="stories260K full, streamed"
  [selective]="stories260K selective $budget, spec. on"
  [selective-sparse]="stories260K selective $budget, spec. off"
  [emu-full-after]="llama3-8b/$emu_tokens full, after prefill"
  [emu-full-streamed]="llama3-8b/$emu_tokens full, streamed"
  [emu-selective]="llama3-8b/$emu_tokens selective $budget, spec. on"
  [emu-selective-sparse]="llama3-8b/$emu_tokens selective $budget, spec. off"
  [link-full-streamed]="llama3-8b/$emu_tokens full, streamed, 10 Gbit/s"
  [link-selective]="llama3-8b/$emu_tokens selective $budget, 10 Gbit/s"
)
pv=${provider[*]:+ ${provider[*]}}
emu=" --emulate llama3-8b --emulate-tokens $emu_tokens"
sel="--mode selective --budget $budget --on-demand on"
declare -A FLAGS=(
  [colocated]="--mode colocated"
  [full-after]="--mode full --full-stream off$pv"
  [full-streamed]="--mode full --full-stream on$pv"
  [selective]="$sel --speculative on$pv"
  [selective-sparse]="$sel --speculative off$pv"
  [emu-full-after]="--mode full --full-stream off$emu$pv"
  [emu-full-streamed]="--mode full --full-stream on$emu$pv"
  [emu-selective]="$sel --speculative on$emu$pv"
  [emu-selective-sparse]="$sel --speculative off$emu$pv"
  [link-full-streamed]="--mode full --full-stream on$emu"
  [link-selective]="$sel --speculative on$emu"
)
selected=(colocated)
IFS=, read -r -a wanted <<<"$rows"
for w in "${wanted[@]}"; do
  [[ -n ${LABEL[$w]+x} ]] || { echo "demo.sh: --rows: unknown row '$w' (known: ${ROW_IDS[*]})" >&2; exit 2; }
done
for id in "${ROW_IDS[@]:1}"; do
  for w in "${wanted[@]}"; do [[ $w == "$id" ]] && { selected+=("$id"); break; }; done
done
# Set-up and build first: they install iproute2, which the check of the shaped-link rows below needs
# (a fresh Debian 12 has no ip or tc).
BIN=build/demo/examples/disagg/smartgen-disagg
[[ $do_build -eq 0 && -n ${SMARTGEN_BUILD_DIR:-} ]] && BIN=$SMARTGEN_BUILD_DIR/examples/disagg/smartgen-disagg
if [[ $do_build -eq 1 ]]; then
  build smartgen-disagg
elif [[ ! -x $BIN ]]; then
  echo "demo.sh: --no-build: $BIN is not built" >&2
  exit 1
fi
# The shaped-link rows need network namespaces and tc: root, and iproute2 (setup-deps.sh installs it).
link_note=""
if [[ " ${selected[*]} " == *" link-"* ]]; then
  why=""
  if [[ $(id -u) -ne 0 ]]; then
    why="they need root (network namespaces and tc)"
  elif ! ip netns list >/dev/null 2>&1 || ! command -v tc >/dev/null; then
    why="ip netns or tc does not work here"
  fi
  if [[ -n $why ]]; then
    link_note="The 10 Gbit/s rows did not run: $why. Run scripts/demo.sh as root to see SmartGen over a shaped link."
    kept=()
    for id in "${selected[@]}"; do [[ $id == link-* ]] || kept+=("$id"); done
    selected=("${kept[@]}")
  fi
fi


work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# human BYTES: 0, 512 B, 125.0 KiB, 1.00 GiB.
human() {
  awk -v b="$1" 'BEGIN {
    if (b == 0) { print "0"; exit }
    split("B KiB MiB GiB TiB", u, " "); i = 1
    while (b >= 1024 && i < 5) { b /= 1024; i++ }
    if (i == 1) printf "%d B\n", b; else if (b >= 100) printf "%.0f %s\n", b, u[i];
    else if (b >= 10) printf "%.1f %s\n", b, u[i]; else printf "%.2f %s\n", b, u[i] }'
}

# One row of the tables from a run's JSON, tab-separated; fails when a field is missing. Colocated runs
# move nothing and print no byte fields; every other mode must report them all, and selective runs their
# sparse steps and (when a step was sparse) the attended share. "-" marks what does not apply to the
# row (printed as n/a): another mode's fields, the attended share without a sparse step, and P's share
# of a --attend resident run whose decode never formed P (no sparse step); never a missing value.
# shellcheck disable=SC2016 # jq, not shell, expands these
JQ_ROW='
  def need($k): if has($k) and .[$k] != null then .[$k] else error("field \"\($k)\" missing") end;
  def bytes($k): if .mode == "colocated" then "-" else need($k) end;
  def sel($k): if .mode == "selective" then need($k) else "-" end;
  [need("mode"), need("provider"), need("ttft_ms"), need("ttst_ms"), need("stall_ms"), need("tpot_ms"),
   bytes("bytes_full"), bytes("bytes_proactive"), bytes("bytes_on_demand"), bytes("bytes_speculative"),
   (need("tokens") | tojson), need("emulated"),
   bytes("digest_bytes"), bytes("bytes"), bytes("bytes_of_kv"),
   sel("sparse_steps"), need("new_tokens"),
   (if .mode == "selective" and .proactive_fraction != null then .proactive_fraction else "-" end),
   (if .mode == "selective" and .sparse_steps > 0 then need("attended_fraction") else "-" end),
   need("e2e_ms")] | @tsv'

ok_rows=() failed=()
start=$(date +%s)
for id in "${selected[@]}"; do
  echo "demo.sh: running ${LABEL[$id]}: smartgen-disagg ${FLAGS[$id]} --json --quiet" >&2
  rc=0
  # shellcheck disable=SC2086 # FLAGS holds words to split
  if [[ $id == link-* ]]; then
    # shellcheck disable=SC2086
    SMARTGEN_DISAGG=$BIN bash scripts/netns-disagg.sh --rate 10gbit --latency-ms 1 --iperf-seconds 0 -- \
      ${FLAGS[$id]} --json --quiet >"$work/$id.json" 2>"$work/$id.err" || rc=$?
  else
    "$BIN" ${FLAGS[$id]} --json --quiet >"$work/$id.json" 2>"$work/$id.err" || rc=$?
  fi
  if [[ $rc -eq 0 ]] && ! jq -r "$JQ_ROW" "$work/$id.json" >"$work/$id.tsv" 2>>"$work/$id.err"; then
    rc=1
    echo "demo.sh: could not read the results of this run (stdout was: $(head -c 400 "$work/$id.json"))" \
      >>"$work/$id.err"
  fi
  if [[ $rc -ne 0 ]]; then
    failed+=("$id")
    {
      echo "demo.sh: FAILED (exit $rc): ${LABEL[$id]}: $BIN ${FLAGS[$id]} --json --quiet"
      [[ $rc -eq 77 ]] && echo "demo.sh: exit 77: model file absent, or the library lacks this mode's paths"
      echo "---- its stderr ----"
      cat "$work/$id.err"
      echo "--------------------"
    } >&2
    continue
  fi
  ok_rows+=("$id")
done
elapsed=$(( $(date +%s) - start ))

# percent FRACTION: 12.8%; "-" (does not apply) as n/a.
percent() {
  if [[ $1 == - ]]; then echo n/a; else awk -v f="$1" 'BEGIN { printf "%.1f%%\n", 100 * f }'; fi
}
# hbytes BYTES: human(), "-" as n/a.
hbytes() { if [[ $1 == - ]]; then echo n/a; else human "$1"; fi; }

# What each kind of row measures (printed under the tables for the kinds that ran).
declare -A MEASURES=(
  [colocated]="one process, no transfer: the reference tokens"
  [full-after]="the whole KV moves once prefill is done; decode's first step waits for all of it"
  [full-streamed]="the whole KV moves layer by layer during prefill"
  [selective]="the selective paths' latency: decode is sparse only until the speculative path has
                             delivered everything (for a small cache that can be before step 2: sparse 0,
                             every step attended to the whole prompt)"
  [selective-sparse]="sparse decoding: the transfer never completes on its own, so every step attends
                             to P u S_t u G, P and S_t each within the budget, S_t fetched on demand"
  [link-full-streamed]="the same over a tbf-shaped 10 Gbit/s veth link between two network namespaces"
  [link-selective]="the same over the shaped link: there streaming cannot hide the cache"
)

# The tables, from the rows that succeeded.
print_table() {
  local id mode prov ttft ttst stall tpot bf bp bo bs toks emulated dg total ofkv sparse newt pfrac att e2e
  local same ref_tokens="" kind
  local fmt1='%-44s %8s %8s %8s %8s %8s  %9s %6s %8s  %s\n'
  local fmt2='%-44s %10s %10s %10s %11s %10s %10s %7s\n'
  [[ -f $work/colocated.tsv ]] && ref_tokens=$(cut -f11 "$work/colocated.tsv")
  # shellcheck disable=SC2059 # fmt1 and fmt2 are this function's own formats
  printf "$fmt1" run "TTFT ms" "TTST ms" "stall ms" "TPOT ms" "E2E ms" sparse P attended "tokens = colocated"
  local providers=() kinds=()
  for id in "${ok_rows[@]}"; do
    IFS=$'\t' read -r mode prov ttft ttst stall tpot bf bp bo bs toks emulated dg total ofkv sparse newt pfrac att e2e \
      <"$work/$id.tsv"
    if [[ $id == colocated ]]; then
      same="(reference)"
    elif [[ $emulated == true ]]; then
      same="n/a (emulated)"
    elif [[ -z $ref_tokens ]]; then
      same="n/a (colocated failed)"
    elif [[ $toks == "$ref_tokens" ]]; then
      same=yes
    else
      # how many leading tokens agree
      same="no (first $(jq -n --argjson a "$toks" --argjson b "$ref_tokens" \
        '[range(0; [($a|length), ($b|length)] | min) | select($a[.] != $b[.])] | (first // ($a|length))') equal)"
    fi
    [[ $mode != colocated ]] && providers+=("${LABEL[$id]}: $prov")
    kind=${id#emu-}
    [[ " ${kinds[*]} " == *" $kind "* ]] || kinds+=("$kind")
    if [[ $sparse == - ]]; then sparse=n/a; else sparse="$sparse of $((newt - 1))"; fi
    # shellcheck disable=SC2059
    printf "$fmt1" "${LABEL[$id]}" "$(printf %.2f "$ttft")" "$(printf %.2f "$ttst")" "$(printf %.2f "$stall")" \
      "$(printf %.3f "$tpot")" "$(printf %.1f "$e2e")" "$sparse" "$(percent "$pfrac")" "$(percent "$att")" "$same"
  done
  echo
  # shellcheck disable=SC2059
  printf "$fmt2" "bytes moved" full proactive on-demand speculative digests total "of KV"
  for id in "${ok_rows[@]}"; do
    [[ $id == colocated ]] && continue
    IFS=$'\t' read -r mode prov ttft ttst stall tpot bf bp bo bs toks emulated dg total ofkv sparse newt pfrac att e2e \
      <"$work/$id.tsv"
    # shellcheck disable=SC2059
    printf "$fmt2" "${LABEL[$id]}" "$(hbytes "$bf")" "$(hbytes "$bp")" "$(hbytes "$bo")" "$(hbytes "$bs")" \
      "$(hbytes "$dg")" "$(hbytes "$total")" "$(percent "$ofkv")"
  done
  echo
  echo "TTFT = t0 -> first token (prefill); TTST = t0 -> second token (decode); stall = TTST - TTFT;"
  echo "TPOT = mean time per token after the second; E2E = t0 -> the last token (the whole response)."
  echo "sparse = decode steps that attended to P u S_t u G"
  echo "(the rest attended to the whole prompt); P = the proactive set's mean share of the prompt's blocks;"
  echo "attended = the mean share of them a sparse step attended to (per layer). Both are unions over the"
  echo "KV heads of per-head choices rounded up to whole blocks, sink and recent blocks included, so on a"
  echo "short prompt they exceed the per-head budget (100 tokens are 7 blocks). Bytes: what each path"
  echo "moved, the page digests, the total of both (sg_transfer_stats' bytes) and that total over the"
  echo "prompt's whole KV cache. One run per row, $(nproc) cores, ${elapsed} s for all runs."
  echo "What each row measures:"
  for kind in "${kinds[@]}"; do
    printf '  %-26s %s\n' "$(sed 's/^stories260K //; s/^llama3-8b\/[0-9]* //; s/ [0-9.]*,/,/' <<<"${LABEL[$kind]}")" \
      "${MEASURES[$kind]}"
  done
  [[ -n $link_note ]] && echo "$link_note"
  if [[ ${#providers[@]} -gt 0 ]]; then
    if [[ $(printf '%s\n' "${providers[@]#*: }" | sort -u | wc -l) -eq 1 ]]; then
      echo "Provider of every transfer run: ${providers[0]#*: }."
    else
      printf 'Provider: %s\n' "${providers[@]}"
    fi
  fi
}

if [[ ${#failed[@]} -gt 0 ]]; then
  if [[ ${#ok_rows[@]} -gt 0 ]]; then
    {
      echo
      echo "demo.sh: partial results (the failed runs are left out):"
      print_table
    } >&2
  fi
  echo "demo.sh: ${#failed[@]} of ${#selected[@]} runs failed: ${failed[*]}" >&2
  exit 1
fi
print_table
