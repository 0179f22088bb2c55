#!/usr/bin/env bash
# Runs `smartgen-bench SUBCOMMAND --quick --json` and checks its output: at least one line, every line
# a JSON object with the fields docs/benchmarks.md promises (bench, figure, value, unit,
# baseline_name, baseline_value, ratio and the parameters), `bench` naming the subcommand, a finite
# value, and every figure the subcommand owes present (FIGURES, space-separated, e.g. "P1 P2").
# Usage: check_json_lines.sh SMARTGEN-BENCH SUBCOMMAND "FIGURES" [EXTRA ARGS...]
set -euo pipefail
bench=$1 sub=$2 figures=$3
shift 3
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$bench" "$sub" --quick --json "$@" >"$out"
lines=$(grep -c . "$out" || true)
[ "$lines" -gt 0 ] || { echo "check: $sub printed no JSON lines" >&2; exit 1; }
jq -e -s --arg sub "$sub" 'all(.[];
  (has("bench") and has("figure") and has("value") and has("unit") and has("baseline_name") and
   has("baseline_value") and has("ratio") and has("provider") and has("op") and has("pattern") and
   has("block_bytes") and has("queue_depth") and has("total_bytes") and has("link"))
  and .bench == $sub and (.value | type == "number") and (.ratio == null or (.ratio | type == "number"))
  and (.figure == null or (.ratio | type == "number"))
  and (if .bench == "plan" and .figure != null then has("ms") and has("p99_ms") else true end))' \
  "$out" >/dev/null || { echo "check: a line of $sub lacks a field or has a bad value:" >&2; cat "$out" >&2; exit 1; }
for f in $figures; do
  jq -e -s --arg f "$f" 'any(.[]; .figure == $f)' "$out" >/dev/null ||
    { echo "check: $sub printed no line for figure $f" >&2; cat "$out" >&2; exit 1; }
done
echo "$sub: $lines JSON lines; figures:"
jq -r 'select(.figure != null) | "  \(.figure): \(.value) \(.unit) vs \(.baseline_name) \(.baseline_value) -> ratio \(.ratio)"' "$out"
