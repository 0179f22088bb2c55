/* The header's sg_X_init(p) macros and the sg_X_init_sized entry points behind them. A caller whose
 * struct is smaller than the library's (an older header), the same, or larger (a newer header) gets
 * exactly its bytes written: defaults where the library knows the field, zeros past it, its own size
 * in struct_size, and never a byte outside; the calls that read such a struct accept it. Exit 0. */
#include <smartgen/smartgen.h>

#include <stdio.h>
#include <string.h>

#define GUARD 64
#define SLACK 32

static int failed = 0;

static int all_bytes(const unsigned char *p, size_t n, unsigned char v) {
    for (size_t i = 0; i < n; ++i)
        if (p[i] != v) return 0;
    return 1;
}

/* Initialises a struct of `size` bytes inside guard bytes and checks what was written. `full` is the
 * result of the macro on a struct of the library's own size: a smaller caller gets its prefix, a
 * larger one all of it and zeros after. */
typedef void (*sized_fn)(void *, size_t);

static void check(const char *name, sized_fn fn, size_t lib_size, const void *full, size_t size) {
    unsigned char buf[GUARD + 1024 + SLACK + GUARD];
    memset(buf, 0xA5, sizeof buf);
    unsigned char *p = buf + GUARD;
    fn(p, size);
    size_t recorded;
    memcpy(&recorded, p, sizeof recorded);
    const size_t common = size < lib_size ? size : lib_size;
    if (!all_bytes(buf, GUARD, 0xA5) || !all_bytes(p + size, GUARD, 0xA5)) {
        printf("FAIL: %s_sized(%zu) wrote outside the caller's struct\n", name, size);
        failed = 1;
    } else if (recorded != size) {
        printf("FAIL: %s_sized(%zu) recorded struct_size %zu\n", name, size, recorded);
        failed = 1;
    } else if (common > sizeof(size_t) &&
               memcmp(p + sizeof(size_t), (const unsigned char *)full + sizeof(size_t), common - sizeof(size_t)) != 0) {
        printf("FAIL: %s_sized(%zu) wrote other defaults than %s_init\n", name, size, name);
        failed = 1;
    } else if (size > lib_size && !all_bytes(p + lib_size, size - lib_size, 0)) {
        printf("FAIL: %s_sized(%zu) left the bytes past its %zu-byte struct unzeroed\n", name, size, lib_size);
        failed = 1;
    }
}

#define CHECK_SIZES(T, name)                                                                                 \
    do {                                                                                                     \
        T full;                                                                                              \
        memset(&full, 0x5A, sizeof full);                                                                    \
        name##_init(&full);                                                                                  \
        if (full.struct_size != sizeof full) {                                                               \
            printf("FAIL: " #name "_init set struct_size %zu of %zu\n", full.struct_size, sizeof full);      \
            failed = 1;                                                                                      \
        }                                                                                                    \
        const size_t sizes[] = {sizeof(size_t), sizeof full / 2, sizeof full - 4, sizeof full,               \
                                sizeof full + 8, sizeof full + SLACK};                                       \
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; ++i)                                          \
            check(#name, (sized_fn)(void (*)(void))name##_init_sized, sizeof full, &full, sizes[i]);        \
        name##_init_sized(NULL, sizeof full); /* harmless */                                                 \
    } while (0)

int main(void) {
    CHECK_SIZES(sg_error_info_t, sg_error_info);
    CHECK_SIZES(sg_context_options_t, sg_context_options);
    CHECK_SIZES(sg_context_stats_t, sg_context_stats);
    CHECK_SIZES(sg_kv_layout_t, sg_kv_layout);
    CHECK_SIZES(sg_session_options_t, sg_session_options);
    CHECK_SIZES(sg_directory_options_t, sg_directory_options);
    CHECK_SIZES(sg_directory_stats_t, sg_directory_stats);
    CHECK_SIZES(sg_selector_input_t, sg_selector_input);
    CHECK_SIZES(sg_transfer_options_t, sg_transfer_options);
    CHECK_SIZES(sg_layer_written_t, sg_layer_written);
    CHECK_SIZES(sg_transfer_stats_t, sg_transfer_stats);

    /* A struct from a newer header (larger, its unknown tail zero) and one from an older header
     * (its prefix only) are both accepted by the calls that read them. */
    struct {
        sg_context_options_t known;
        unsigned char newer[SLACK];
    } bigger;
    sg_context_options_init_sized(&bigger.known, sizeof bigger);
    bigger.known.provider = "tcp";
    bigger.known.allow_unauthenticated = 1;
    sg_context_t ctx = NULL;
    sg_status_t st = sg_context_create(&bigger.known, &ctx, NULL);
    if (st != SG_OK) { printf("FAIL: sg_context_create with a newer header's options: %s\n", sg_status_str(st)); failed = 1; }
    sg_context_stats_t small_stats;
    sg_context_stats_init_sized(&small_stats, offsetof(sg_context_stats_t, struct_size) + sizeof(size_t) * 2);
    st = sg_context_stats(ctx, &small_stats);
    if (st != SG_OK) { printf("FAIL: sg_context_stats into an older header's struct: %s\n", sg_status_str(st)); failed = 1; }
    sg_context_destroy(ctx);
    if (!failed) puts("ok: every _init writes exactly the caller's struct, smaller, equal or larger");
    return failed;
}
