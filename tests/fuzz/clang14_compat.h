/* Force-included into kernels/cpu/digest.cpp in the fuzz build only (tests/fuzz/CMakeLists.txt).
 * clang before 16 refuses __builtin_cpu_supports("f16c") ("invalid cpu feature string"), which
 * digest.cpp asks next to "avx2"; this answers f16c from CPUID and passes "avx2" to the builtin, so
 * the fuzz build runs the same AVX2/F16C kernels as a GCC build. */
#ifndef SMARTGEN_FUZZ_CLANG14_COMPAT_H
#define SMARTGEN_FUZZ_CLANG14_COMPAT_H
#if defined(__x86_64__) && defined(__clang__) && __clang_major__ < 16
#include <cpuid.h>

static inline int sg_compat_cpu_avx2(void) { return __builtin_cpu_supports("avx2"); }

static inline int sg_compat_cpu_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}

static inline int sg_compat_cpu_supports(const char *feature) {
    if (__builtin_strcmp(feature, "avx2") == 0) return sg_compat_cpu_avx2();
    if (__builtin_strcmp(feature, "f16c") == 0) return sg_compat_cpu_f16c();
    return 0;
}

#define __builtin_cpu_supports(feature) sg_compat_cpu_supports(feature)
#endif
#endif
