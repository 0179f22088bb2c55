/*
 * abi_c_test: the C ABI as a C99 program sees it, through <smartgen/smartgen.h> alone.
 *
 * Pins what bindings and engines compiled against this header rely on: version queries, status
 * values and names, option-struct initialisers, handle validation (destroyed, double-destroyed and
 * made-up handles), layout validation messages, the header-version check, parameter bounds.
 *
 * Prints each failure as file:line and, as the last line, "N passed, M failed".
 * Exit status 0 when nothing failed.
 */
#include <smartgen/smartgen.h>

#include "../test_key.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

static int g_passed, g_failed;

/* Counts one check; a failure names the condition's description and where it is. */
#define CHECK(cond, what)                                                                         \
    do {                                                                                          \
        if (cond) {                                                                               \
            g_passed++;                                                                           \
        } else {                                                                                  \
            g_failed++;                                                                           \
            printf("%s:%d: FAIL: %s\n", __FILE__, __LINE__, (what));                              \
        }                                                                                         \
    } while (0)

/* CHECK for a status, printing the status actually returned and the last error detail. The
 * detail is read first: any later SmartGen call (sg_status_str too) may replace it. */
#define CHECK_STATUS(expr, want, what)                                                            \
    do {                                                                                          \
        sg_status_t got_ = (expr);                                                                \
        if (got_ == (want)) {                                                                     \
            g_passed++;                                                                           \
        } else {                                                                                  \
            char detail_[SG_ERROR_MESSAGE_MAX];                                                   \
            snprintf(detail_, sizeof detail_, "%s", sg_last_error_message());                     \
            g_failed++;                                                                           \
            printf("%s:%d: FAIL: %s: got %s (%d), want %s (%d)%s%s\n", __FILE__, __LINE__, (what), \
                   sg_status_str(got_), (int)got_, sg_status_str(want), (int)(want),              \
                   detail_[0] ? ": " : "", detail_);                                              \
        }                                                                                         \
    } while (0)

/* ---- versions --------------------------------------------------------------------------------- */
static void test_versions(void)
{
    char expect[32];
    const char *s = sg_version_string();

    CHECK(sg_version_number() == SG_VERSION_NUMBER, "sg_version_number() == SG_VERSION_NUMBER");
    CHECK(sg_abi_version() == SG_ABI_VERSION, "sg_abi_version() == SG_ABI_VERSION");
    snprintf(expect, sizeof expect, "%d.%d.%d", SG_VERSION_MAJOR, SG_VERSION_MINOR, SG_VERSION_PATCH);
    CHECK(s != NULL && strcmp(s, expect) == 0, "sg_version_string() is MAJOR.MINOR.PATCH of the macros");
    CHECK(sg_version_string() == s, "sg_version_string() is static storage (same pointer each call)");
    CHECK(SG_VERSION_NUMBER == SG_VERSION_MAJOR * 10000 + SG_VERSION_MINOR * 100 + SG_VERSION_PATCH,
          "SG_VERSION_NUMBER encodes MAJOR*10000 + MINOR*100 + PATCH");
}

/* ---- statuses --------------------------------------------------------------------------------- */
#define STATUS_ROW(name, value) {name, value, #name}
static const struct {
    sg_status_t status;
    int pinned; /* the value the header promises never to change */
    const char *name;
} STATUSES[] = {
    STATUS_ROW(SG_OK, 0),
    STATUS_ROW(SG_IN_PROGRESS, 1),
    STATUS_ROW(SG_ERR_INVALID_ARGUMENT, -1),
    STATUS_ROW(SG_ERR_INVALID_HANDLE, -2),
    STATUS_ROW(SG_ERR_INVALID_LAYOUT, -3),
    STATUS_ROW(SG_ERR_LAYOUT_MISMATCH, -4),
    STATUS_ROW(SG_ERR_OUT_OF_RANGE, -5),
    STATUS_ROW(SG_ERR_BUFFER_TOO_SMALL, -6),
    STATUS_ROW(SG_ERR_INVALID_STATE, -7),
    STATUS_ROW(SG_ERR_DUPLICATE, -8),
    STATUS_ROW(SG_ERR_VERSION_MISMATCH, -9),
    STATUS_ROW(SG_ERR_NOT_FOUND, -10),
    STATUS_ROW(SG_ERR_NO_MEMORY, -100),
    STATUS_ROW(SG_ERR_AGAIN, -101),
    STATUS_ROW(SG_ERR_TIMEOUT, -102),
    STATUS_ROW(SG_ERR_CANCELED, -103),
    STATUS_ROW(SG_ERR_TRANSPORT, -200),
    STATUS_ROW(SG_ERR_PEER_LOST, -201),
    STATUS_ROW(SG_ERR_PROTOCOL, -202),
    STATUS_ROW(SG_ERR_DEADLINE, -203),
    STATUS_ROW(SG_ERR_CONNECT, -204),
    STATUS_ROW(SG_ERR_REMOTE, -205),
    STATUS_ROW(SG_ERR_AUTH_FAILED, -206),
    STATUS_ROW(SG_ERR_AUTH_REQUIRED, -207),
    STATUS_ROW(SG_ERR_UNSUPPORTED, -300),
    STATUS_ROW(SG_ERR_NO_PROVIDER, -301),
    STATUS_ROW(SG_ERR_INTERNAL, -399),
};
#define NUM_STATUSES (sizeof STATUSES / sizeof STATUSES[0])

