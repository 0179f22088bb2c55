// Linked into every fuzzer: the sanitizers' defaults (the environment's ASAN_OPTIONS/UBSAN_OPTIONS
// still override them).
//
// Every UBSan report stops the run as a finding. The build keeps UBSan recoverable only so that a
// suppressions file can hold a known, reported finding back during a long run
// (UBSAN_OPTIONS=suppressions=FILE, see docs/fuzzing.md).
extern "C" __attribute__((used, visibility("default"))) const char *__ubsan_default_options() {
    return "halt_on_error=1:print_stacktrace=1";
}
