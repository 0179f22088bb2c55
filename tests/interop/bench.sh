#!/usr/bin/env bash
# Bindings throughput and per-call cost, measured by hand (not a ctest test; its figures go into
# docs/benchmarks.md). For each language L with a launcher: the 512 MiB scattered full transfer
# (--layers 32 --tokens 4096 --blocks 272 --no-selective) with L on both sides, alternated round by
# round with the same transfer with C on both sides, so both see the same machine; the decode side
# also measures --calls 2000000 sg_transfer_layer_state calls. Prints a markdown table: per language
# the median decode-side full_gbps, C's median from the same alternation, L / C (goal >= 0.95: the
# median over the rounds of L's run divided by the C run right after it), and the median ns per
# call beside C's.
#
# usage: bench.sh LAUNCHER_DIR [ROUNDS]       (ROUNDS default 3)
# Environment: SMARTGEN_INTEROP_PAIR_TIMEOUT (seconds per side, default 300). Run it on a quiet
# machine: the ratio compares runs made minutes apart.
set -u
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=pair.sh
. "$here/pair.sh"

if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  echo "usage: $0 LAUNCHER_DIR [ROUNDS]" >&2
  exit 2
fi
launchers=$1
rounds=${2:-3}
limit=${SMARTGEN_INTEROP_PAIR_TIMEOUT:-300}
if [ ! -x "$launchers/smartgen-interop-c" ]; then
  echo "no smartgen-interop-c in $launchers: C is the baseline of every ratio" >&2
  exit 2
fi
PAIR_ARGS=(--layers 32 --tokens 4096 --blocks 272 --no-selective)
PAIR_DECODE_ARGS=(--calls 2000000)

work=$(mktemp -d "${TMPDIR:-/tmp}/smartgen-interop-bench.XXXXXX") || exit 2
trap 'interop_kill_children; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
interop_make_key "$work" || exit 2

# median of the numbers on stdin (the mean of the middle two for an even count)
median() {
  sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "-"; else if (NR % 2) print v[(NR + 1) / 2];
                   else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# run_one LANG: one L-L pair; appends the decode side's full_gbps and calls_ns to $work/LANG.{gbps,ns}
# (under the name given as $2, default LANG). Returns 1 with the logs printed when the pair failed.
run_one() {
  local lang=$1 name=${2:-$1} dir="$work/run" why
  rm -rf "$dir"
  mkdir -p "$dir"
  interop_run_pair "$launchers/smartgen-interop-$lang" "$launchers/smartgen-interop-$lang" "$dir" "$limit"
  why=$(interop_pair_verdict "$lang" "$lang" "$dir")
  if [ -n "$why" ]; then
    {
      echo "=== $lang-$lang failed: $why"
      interop_print_logs "$dir"
    } >&2
    return 1
  fi
  interop_field "$dir/decode.out" full_gbps >>"$work/$name.gbps"
  interop_field "$dir/decode.out" calls_ns >>"$work/$name.ns"
  echo "  $lang-$lang: $(tail -n 1 "$dir/decode.out")" >&2
}

rows=()
failed=0
for lang in "${INTEROP_LANGS[@]}"; do
  if [ ! -x "$launchers/smartgen-interop-$lang" ]; then
    rows+=("| $lang | no launcher | | | | |")
    continue
  fi
  base="c-beside-$lang"
  ok=1
  for round in $(seq 1 "$rounds"); do
    echo "$lang: round $round of $rounds" >&2
    run_one "$lang" || ok=0
    # C's own row is its own baseline; every other language alternates with a C run, and the
    # ratio is taken per round, of two runs made seconds apart, so that a change in the machine's
    # load between rounds cancels out.
    if [ "$lang" != c ] && [ "$ok" = 1 ] && run_one c "$base"; then
      awk -v a="$(tail -n 1 "$work/$lang.gbps")" -v b="$(tail -n 1 "$work/$base.gbps")" \
        'BEGIN { if (b > 0) printf "%.3f\n", a / b }' >>"$work/$lang.ratio"
    elif [ "$lang" != c ]; then
      ok=0
    fi
    [ "$ok" = 0 ] && break
  done
  if [ "$ok" = 0 ]; then
    failed=1
    rows+=("| $lang | FAILED (see the log above) | | | | |")
    continue
  fi
  if [ "$lang" = c ]; then
    base=c
    ratio=1.000
  else
    ratio=$(median <"$work/$lang.ratio")
  fi
  gbps=$(median <"$work/$lang.gbps")
  c_gbps=$(median <"$work/$base.gbps")
  ns=$(median <"$work/$lang.ns")
  c_ns=$(median <"$work/$base.ns")
  rows+=("| $lang | $gbps | $c_gbps | $ratio | $ns | $c_ns |")
done

echo
echo "512 MiB scattered full transfer (--layers 32 --tokens 4096 --blocks 272 --no-selective), tcp;ofi_rxm"
echo "on 127.0.0.1, decode side, median of $rounds rounds; C measured alternately in the same run;"
echo "L / C is the median of the per-round ratios."
echo
echo "| language | full_gbps | C full_gbps | L / C (goal >= 0.95) | ns per call (2,000,000 calls) | C ns per call |"
echo "| --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
exit "$failed"