static void test_statuses(void)
{
    /* Values with no enumerator, chosen outside the pinned ranges so that statuses added later
     * (which go inside them) do not turn this check stale. */
    static const int unknown[] = {1000, -400, -1000, 12345, -12345};
    char what[128];
    size_t i;

    for (i = 0; i < NUM_STATUSES; i++) {
        const char *s = sg_status_str(STATUSES[i].status);

        snprintf(what, sizeof what, "%s == %d (pinned)", STATUSES[i].name, STATUSES[i].pinned);
        CHECK((int)STATUSES[i].status == STATUSES[i].pinned, what);
        snprintf(what, sizeof what, "sg_status_str(%s) is \"%s\" (got \"%s\")", STATUSES[i].name, STATUSES[i].name,
                 s ? s : "(null)");
        CHECK(s != NULL && strcmp(s, STATUSES[i].name) == 0, what);
    }
    for (i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        const char *s = sg_status_str((sg_status_t)unknown[i]);

        snprintf(what, sizeof what, "sg_status_str(%d) is \"SG_STATUS_UNKNOWN\" (got \"%s\")", unknown[i],
                 s ? s : "(null)");
        CHECK(s != NULL && strcmp(s, "SG_STATUS_UNKNOWN") == 0, what);
    }
}

/* ---- initialisers ------------------------------------------------------------------------------- */
static void test_initialisers(void)
{
    sg_context_options_t copts;
    sg_session_options_t sopts;
    sg_transfer_options_t topts;
    sg_kv_layout_t layout;
    sg_error_info_t err;

    /* Garbage first, so a field the init forgets shows up. */
    memset(&copts, 0xA5, sizeof copts);
    sg_context_options_init(&copts);
    CHECK(copts.struct_size == sizeof copts, "sg_context_options_init sets struct_size");
    CHECK(copts.header_version == SG_VERSION_NUMBER, "sg_context_options_init sets header_version");
    CHECK(copts.provider == NULL, "context default provider is NULL (auto)");
    CHECK(copts.local_addr == NULL, "context default local_addr is NULL (127.0.0.1)");
    CHECK(copts.manual_progress == 0, "context default manual_progress is 0 (a progress thread)");
    CHECK(copts.progress_spin_us == 50, "context default progress_spin_us is 50");
    CHECK(copts.max_ops_in_flight == 64, "context default max_ops_in_flight is 64");
    CHECK(copts.log_level == SG_LOG_WARN, "context default log_level is SG_LOG_WARN");
    CHECK(copts.log_fn == NULL, "context default log_fn is NULL (stderr)");

    memset(&sopts, 0xA5, sizeof sopts);
    sg_session_options_init(&sopts);
    CHECK(sopts.struct_size == sizeof sopts, "sg_session_options_init sets struct_size");
    CHECK(sopts.provider == NULL, "session default provider is NULL (auto)");

    memset(&topts, 0xA5, sizeof topts);
    sg_transfer_options_init(&topts);
    CHECK(topts.struct_size == sizeof topts, "sg_transfer_options_init sets struct_size");
    CHECK(topts.paths == 0 || topts.paths == SG_PATH_FULL, "transfer default paths is full");
    CHECK(topts.flags == 0, "transfer default flags is 0");
    CHECK(topts.priority == 0, "transfer default priority is 0");
    CHECK(topts.layer_order == NULL && topts.layer_order_count == 0, "transfer default layer order");

    memset(&layout, 0xA5, sizeof layout);
    sg_kv_layout_init(&layout);
    CHECK(layout.struct_size == sizeof layout, "sg_kv_layout_init sets struct_size");
    CHECK(layout.dtype == SG_DTYPE_FP16 && layout.packing == SG_KV_SEPARATE &&
              layout.block_order == SG_BLOCK_TOKEN_MAJOR && layout.mem_kind == SG_MEM_HOST &&
              layout.block_stride_bytes == 0,
          "sg_kv_layout_init defaults: fp16, separate, token-major, host, packed");

    memset(&err, 0xA5, sizeof err);
    sg_error_info_init(&err);
    CHECK(err.struct_size == sizeof err, "sg_error_info_init sets struct_size");
    CHECK(err.status == SG_OK && err.message[0] == '\0', "sg_error_info_init clears status and message");

    CHECK(sg_dtype_size(SG_DTYPE_FP32) == 4 && sg_dtype_size(SG_DTYPE_FP16) == 2 &&
              sg_dtype_size(SG_DTYPE_BF16) == 2 && sg_dtype_size(SG_DTYPE_FP8_E4M3) == 1,
          "sg_dtype_size of each dtype");
    CHECK(sg_dtype_size((sg_dtype_t)77) == 0, "sg_dtype_size of an unknown dtype is 0");
}

