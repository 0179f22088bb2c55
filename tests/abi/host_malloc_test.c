/* A host program linked against libsmartgen keeps glibc's malloc: the library routes its own
 * allocations through mimalloc's mi_* API, and Debian's libmimalloc (which also exports malloc)
 * must not take over the host's malloc. */
#define _GNU_SOURCE
#include <smartgen/smartgen.h>

#include <dlfcn.h>
#include <link.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures, passes;
#define CHECK(cond, what)                                                 \
    do {                                                                  \
        if (cond) {                                                       \
            passes++;                                                     \
        } else {                                                          \
            failures++;                                                   \
            fprintf(stderr, "%s:%d: FAIL: %s\n", __FILE__, __LINE__, what); \
        }                                                                 \
    } while (0)

static int saw_mimalloc;
static int find_mimalloc(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    (void)data;
    if (info->dlpi_name && strstr(info->dlpi_name, "libmimalloc")) saw_mimalloc = 1;
    return 0;
}

int main(void) {
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    CHECK(libc != NULL, "libc.so.6 is loaded");
    void *glibc_malloc = libc ? dlsym(libc, "malloc") : NULL;
    void *glibc_free = libc ? dlsym(libc, "free") : NULL;

    /* Use the library for real first, so any lazy initialisation has happened. */
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = "tcp";
    o.allow_unauthenticated = 1; /* no sessions here */
    sg_context_t ctx = NULL;
    CHECK(sg_context_create(&o, &ctx, NULL) == SG_OK, "context created");

    CHECK(dlsym(RTLD_DEFAULT, "malloc") == glibc_malloc, "malloc resolves to glibc's");
    CHECK(dlsym(RTLD_DEFAULT, "free") == glibc_free, "free resolves to glibc's");
    /* glibc-only introspection works on what the host allocates. */
    void *p = malloc(1000);
    CHECK(p != NULL && malloc_usable_size(p) >= 1000, "malloc_usable_size on a host allocation");
    struct mallinfo2 mi = mallinfo2();
    CHECK(mi.uordblks >= 1000, "glibc's arena accounts the host allocation");
    free(p);

    dl_iterate_phdr(find_mimalloc, NULL);
#ifdef EXPECT_MIMALLOC
    CHECK(saw_mimalloc, "libsmartgen loaded mimalloc for its own allocations");
#else
    CHECK(!saw_mimalloc, "mimalloc is not loaded in a build without it");
#endif
    /* This C host has no libstdc++ of its own: the library's operator new must still be libstdc++'s
     * (std::bad_alloc when memory runs out, turned into SG_ERR_NO_MEMORY), not mimalloc's, which
     * aborts the process (0.4: sg_profile_load under ulimit -v died with SIGABRT). */
    void *libstdcxx = dlopen("libstdc++.so.6", RTLD_NOW | RTLD_NOLOAD);
    CHECK(libstdcxx != NULL, "libstdc++.so.6 is loaded");
    void *new_default = dlsym(RTLD_DEFAULT, "_Znwm");
    CHECK(libstdcxx && new_default == dlsym(libstdcxx, "_Znwm"), "operator new resolves to libstdc++'s");
    CHECK(sg_context_destroy(ctx) == SG_OK, "context destroyed");
    printf("%d passed, %d failed\n", passes, failures);
    return failures ? 1 : 0;
}
