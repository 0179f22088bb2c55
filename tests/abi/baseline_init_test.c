/* Built against the 0.2.0 baseline header and bound as a 0.2 program is
 * (bind_as_built_against_baseline.h): the _init functions of structs that grew since must write no
 * byte past the struct the program has, and say its size in struct_size. Exit 0 when they do. */
#include <smartgen/smartgen.h>

#include <stdio.h>
#include <string.h>

#define GUARDED(T) struct { T value; unsigned char guard[64]; }

static int guard_intact(const unsigned char *g, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if (g[i] != 0xA5) return 0;
    return 1;
}

int main(void) {
    int failed = 0;
    GUARDED(sg_transfer_options_t) o;
    memset(&o, 0xA5, sizeof o);
    sg_transfer_options_init(&o.value);
    if (!guard_intact(o.guard, sizeof o.guard)) { puts("FAIL: sg_transfer_options_init wrote past the 0.2 struct"); failed = 1; }
    if (o.value.struct_size != sizeof o.value) { printf("FAIL: options struct_size %zu, the 0.2 struct has %zu\n", o.value.struct_size, sizeof o.value); failed = 1; }
    GUARDED(sg_transfer_stats_t) s;
    memset(&s, 0xA5, sizeof s);
    sg_transfer_stats_init(&s.value);
    if (!guard_intact(s.guard, sizeof s.guard)) { puts("FAIL: sg_transfer_stats_init wrote past the 0.2 struct"); failed = 1; }
    if (s.value.struct_size != sizeof s.value) { printf("FAIL: stats struct_size %zu, the 0.2 struct has %zu\n", s.value.struct_size, sizeof s.value); failed = 1; }
    if (!failed) printf("ok: the 0.1 _init versions keep to the 0.2 structs (%zu and %zu bytes)\n", sizeof o.value, sizeof s.value);
    return failed;
}