/* ---- KV layouts --------------------------------------------------------------------------------- */

/* A tiny host pool: 1 layer, 1 KV head, head_dim 8, 4 tokens per block, 2 blocks, fp16. */
#define T_HEAD_DIM 8u
#define T_TPB 4u
#define T_BLOCKS 2u
static uint16_t g_k[T_BLOCKS * T_TPB * T_HEAD_DIM], g_v[T_BLOCKS * T_TPB * T_HEAD_DIM];
static void *const g_k_bases[1] = {g_k};
static void *const g_v_bases[1] = {g_v};

static void small_layout(sg_kv_layout_t *layout)
{
    sg_kv_layout_init(layout);
    layout->num_layers = 1;
    layout->num_kv_heads = 1;
    layout->head_dim = T_HEAD_DIM;
    layout->tokens_per_block = T_TPB;
    layout->num_blocks = T_BLOCKS;
    layout->dtype = SG_DTYPE_FP16;
    layout->layer_k_base = g_k_bases;
    layout->layer_v_base = g_v_bases;
    layout->layer_base_count = 1;
}

static void test_layouts(void)
{
    sg_kv_layout_t layout;
    sg_error_info_t err;
    uint64_t bytes = 0;

    small_layout(&layout);
    sg_error_info_init(&err);
    CHECK_STATUS(sg_kv_layout_validate(&layout, &err), SG_OK, "sg_kv_layout_validate of a good layout");
    CHECK_STATUS(sg_kv_layout_plane_bytes(&layout, &bytes), SG_OK, "sg_kv_layout_plane_bytes");
    CHECK(bytes == (uint64_t)T_TPB * 1 * T_HEAD_DIM * 2, "plane bytes = tokens * heads * head_dim * 2");
    bytes = 0;
    CHECK_STATUS(sg_kv_layout_region_bytes(&layout, &bytes), SG_OK, "sg_kv_layout_region_bytes");
    CHECK(bytes == (uint64_t)T_BLOCKS * T_TPB * T_HEAD_DIM * 2, "region bytes = blocks * plane bytes (packed)");
    /* Sizes need only the shape: a pool is sized before its memory exists. */
    layout.layer_k_base = NULL;
    layout.layer_v_base = NULL;
    layout.layer_base_count = 0;
    bytes = 0;
    CHECK_STATUS(sg_kv_layout_region_bytes(&layout, &bytes), SG_OK, "sg_kv_layout_region_bytes without base pointers");
    CHECK(bytes == (uint64_t)T_BLOCKS * T_TPB * T_HEAD_DIM * 2, "region bytes without base pointers");
    CHECK_STATUS(sg_kv_layout_plane_bytes(&layout, &bytes), SG_OK, "sg_kv_layout_plane_bytes without base pointers");
    small_layout(&layout);

    /* head_dim 0: rejected, and the message names the field. */
    layout.head_dim = 0;
    sg_error_info_init(&err);
    CHECK_STATUS(sg_kv_layout_validate(&layout, &err), SG_ERR_INVALID_LAYOUT, "validate with head_dim 0");
    CHECK(strstr(sg_last_error_message(), "head_dim") != NULL, "sg_last_error_message names head_dim");
    CHECK(err.status == SG_ERR_INVALID_LAYOUT, "error info status is SG_ERR_INVALID_LAYOUT");
    CHECK(strstr(err.message, "head_dim") != NULL, "error info message names head_dim");
    CHECK(err.struct_size == sizeof err, "error info struct_size is left as set");

    /* The error info is left untouched by a call that succeeds. */
    small_layout(&layout);
    sg_error_info_init(&err);
    strcpy(err.message, "sentinel");
    CHECK_STATUS(sg_kv_layout_validate(&layout, &err), SG_OK, "validate a good layout again");
    CHECK(strcmp(err.message, "sentinel") == 0 && err.status == SG_OK, "error info untouched on success");
}

