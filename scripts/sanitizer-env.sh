# Sourced, not run: the one place that sets the sanitizers' run-time options for SmartGen's tests
# (scripts/test.sh's asan and tsan phases, and a developer's own ctest run of an
# asan or tsan tree: `. scripts/sanitizer-env.sh; ctest --test-dir build/asan`). Options the caller
# already set are kept after ours, so they win.
#   ASAN_OPTIONS  detect_leaks: LeakSanitizer at exit of every test process; abort_on_error: a report
#                 ends the process with SIGABRT, which no harness can mistake for a normal exit code;
#                 check_initialization_order: static initialisers that read another file's globals.
#   LSAN_OPTIONS  print_suppressions=0: a clean report is one line; suppressions: what leaks in a
#                 library that is not SmartGen's, each entry with its reason (lsan-suppressions.txt).
#   TSAN_OPTIONS  halt_on_error: the first race fails the test; second_deadlock_stack: both stacks of
#                 a lock-order inversion; die_after_fork=0: the failure tests fork a peer that starts
#                 its own threads, which SmartGen's fork rule allows (the child makes its own context).
# The ctest test sanitizer.options_reach_tests (asan and tsan trees) fails when these did not reach
# the processes ctest starts.
#   FI_OFI_RXM_BUFFER_SIZE, FI_OFI_RXM_MSG_RX_SIZE, FI_OFI_RXM_MSG_TX_SIZE: libfabric's rxm zeroes its
#                 buffer pools when an endpoint opens and a connection forms (about 330 MB for one
#                 tcp pair at its defaults: 16 KiB buffers, 128 per connection). Both sanitizers
#                 intercept that memset and shadow every byte: a pair's set-up took 15-20 s under
#                 ThreadSanitizer and 2.5 s under ASan (0.7 s in release), most of each phase's time.
#                 4 KiB buffers, 32 a connection: the same pair in 2.2 s under TSan, 210 MB (2 vCPU
#                 AMD EPYC). Messages past 4 KiB then take rxm's segmented path, which the runtime
#                 does not see. The release phase keeps libfabric's defaults, as users run it.
#                 A value the caller set wins.
SMARTGEN_ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:check_initialization_order=1"
SMARTGEN_TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:die_after_fork=0"
export ASAN_OPTIONS="${SMARTGEN_ASAN_OPTIONS}${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
SMARTGEN_LSAN_SUPPRESSIONS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lsan-suppressions.txt"
export LSAN_OPTIONS="print_suppressions=0:suppressions=${SMARTGEN_LSAN_SUPPRESSIONS}${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export TSAN_OPTIONS="${SMARTGEN_TSAN_OPTIONS}${TSAN_OPTIONS:+:$TSAN_OPTIONS}"
export SMARTGEN_ASAN_OPTIONS SMARTGEN_TSAN_OPTIONS
export FI_OFI_RXM_BUFFER_SIZE=${FI_OFI_RXM_BUFFER_SIZE:-4096}
export FI_OFI_RXM_MSG_RX_SIZE=${FI_OFI_RXM_MSG_RX_SIZE:-32}
export FI_OFI_RXM_MSG_TX_SIZE=${FI_OFI_RXM_MSG_TX_SIZE:-32}
