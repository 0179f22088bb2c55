#!/bin/sh
# compare_tokens.sh BINARY "ARGS A" "ARGS B": runs smartgen-disagg twice with --json and checks that
# both runs generated exactly the same tokens (e.g. --mode full against --mode colocated).
# Exit status: 0 same tokens, 1 different or a run failed, 77 (skip) when the model file is absent
# or the loaded libsmartgen lacks the selective paths a --mode selective run needs.
set -u
bin=$1
args_a=$2
args_b=$3
err=$(mktemp)
trap 'rm -f "$err"' EXIT

run() {
    # $1: the arguments (word-split on purpose); stdout: the JSON line; stderr kept in $err
    # shellcheck disable=SC2086
    "$bin" $1 --json --quiet 2>"$err"
    rc=$?
    cat "$err" >&2
    if grep -q "lacks the selective paths" "$err"; then
        echo "SKIP: this libsmartgen lacks the selective paths"
        exit 77
    fi
    return $rc
}

tokens() { # the "tokens" array of a result line
    printf '%s\n' "$1" | sed -n 's/.*"tokens": \(\[[^]]*\]\).*/\1/p'
}

checked() { # $1: rc, $2: the arguments
    if [ "$1" -eq 77 ]; then
        echo "SKIP: the model file is absent or the library lacks what '$2' needs (see above)"
        exit 77
    fi
    if [ "$1" -ne 0 ]; then
        echo "FAIL: smartgen-disagg $2 exited with $1"
        exit 1
    fi
}

out_a=$(run "$args_a")
checked $? "$args_a"
out_b=$(run "$args_b")
checked $? "$args_b"
tok_a=$(tokens "$out_a")
tok_b=$(tokens "$out_b")
if [ -z "$tok_a" ] || [ "$tok_a" = "[]" ]; then
    echo "FAIL: no tokens in the output of $args_a: $out_a"
    exit 1
fi
if [ "$tok_a" != "$tok_b" ]; then
    echo "FAIL: different tokens"
    echo "  $args_a: $tok_a"
    echo "  $args_b: $tok_b"
    exit 1
fi
echo "PASS: $args_a and $args_b generated the same tokens: $tok_a"
echo "  $args_b: $out_b"
exit 0