/* ---- contexts and handles ----------------------------------------------------------------------- */
static sg_status_t make_context(sg_context_t *ctx)
{
    sg_context_options_t opts;
    sg_error_info_t err;

    sg_context_options_init(&opts);
    SG_TEST_USE_KEY(opts);
    sg_error_info_init(&err);
    return sg_context_create(&opts, ctx, &err);
}

static void test_context_handles(void)
{
    sg_context_t ctx = NULL, ctx2 = NULL;
    sg_context_t made_up = (sg_context_t)(uintptr_t)0x12345678u;

    CHECK_STATUS(sg_context_destroy(NULL), SG_OK, "sg_context_destroy(NULL)");
    CHECK_STATUS(sg_context_destroy(made_up), SG_ERR_INVALID_HANDLE, "sg_context_destroy(made-up handle)");
    CHECK_STATUS(sg_context_progress(made_up), SG_ERR_INVALID_HANDLE, "sg_context_progress(made-up handle)");

    CHECK_STATUS(make_context(&ctx), SG_OK, "sg_context_create with defaults");
    if (ctx == NULL) {
        CHECK(0, "a context to test handle validation on (skipping the rest of this group)");
        return;
    }
    /* With a progress thread, a manual progress call is allowed and harmless. */
    CHECK_STATUS(sg_context_progress(ctx), SG_OK, "sg_context_progress on a live context");
    CHECK_STATUS(sg_context_destroy(ctx), SG_OK, "sg_context_destroy");
    CHECK_STATUS(sg_context_destroy(ctx), SG_ERR_INVALID_HANDLE, "sg_context_destroy twice");
    CHECK_STATUS(sg_context_progress(ctx), SG_ERR_INVALID_HANDLE, "sg_context_progress after destroy");

    /* A new context must not bring the old handle value back to life. */
    CHECK_STATUS(make_context(&ctx2), SG_OK, "sg_context_create after a destroy");
    if (ctx2 != NULL) {
        CHECK(ctx2 != ctx, "a new context gets a handle value not used before");
        CHECK_STATUS(sg_context_progress(ctx), SG_ERR_INVALID_HANDLE, "old handle stays invalid");
        CHECK_STATUS(sg_context_destroy(ctx2), SG_OK, "sg_context_destroy of the second context");
    }
}

