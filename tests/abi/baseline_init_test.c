/* Built against the 0.2.0 baseline header, in two ways (tests/CMakeLists.txt): bound as a program
 * linked against 0.2 was (bind_as_built_against_baseline.h: the 0.1 versions), and as a program
 * compiled today against a vendored 0.2 header binds (the default versions). Either way every _init
 * that header declares must write no byte past the struct the program has, and say its size in
 * struct_size. Exit 0 when they do. */
#include <smartgen/smartgen.h>

#include <stdio.h>
#include <string.h>

#define GUARD 64
#define GUARDED(T) struct { unsigned char before[GUARD]; T value; unsigned char after[GUARD]; }

static int failed = 0;

static int guard_intact(const unsigned char *g) {
    for (size_t i = 0; i < GUARD; ++i)
        if (g[i] != 0xA5) return 0;
    return 1;
}

#define CHECK_INIT(T, fn)                                                                                    \
    do {                                                                                                     \
        GUARDED(T) g;                                                                                        \
        memset(&g, 0xA5, sizeof g);                                                                          \
        fn(&g.value);                                                                                        \
        if (!guard_intact(g.before) || !guard_intact(g.after)) {                                             \
            printf("FAIL: %s wrote outside the %zu-byte struct of the 0.2 header\n", #fn, sizeof g.value);  \
            failed = 1;                                                                                      \
        } else if (g.value.struct_size != sizeof g.value) {                                                  \
            printf("FAIL: %s set struct_size %zu, the 0.2 struct has %zu\n", #fn, g.value.struct_size,      \
                   sizeof g.value);                                                                          \
            failed = 1;                                                                                      \
        } else {                                                                                             \
            printf("ok: %s keeps to its %zu bytes\n", #fn, sizeof g.value);                                 \
        }                                                                                                    \
    } while (0)

int main(void) {
    CHECK_INIT(sg_error_info_t, sg_error_info_init);
    CHECK_INIT(sg_context_options_t, sg_context_options_init);
    CHECK_INIT(sg_context_stats_t, sg_context_stats_init);
    CHECK_INIT(sg_kv_layout_t, sg_kv_layout_init);
    CHECK_INIT(sg_session_options_t, sg_session_options_init);
    CHECK_INIT(sg_selector_input_t, sg_selector_input_init);
    CHECK_INIT(sg_transfer_options_t, sg_transfer_options_init);
    CHECK_INIT(sg_transfer_stats_t, sg_transfer_stats_init);

    /* The options still work as the 0.2 program meant them: a context made with them. */
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = "tcp";
    o.allow_unauthenticated = 1;
    sg_context_t ctx = NULL;
    sg_status_t st = sg_context_create(&o, &ctx, NULL);
    if (st != SG_OK) { printf("FAIL: sg_context_create with 0.2 options: %s\n", sg_status_str(st)); failed = 1; }
    sg_context_destroy(ctx);
    return failed;
}