static void test_kv_handles(void)
{
    sg_context_t ctx = NULL;
    sg_kv_handle_t kv = NULL, cuda_kv = NULL;
    sg_kv_layout_t layout;
    sg_error_info_t err;

    CHECK_STATUS(sg_kv_deregister(NULL), SG_OK, "sg_kv_deregister(NULL)");
    CHECK_STATUS(sg_kv_deregister((sg_kv_handle_t)(uintptr_t)0x12345678u), SG_ERR_INVALID_HANDLE,
                 "sg_kv_deregister(made-up handle)");

    CHECK_STATUS(make_context(&ctx), SG_OK, "sg_context_create for the KV tests");
    if (ctx == NULL) {
        CHECK(0, "a context to register KV pools on (skipping the rest of this group)");
        return;
    }

    small_layout(&layout);
    sg_error_info_init(&err);
    CHECK_STATUS(sg_kv_register(ctx, &layout, &kv, &err), SG_OK, "sg_kv_register of a small host pool");
    if (kv != NULL) {
        /* A handle of one kind is not a handle of another. */
        CHECK_STATUS(sg_context_progress((sg_context_t)(void *)kv), SG_ERR_INVALID_HANDLE,
                     "a KV handle passed as a context is rejected");
        CHECK_STATUS(sg_kv_deregister(kv), SG_OK, "sg_kv_deregister");
        CHECK_STATUS(sg_kv_deregister(kv), SG_ERR_INVALID_HANDLE, "sg_kv_deregister twice");
    }

    /* Device memory needs the CUDA plugin, a driver and a device, and device transfers are not in
     * this version yet: the answer names which is missing (here: the plugin, or the driver). The
     * pointers are host memory, but the library refuses the memory kind before it looks at them. */
    small_layout(&layout);
    layout.mem_kind = SG_MEM_CUDA;
    layout.device = 0;
    sg_error_info_init(&err);
    CHECK_STATUS(sg_kv_register(ctx, &layout, &cuda_kv, &err), SG_ERR_UNSUPPORTED, "sg_kv_register of SG_MEM_CUDA");
    CHECK(cuda_kv == NULL, "no handle is written when sg_kv_register fails");
    CHECK(err.status == SG_ERR_UNSUPPORTED && err.message[0] != '\0', "error info filled for SG_MEM_CUDA");
    CHECK(strstr(err.message, "CUDA plugin") != NULL, "the SG_MEM_CUDA refusal names the CUDA plugin's state");
    printf("SG_MEM_CUDA here: %s\n", err.message);

    /* A registration that fails on the layout, through the context. */
    small_layout(&layout);
    layout.head_dim = 0;
    sg_error_info_init(&err);
    CHECK_STATUS(sg_kv_register(ctx, &layout, &kv, &err), SG_ERR_INVALID_LAYOUT, "sg_kv_register with head_dim 0");
    CHECK(strstr(err.message, "head_dim") != NULL, "sg_kv_register's message names head_dim");

    CHECK_STATUS(sg_context_destroy(ctx), SG_OK, "sg_context_destroy after the KV tests");
}

/* Authentication is mandatory unless waived, and a key is at least 32 bytes. */
static void test_auth_options(void)
{
    sg_context_options_t opts;
    sg_error_info_t err;
    sg_context_t ctx = NULL;

    sg_context_options_init(&opts);
    CHECK(opts.auth_key == NULL && opts.auth_key_len == 0 && !opts.allow_unauthenticated,
          "sg_context_options_init: no key, authentication required");
    sg_error_info_init(&err);
    CHECK_STATUS(sg_context_create(&opts, &ctx, &err), SG_ERR_AUTH_REQUIRED, "sg_context_create without a key");
    CHECK(ctx == NULL, "no context is written on SG_ERR_AUTH_REQUIRED");
    opts.auth_key = "0123456789abcdef0123456789abcde"; /* 31 bytes */
    opts.auth_key_len = 31;
    CHECK_STATUS(sg_context_create(&opts, &ctx, &err), SG_ERR_INVALID_ARGUMENT, "sg_context_create with a 31-byte key");
    opts.auth_key_len = 32;
    opts.auth_key = "0123456789abcdef0123456789abcdef";
    CHECK_STATUS(sg_context_create(&opts, &ctx, &err), SG_OK, "sg_context_create with a 32-byte key");
    CHECK_STATUS(sg_context_destroy(ctx), SG_OK, "sg_context_destroy of the keyed context");
    sg_context_options_init(&opts);
    opts.allow_unauthenticated = 1;
    ctx = NULL;
    CHECK_STATUS(sg_context_create(&opts, &ctx, &err), SG_OK, "sg_context_create with allow_unauthenticated");
    CHECK_STATUS(sg_context_destroy(ctx), SG_OK, "sg_context_destroy of the unauthenticated context");
}

/* Context options that name nothing usable are the caller's mistake: provider "" (NULL means
 * automatic) was taken as automatic, and a malformed local_addr came back as SG_ERR_NO_PROVIDER. */
static void test_context_option_strings(void)
{
    static const char *const bad_addrs[] = {"", "not-an-address", "localhost", "127.0.0.1:5000", "256.0.0.1",
                                            "127.1", "1.2.3.4 ", "::1::2", "[::1]"};
    sg_context_options_t opts;
    sg_error_info_t err;
    sg_context_t ctx = NULL;
    char what[128];
    size_t i;

    sg_context_options_init(&opts);
    SG_TEST_USE_KEY(opts);
    opts.provider = "";
    sg_error_info_init(&err);
    CHECK_STATUS(sg_context_create(&opts, &ctx, &err), SG_ERR_INVALID_ARGUMENT, "sg_context_create with provider \"\"");
    CHECK(strstr(err.message, "provider") != NULL, "the message names provider");
    CHECK(ctx == NULL, "no context is written for provider \"\"");
    if (ctx != NULL) {
        sg_context_destroy(ctx);
        ctx = NULL;
    }

    opts.provider = NULL;
    for (i = 0; i < sizeof bad_addrs / sizeof bad_addrs[0]; i++) {
        opts.local_addr = bad_addrs[i];
        sg_error_info_init(&err);
        snprintf(what, sizeof what, "sg_context_create with local_addr \"%s\"", bad_addrs[i]);
        CHECK_STATUS(sg_context_create(&opts, &ctx, &err), SG_ERR_INVALID_ARGUMENT, what);
        snprintf(what, sizeof what, "the message for local_addr \"%s\" names local_addr", bad_addrs[i]);
        CHECK(strstr(err.message, "local_addr") != NULL, what);
        if (ctx != NULL) {
            sg_context_destroy(ctx);
            ctx = NULL;
        }
    }

    opts.local_addr = "127.0.0.1";
    CHECK_STATUS(sg_context_create(&opts, &ctx, &err), SG_OK, "sg_context_create with local_addr 127.0.0.1");
    CHECK_STATUS(sg_context_destroy(ctx), SG_OK, "sg_context_destroy of the 127.0.0.1 context");
}

static void test_version_mismatch(void)
{
    sg_context_options_t opts;
    sg_error_info_t err;
    sg_context_t ctx = NULL;
    sg_status_t st;

    sg_context_options_init(&opts);
    opts.header_version = (SG_VERSION_MAJOR + 1) * 10000; /* a caller built against the next major */
    sg_error_info_init(&err);
    st = sg_context_create(&opts, &ctx, &err);
    /* Checked before anything else runs: it replaces the last error message. */
    CHECK(sg_last_error_message()[0] != '\0', "sg_last_error_message() is set after a failure");
    CHECK_STATUS(st, SG_ERR_VERSION_MISMATCH, "sg_context_create with header_version of another major");
    CHECK(ctx == NULL, "no context is written on SG_ERR_VERSION_MISMATCH");
    CHECK(err.status == SG_ERR_VERSION_MISMATCH, "error info status is SG_ERR_VERSION_MISMATCH");
    CHECK(err.message[0] != '\0', "error info message is set");
    if (st == SG_OK)
        sg_context_destroy(ctx);
}

/* ---- caller buffers ------------------------------------------------------------------------------ */
/* One rule for every call that fills a caller buffer and reports its size: NULL with capacity 0 is a
 * size query (SG_OK, only the size written); NULL with a capacity is SG_ERR_INVALID_ARGUMENT; a
 * buffer too small is SG_ERR_BUFFER_TOO_SMALL with the size written and the buffer untouched. */
static void test_output_buffers(void)
{
    sg_context_t ctx = NULL;
    static char buf[1 << 16];
    size_t len = 0, len2 = 0, n = 0, i;
    sg_provider_info_t infos[64];
    int untouched = 1;

    CHECK_STATUS(make_context(&ctx), SG_OK, "sg_context_create for the buffer tests");
    if (ctx == NULL)
        return;

    CHECK_STATUS(sg_context_get_metadata(ctx, NULL, 0, &len), SG_OK, "sg_context_get_metadata size query");
    CHECK(len > 0 && len < sizeof buf, "the metadata size is reported");
    len2 = 7;
    CHECK_STATUS(sg_context_get_metadata(ctx, NULL, 16, &len2), SG_ERR_INVALID_ARGUMENT,
                 "sg_context_get_metadata with NULL and a capacity");
    CHECK(len2 == 7, "nothing written for NULL with a capacity");
    memset(buf, 0x5a, sizeof buf);
    len2 = 0;
    CHECK_STATUS(sg_context_get_metadata(ctx, buf, len - 1, &len2), SG_ERR_BUFFER_TOO_SMALL,
                 "sg_context_get_metadata one byte short");
    CHECK(len2 == len && (unsigned char)buf[0] == 0x5a, "size written, buffer untouched when too small");
    CHECK_STATUS(sg_context_get_metadata(ctx, buf, len, &len2), SG_OK, "sg_context_get_metadata exact");

    CHECK_STATUS(sg_context_metrics_text(ctx, NULL, 0, &len), SG_OK, "sg_context_metrics_text size query");
    CHECK(len > 0 && len < sizeof buf, "the metrics size is reported (without the NUL)");
    CHECK_STATUS(sg_context_metrics_text(ctx, NULL, 16, &len2), SG_ERR_INVALID_ARGUMENT,
                 "sg_context_metrics_text with NULL and a capacity");
    memset(buf, 0x5a, sizeof buf);
    len2 = 0;
    CHECK_STATUS(sg_context_metrics_text(ctx, buf, len, &len2), SG_ERR_BUFFER_TOO_SMALL,
                 "sg_context_metrics_text without room for the NUL");
    CHECK(len2 == len && (unsigned char)buf[0] == 0x5a, "size written, buffer untouched when too small");
    CHECK_STATUS(sg_context_metrics_text(ctx, buf, len + 1, &len2), SG_OK, "sg_context_metrics_text exact");
    CHECK(len2 == len && buf[len] == '\0', "metrics text is NUL-terminated");

    /* Provider names have no size out-parameter: a buffer is required. */
    CHECK_STATUS(sg_context_provider(ctx, NULL, 0), SG_ERR_INVALID_ARGUMENT, "sg_context_provider(NULL, 0)");
    CHECK_STATUS(sg_context_provider(ctx, buf, 2), SG_ERR_BUFFER_TOO_SMALL, "sg_context_provider into 2 bytes");

    CHECK_STATUS(sg_provider_query(NULL, NULL, 0, &n), SG_OK, "sg_provider_query size query");
    CHECK_STATUS(sg_provider_query(NULL, NULL, 1, &len2), SG_ERR_INVALID_ARGUMENT,
                 "sg_provider_query with NULL and a capacity");
    if (n > 1 && n <= sizeof infos / sizeof infos[0]) {
        memset(infos, 0x5a, sizeof infos);
        for (i = 0; i < n; i++)
            infos[i].struct_size = sizeof infos[i];
        len2 = 0;
        CHECK_STATUS(sg_provider_query(NULL, infos, n - 1, &len2), SG_ERR_BUFFER_TOO_SMALL,
                     "sg_provider_query one entry short");
        for (i = 0; i < n - 1; i++)
            untouched = untouched && (unsigned char)infos[i].name[0] == 0x5a;
        CHECK(len2 == n && untouched, "count written, entries untouched when too small");
        CHECK_STATUS(sg_provider_query(NULL, infos, n, &len2), SG_OK, "sg_provider_query exact");
    }
    CHECK_STATUS(sg_context_destroy(ctx), SG_OK, "sg_context_destroy after the buffer tests");
}

/* ---- parameters --------------------------------------------------------------------------------- */
static void test_params(void)
{
    static const struct {
        sg_param_t param;
        const char *name;
    } params[] = {
        {SG_PARAM_STAGING_THRESHOLD, "SG_PARAM_STAGING_THRESHOLD"},
        {SG_PARAM_MAX_OP_BYTES, "SG_PARAM_MAX_OP_BYTES"},
        {SG_PARAM_MAX_OPS_IN_FLIGHT, "SG_PARAM_MAX_OPS_IN_FLIGHT"},
        {SG_PARAM_PROGRESS_SPIN_US, "SG_PARAM_PROGRESS_SPIN_US"},
    };
    char what[128];
    size_t i;
    uint64_t lo, hi;

    CHECK(SG_PARAM_STAGING_THRESHOLD == 0 && SG_PARAM_MAX_OP_BYTES == 1 && SG_PARAM_MAX_OPS_IN_FLIGHT == 2 &&
              SG_PARAM_PROGRESS_SPIN_US == 3,
          "sg_param_t values are pinned");
    for (i = 0; i < sizeof params / sizeof params[0]; i++) {
        lo = 1;
        hi = 0;
        snprintf(what, sizeof what, "sg_param_bounds(%s)", params[i].name);
        CHECK_STATUS(sg_param_bounds(params[i].param, &lo, &hi), SG_OK, what);
        snprintf(what, sizeof what, "%s bounds: min <= max", params[i].name);
        CHECK(lo <= hi, what);
    }
    lo = 7;
    hi = 7;
    CHECK_STATUS(sg_param_bounds((sg_param_t)999, &lo, &hi), SG_ERR_INVALID_ARGUMENT, "sg_param_bounds(999)");
    CHECK(lo == 7 && hi == 7, "sg_param_bounds(999) writes no output");
}

/* ---- the settled 0.2 rules (docs/abi.md) ------------------------------------------------------- */
/* Every type a struct or a status carries has a fixed width, so SWIG, JNI and bindgen see the same
 * layout as C; an option struct left zeroed (struct_size and header_version set) is the defaults,
 * and a value outside a field's domain is refused with a message naming the field. */
static void test_settled_abi(void)
{
    sg_context_options_t opts;
    sg_context_t ctx = NULL;
    sg_error_info_t err;

    CHECK(sizeof(sg_status_t) == 4, "sg_status_t is 4 bytes (int32_t)");
    CHECK((sg_status_t)-1 < 0, "sg_status_t is signed");
    CHECK(sizeof(sg_dtype_t) == 4 && sizeof(sg_mem_kind_t) == 4 && sizeof(sg_kv_packing_t) == 4 &&
              sizeof(sg_block_order_t) == 4 && sizeof(sg_log_level_t) == 4 && sizeof(sg_param_t) == 4 &&
              sizeof(sg_event_kind_t) == 4,
          "every constant-carrying typedef is 4 bytes (uint32_t)");
    CHECK(SG_LOG_DEFAULT == 0 && SG_LOG_OFF < SG_LOG_ERROR && SG_LOG_ERROR < SG_LOG_DEBUG,
          "log levels leave 0 to the default and grow with verbosity");

    memset(&opts, 0, sizeof opts);
    opts.struct_size = sizeof opts;
    opts.header_version = SG_VERSION_NUMBER;
    opts.allow_unauthenticated = 1;
    sg_error_info_init(&err);
    CHECK_STATUS(sg_context_create(&opts, &ctx, &err), SG_OK, "a zeroed options struct is the defaults");
    CHECK_STATUS(sg_context_destroy(ctx), SG_OK, "sg_context_destroy of the zero-options context");

    opts.progress_spin_us = SG_PROGRESS_SPIN_NONE;
    opts.manual_progress = 1;
    ctx = NULL;
    CHECK_STATUS(sg_context_create(&opts, &ctx, &err), SG_OK, "manual progress with SG_PROGRESS_SPIN_NONE");
    CHECK_STATUS(sg_context_destroy(ctx), SG_OK, "sg_context_destroy of the manual-progress context");

    opts.manual_progress = 2;
    sg_error_info_init(&err);
    CHECK_STATUS(sg_context_create(&opts, &ctx, &err), SG_ERR_INVALID_ARGUMENT, "manual_progress 2 is refused");
    CHECK(strstr(err.message, "manual_progress") != NULL, "the message names manual_progress");
    opts.manual_progress = 0;
    opts.log_level = SG_LOG_DEBUG + 1;
    sg_error_info_init(&err);
    CHECK_STATUS(sg_context_create(&opts, &ctx, &err), SG_ERR_INVALID_ARGUMENT, "an unknown log level is refused");
    CHECK(strstr(err.message, "log_level") != NULL, "the message names log_level");
    opts.log_level = SG_LOG_DEFAULT;
    opts.allow_unauthenticated = 7;
    sg_error_info_init(&err);
    CHECK_STATUS(sg_context_create(&opts, &ctx, &err), SG_ERR_INVALID_ARGUMENT,
                 "allow_unauthenticated 7 is refused");
    CHECK(strstr(err.message, "allow_unauthenticated") != NULL, "the message names allow_unauthenticated");
}

int main(void)
{
    test_versions();
    test_statuses();
    test_initialisers();
    test_layouts();
    test_context_handles();
    test_kv_handles();
    test_version_mismatch();
    test_auth_options();
    test_context_option_strings();
    test_output_buffers();
    test_params();
    test_settled_abi();

    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
