/*
 * interop.c: the C interop program, the reference for the Go, Java and Rust ones.
 *
 * One process plays one side of a transfer; tests/interop pairs every language with every other.
 * What the two sides agree on (command line, pool shape, block tables, bytes, the order of the
 * transfers, the notifications, the output line) is specified in docs/bindings.md, "The interop
 * program"; this file follows it step by step and says so where the spec leaves a choice open.
 *
 *   decode                                         prefill
 *   ------                                         -------
 *                                                  write request 0's bytes (before the session)
 *   expect "interop-full"  ->  notify "ready interop-full"  ->  post (all layers written)
 *   wait, check every byte                         wait (completes on decode's confirmation)
 *   expect "interop-selective"  ->  notify  ->     refill with request 1's bytes, post with profile
 *   wait ESSENTIAL per layer, fetch 3 blocks,      wait
 *   wait (speculative brings the rest), check
 *   --calls: sg_transfer_layer_state loop on request 0's live handle
 *   sg_session_close (graceful) on both sides, then destroy everything
 *
 * Only include/smartgen/smartgen.h is used; the key comes from SG_AUTH_KEY_FILE (read by the
 * library). Output: one line on stdout (see print_result); progress goes to stderr.
 *
 * Where the spec is silent, this program chooses: the notification is sent without a NUL (one
 * received with a trailing NUL is accepted); the expect uses default options (the decode side
 * follows the post's paths); --calls queries layer 0; the prefill side's bytes= counts the payload
 * the decode side confirmed; a byte mismatch is reported as reason="MISMATCH: ..." and a bad
 * command line as SG_ERR_INVALID_ARGUMENT; a connect refused while the listener is not up yet is
 * retried until --timeout-s, so either side may start first.
 */
#define _POSIX_C_SOURCE 200809L

#include <smartgen/smartgen.h>

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- the shape every language uses (docs/bindings.md) ------------------------------------------ */
#define KV_HEADS 8u
#define HEAD_DIM 128u
#define BLOCK_TOKENS 16u
#define PLANE_BYTES (BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2u) /* fp16: 32,768 bytes per K or V plane */
#define PLANES 2u                                             /* K and V */

/* Logical block i lives at physical block (i * STRIDE + OFFSET) % blocks, differently per side, so
 * the runtime has to map one scattered table onto another. */
#define PREFILL_STRIDE 37u
#define PREFILL_OFFSET 11u
#define DECODE_STRIDE 29u
#define DECODE_OFFSET 5u

#define NUM_REQUESTS 2
#define REQ_FULL 0
#define REQ_SELECTIVE 1
static const char *const REQUEST_IDS[NUM_REQUESTS] = {"interop-full", "interop-selective"};
#define READY_PREFIX "ready "

#define DEFAULT_LAYERS 8u
#define DEFAULT_TOKENS 1024u
#define DEFAULT_BLOCKS 80u
#define DEFAULT_TIMEOUT_S 60u
#define MAX_LAYERS 65536u

#define PROFILE_FORMAT                                                                              \
    "{\"version\":1,\"model\":\"interop\",\"num_layers\":%u,\"num_kv_heads\":8,\"block_tokens\":16," \
    "\"defaults\":{\"policy\":\"sinks_recent\",\"budget\":{\"fraction\":0.125},\"sinks\":16,"      \
    "\"recent\":64}}"

#define NS_PER_S 1000000000ull
#define CONNECT_RETRY_NS (50ull * 1000000ull) /* between connects refused while the peer starts */
#define NOTIFY_RECHECK_MS 1000                /* see await_ready */

/* ---- configuration --------------------------------------------------------------------------- */
struct config {
    const char *role; /* "prefill" or "decode"; NULL until parsed */
    int prefill;
    int listen; /* 1: --listen, 0: --peer */
    char addr[64];
    uint16_t port;
    uint32_t layers;
    uint32_t tokens;
    uint32_t blocks;
    int selective;
    uint64_t calls;
    uint32_t timeout_s;
    uint64_t timeout_ns;
};

/* Everything one run holds, so that cleanup can release whatever exists on any path. */
struct run {
    struct config cfg;
    uint32_t n;          /* blocks of the request: tokens / 16 */
    uint32_t *table;     /* this side's block table, n entries */
    uint8_t **planes;    /* layers * 2 allocations of blocks * PLANE_BYTES: [layer * 2 + plane] */
    void **k_bases;
    void **v_bases;
    uint8_t *ramp;       /* PLANE_BYTES + 256 bytes, ramp[j] = 7 * j mod 256 (see plane_pattern) */
    sg_context_t ctx;
    sg_listener_t listener;
    sg_session_t session;
    sg_kv_handle_t kv;
    sg_profile_t profile;
    sg_transfer_t xfer[NUM_REQUESTS];
    int event_fd;        /* the context's, owned by it */
    /* results */
    uint64_t bytes;      /* payload bytes checked (decode) or confirmed by the decode side (prefill) */
    double full_s;
    double calls_ns;
    int failed;
    char reason[SG_ERROR_MESSAGE_MAX + 256];
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * NS_PER_S + (uint64_t)ts.tv_nsec;
}

static void progress(const struct run *r, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "[c %s] ", r->cfg.role ? r->cfg.role : "?");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* ---- failures -----------------------------------------------------------------------------------
 * The first failure is the reason reported; what fails after it (cleanup of a broken session, say)
 * is a consequence and only logged. Each helper returns -1 so that a step can `return fail(...)`. */
static int fail_named(struct run *r, const char *name, const char *fmt, ...)
{
    char line[sizeof r->reason];
    int n = snprintf(line, sizeof line, "%s: ", name);
    va_list ap;

    if (n < 0 || (size_t)n >= sizeof line)
        n = 0;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    progress(r, "%s", line);
    if (!r->failed) {
        r->failed = 1;
        memcpy(r->reason, line, sizeof line);
    }
    return -1;
}

/* A call that took an sg_error_info_t: its message is the detail. */
static int check_err(struct run *r, sg_status_t st, const char *call, const sg_error_info_t *err)
{
    if (st == SG_OK)
        return 0;
    return fail_named(r, sg_status_str(st), "%s: %s", call, err->message[0] ? err->message : "(no detail)");
}

/* Any other call: the detail is this thread's sg_last_error_message, so check must be the next
 * SmartGen call after the one it checks. */
static int check(struct run *r, sg_status_t st, const char *call)
{
    const char *msg;

    if (st == SG_OK)
        return 0;
    msg = sg_last_error_message();
    return fail_named(r, sg_status_str(st), "%s: %s", call, msg[0] ? msg : "(no detail)");
}

/* A transfer wait. SG_ERR_TIMEOUT is this program's --timeout-s, said as such; other errors are the
 * transfer's own, whose detail may have happened in the background (sg_transfer_status). */
static int check_wait(struct run *r, sg_status_t st, const char *call, sg_transfer_t xfer, int req)
{
    char detail[SG_ERROR_MESSAGE_MAX];
    sg_status_t xst = SG_OK;

    if (st == SG_OK)
        return 0;
    if (st == SG_ERR_TIMEOUT)
        return fail_named(r, sg_status_str(st), "%s(%s): not done within --timeout-s %u", call, REQUEST_IDS[req],
                          (unsigned)r->cfg.timeout_s);
    snprintf(detail, sizeof detail, "%s", sg_last_error_message());
    if (detail[0] == '\0' && sg_transfer_status(xfer, &xst, detail, sizeof detail) != SG_OK)
        detail[0] = '\0';
    return fail_named(r, sg_status_str(st), "%s(%s): %s", call, REQUEST_IDS[req], detail[0] ? detail : "(no detail)");
}

/* ---- command line ------------------------------------------------------------------------------ */
static void usage(FILE *out, const char *argv0)
{
    fprintf(out,
            "usage: %s --role prefill|decode (--listen ADDR:PORT | --peer ADDR:PORT)\n"
            "          [--layers N] [--tokens N] [--blocks N] [--no-selective] [--calls N] [--timeout-s N]\n"
            "  One side of the SmartGen interop transfer (docs/bindings.md). The session key comes from\n"
            "  the file named by SG_AUTH_KEY_FILE. Defaults: --layers %u --tokens %u --blocks %u\n"
            "  --timeout-s %u. Prints one result line on stdout; exit status 0 on success, 1 otherwise.\n",
            argv0, DEFAULT_LAYERS, DEFAULT_TOKENS, DEFAULT_BLOCKS, DEFAULT_TIMEOUT_S);
}

static int parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    char *end;
    unsigned long long v;

    if (s == NULL || *s < '0' || *s > '9')
        return -1;
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0' || v > max)
        return -1;
    *out = v;
    return 0;
}

/* "ADDR:PORT", ADDR an IPv4 literal or a bracketed IPv6 one ("[::1]:5000"). */
static int parse_endpoint(const char *s, char *addr, size_t cap, uint16_t *port)
{
    const char *colon = strrchr(s, ':');
    const char *start = s;
    size_t len;
    uint64_t p;

    if (colon == NULL || parse_u64(colon + 1, 65535, &p) != 0)
        return -1;
    len = (size_t)(colon - s);
    if (len >= 2 && s[0] == '[' && s[len - 1] == ']') {
        start = s + 1;
        len -= 2;
    }
    if (len == 0 || len >= cap)
        return -1;
    memcpy(addr, start, len);
    addr[len] = '\0';
    *port = (uint16_t)p;
    return 0;
}

static uint32_t gcd(uint32_t a, uint32_t b)
{
    while (b != 0) {
        uint32_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* Returns 0, 1 for --help, or -1 with the reason recorded. */
static int parse_args(struct run *r, int argc, char **argv)
{
    struct config *c = &r->cfg;
    int have_endpoint = 0;
    uint64_t v;
    int i;

    c->layers = DEFAULT_LAYERS;
    c->tokens = DEFAULT_TOKENS;
    c->blocks = DEFAULT_BLOCKS;
    c->selective = 1;
    c->timeout_s = DEFAULT_TIMEOUT_S;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;

        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout, argv[0]);
            return 1;
        } else if (strcmp(a, "--no-selective") == 0) {
            c->selective = 0;
            continue;
        } else if (val == NULL) {
            usage(stderr, argv[0]);
            return fail_named(r, "SG_ERR_INVALID_ARGUMENT", "%s needs a value (or is unknown)", a);
        }
        i++;
        if (strcmp(a, "--role") == 0) {
            if (strcmp(val, "prefill") != 0 && strcmp(val, "decode") != 0)
                return fail_named(r, "SG_ERR_INVALID_ARGUMENT", "--role must be prefill or decode, not '%s'", val);
            c->role = strcmp(val, "prefill") == 0 ? "prefill" : "decode";
            c->prefill = strcmp(val, "prefill") == 0;
        } else if (strcmp(a, "--listen") == 0 || strcmp(a, "--peer") == 0) {
            if (have_endpoint)
                return fail_named(r, "SG_ERR_INVALID_ARGUMENT", "give one of --listen and --peer, once");
            if (parse_endpoint(val, c->addr, sizeof c->addr, &c->port) != 0)
                return fail_named(r, "SG_ERR_INVALID_ARGUMENT", "%s '%s' is not ADDR:PORT", a, val);
            c->listen = strcmp(a, "--listen") == 0;
            have_endpoint = 1;
        } else if (strcmp(a, "--layers") == 0 || strcmp(a, "--tokens") == 0 || strcmp(a, "--blocks") == 0 ||
                   strcmp(a, "--timeout-s") == 0) {
            if (parse_u64(val, UINT32_MAX, &v) != 0 || v == 0)
                return fail_named(r, "SG_ERR_INVALID_ARGUMENT", "%s '%s' is not a number from 1 to %" PRIu32, a,
                                  val, UINT32_MAX);
            if (strcmp(a, "--layers") == 0)
                c->layers = (uint32_t)v;
            else if (strcmp(a, "--tokens") == 0)
                c->tokens = (uint32_t)v;
            else if (strcmp(a, "--blocks") == 0)
                c->blocks = (uint32_t)v;
            else
                c->timeout_s = (uint32_t)v;
        } else if (strcmp(a, "--calls") == 0) {
            if (parse_u64(val, UINT64_MAX, &c->calls) != 0)
                return fail_named(r, "SG_ERR_INVALID_ARGUMENT", "--calls '%s' is not a number", val);
        } else {
            usage(stderr, argv[0]);
            return fail_named(r, "SG_ERR_INVALID_ARGUMENT", "unknown option %s", a);
        }
    }
    if (c->role == NULL || !have_endpoint) {
        usage(stderr, argv[0]);
        return fail_named(r, "SG_ERR_INVALID_ARGUMENT", "--role and one of --listen / --peer are required");
    }
    if (!c->listen && c->port == 0)
        return fail_named(r, "SG_ERR_INVALID_ARGUMENT", "--peer needs a port other than 0");
    if (c->tokens % BLOCK_TOKENS != 0)
        return fail_named(r, "SG_ERR_INVALID_ARGUMENT", "--tokens %" PRIu32 " is not a multiple of %u", c->tokens,
                          BLOCK_TOKENS);
    /* A profile holds at most 65536 layers (docs/profiles.md). */
    if (c->layers > MAX_LAYERS)
        return fail_named(r, "SG_ERR_INVALID_ARGUMENT", "--layers %" PRIu32 " is more than %u", c->layers, MAX_LAYERS);
    r->n = c->tokens / BLOCK_TOKENS;
    /* Coprime strides make both tables permutations, so no block is named twice. */
    if (c->blocks < r->n || gcd(c->blocks, PREFILL_STRIDE) != 1 || gcd(c->blocks, DECODE_STRIDE) != 1)
        return fail_named(r, "SG_ERR_INVALID_ARGUMENT",
                          "--blocks %" PRIu32 " must be at least %" PRIu32 " (the request's blocks) and coprime to %u "
                          "and %u",
                          c->blocks, r->n, PREFILL_STRIDE, DECODE_STRIDE);
    /* The on-demand fetch names logical blocks 1, n/2 and n-2. */
    if (c->selective && r->n < 2)
        return fail_named(r, "SG_ERR_INVALID_ARGUMENT", "the selective transfer needs at least 32 tokens");
    c->timeout_ns = (uint64_t)c->timeout_s * NS_PER_S;
    return 0;
}

/* ---- pool and bytes ------------------------------------------------------------------------------
 * The byte at offset o of a plane is (base + 7 o) mod 256, base = (l*131 + p*71 + i*29 + r*13) mod 256.
 * 7 is odd, so with k = base * 7^-1 mod 256 (7^-1 = 183) that is 7 (o + k) mod 256 = ramp[o + k]:
 * every plane is a slice of one precomputed ramp, written with memcpy and checked with memcmp. */
#define INV7_MOD_256 183u

static const uint8_t *plane_pattern(const struct run *r, uint32_t layer, uint32_t plane, uint32_t block, int req)
{
    uint32_t base = (layer * 131u + plane * 71u + block * 29u + (uint32_t)req * 13u) & 0xFFu;
    return r->ramp + ((base * INV7_MOD_256) & 0xFFu);
}

static uint8_t *plane_at(const struct run *r, uint32_t layer, uint32_t plane, uint32_t logical)
{
    return r->planes[layer * PLANES + plane] + (size_t)r->table[logical] * PLANE_BYTES;
}

static int alloc_pool(struct run *r)
{
    const struct config *c = &r->cfg;
    uint32_t stride = c->prefill ? PREFILL_STRIDE : DECODE_STRIDE;
    uint32_t offset = c->prefill ? PREFILL_OFFSET : DECODE_OFFSET;
    size_t region = (size_t)c->blocks * PLANE_BYTES;
    uint32_t i;

    r->table = calloc(r->n, sizeof *r->table);
    r->planes = calloc((size_t)c->layers * PLANES, sizeof *r->planes);
    r->k_bases = calloc(c->layers, sizeof *r->k_bases);
    r->v_bases = calloc(c->layers, sizeof *r->v_bases);
    r->ramp = malloc(PLANE_BYTES + 256u);
    if (!r->table || !r->planes || !r->k_bases || !r->v_bases || !r->ramp)
        return fail_named(r, "SG_ERR_NO_MEMORY", "cannot allocate the block table and pool index");
    for (i = 0; i < r->n; i++)
        r->table[i] = (uint32_t)(((uint64_t)i * stride + offset) % c->blocks);
    for (i = 0; i < PLANE_BYTES + 256u; i++)
        r->ramp[i] = (uint8_t)(i * 7u);
    for (i = 0; i < c->layers * PLANES; i++) {
        r->planes[i] = calloc(1, region);
        if (r->planes[i] == NULL)
            return fail_named(r, "SG_ERR_NO_MEMORY", "cannot allocate %u layers x K/V x %zu bytes", c->layers, region);
    }
    for (i = 0; i < c->layers; i++) {
        r->k_bases[i] = r->planes[i * PLANES];
        r->v_bases[i] = r->planes[i * PLANES + 1];
    }
    return 0;
}

/* Payload bytes of one request: every plane of every logical block of every layer. */
static uint64_t request_bytes(const struct run *r)
{
    return (uint64_t)r->cfg.layers * PLANES * r->n * PLANE_BYTES;
}

static void fill_request(struct run *r, int req)
{
    uint32_t l, p, i;

    for (l = 0; l < r->cfg.layers; l++)
        for (p = 0; p < PLANES; p++)
            for (i = 0; i < r->n; i++)
                memcpy(plane_at(r, l, p, i), plane_pattern(r, l, p, i, req), PLANE_BYTES);
}

static void clear_request(struct run *r)
{
    uint32_t l, p, i;

    for (l = 0; l < r->cfg.layers; l++)
        for (p = 0; p < PLANES; p++)
            for (i = 0; i < r->n; i++)
                memset(plane_at(r, l, p, i), 0, PLANE_BYTES);
}

/* Checks every byte of every logical block; the first difference is the reason. */
static int verify_request(struct run *r, int req)
{
    uint32_t l, p, i, o;

    for (l = 0; l < r->cfg.layers; l++)
        for (p = 0; p < PLANES; p++)
            for (i = 0; i < r->n; i++) {
                const uint8_t *got = plane_at(r, l, p, i);
                const uint8_t *want = plane_pattern(r, l, p, i, req);
                if (memcmp(got, want, PLANE_BYTES) == 0)
                    continue;
                for (o = 0; got[o] == want[o]; o++)
                    ;
                return fail_named(r, "MISMATCH",
                                  "%s: layer %u %s logical block %u (physical %u) offset %u: got 0x%02x, want 0x%02x",
                                  REQUEST_IDS[req], l, p == 0 ? "K" : "V", i, r->table[i], o, got[o], want[o]);
            }
    r->bytes += request_bytes(r);
    return 0;
}

/* ---- context, pool registration, session ---------------------------------------------------- */
static int open_context(struct run *r)
{
    sg_context_options_t opts;
    sg_kv_layout_t layout;
    sg_error_info_t err;

    sg_context_options_init(&opts);
    opts.provider = "tcp"; /* tcp;ofi_rxm */
    /* local_addr NULL: 127.0.0.1. auth_key NULL: the library reads SG_AUTH_KEY_FILE. */
    sg_error_info_init(&err);
    if (check_err(r, sg_context_create(&opts, &r->ctx, &err), "sg_context_create", &err) != 0)
        return -1;
    if (check(r, sg_context_event_fd(r->ctx, &r->event_fd), "sg_context_event_fd") != 0)
        return -1;

    sg_kv_layout_init(&layout);
    layout.num_layers = r->cfg.layers;
    layout.num_kv_heads = KV_HEADS;
    layout.head_dim = HEAD_DIM;
    layout.tokens_per_block = BLOCK_TOKENS;
    layout.num_blocks = r->cfg.blocks;
    layout.dtype = SG_DTYPE_FP16;
    layout.packing = SG_KV_SEPARATE;
    layout.block_order = SG_BLOCK_TOKEN_MAJOR;
    layout.mem_kind = SG_MEM_HOST;
    layout.layer_k_base = r->k_bases;
    layout.layer_v_base = r->v_bases;
    layout.layer_base_count = r->cfg.layers;
    layout.block_stride_bytes = 0; /* packed */
    sg_error_info_init(&err);
    return check_err(r, sg_kv_register(r->ctx, &layout, &r->kv, &err), "sg_kv_register", &err);
}

static int accept_session(struct run *r)
{
    sg_session_options_t sopts;
    sg_error_info_t err;
    sg_status_t st;
    uint16_t port = 0;

    sg_error_info_init(&err);
    if (check_err(r, sg_listener_create(r->ctx, r->cfg.addr, r->cfg.port, &r->listener, &err), "sg_listener_create",
                  &err) != 0)
        return -1;
    if (check(r, sg_listener_port(r->listener, &port), "sg_listener_port") != 0)
        return -1;
    progress(r, "listening on %s:%u", r->cfg.addr, (unsigned)port);
    sg_session_options_init(&sopts);
    sg_error_info_init(&err);
    if (check_err(r, sg_session_accept(r->listener, &sopts, r->cfg.timeout_ns, &r->session, &err),
                  "sg_session_accept", &err) != 0)
        return -1;
    /* One peer is all this program takes; the session outlives its listener. */
    st = sg_listener_destroy(r->listener);
    r->listener = NULL;
    return check(r, st, "sg_listener_destroy");
}

/* The two programs start independently, so the listener may not be up yet: a refused connect
 * (SG_ERR_CONNECT) is retried until --timeout-s; any other failure is final. */
static int connect_session(struct run *r)
{
    sg_session_options_t sopts;
    sg_error_info_t err;
    uint64_t deadline = now_ns() + r->cfg.timeout_ns;
    sg_status_t st;

    sg_session_options_init(&sopts);
    for (;;) {
        uint64_t now = now_ns();
        struct timespec pause = {0, (long)CONNECT_RETRY_NS};

        sg_error_info_init(&err);
        st = sg_session_connect(r->ctx, r->cfg.addr, r->cfg.port, &sopts, now < deadline ? deadline - now : 0,
                                &r->session, &err);
        if (st != SG_ERR_CONNECT || now_ns() + CONNECT_RETRY_NS >= deadline)
            return check_err(r, st, "sg_session_connect", &err);
        nanosleep(&pause, NULL);
    }
}

static int open_session(struct run *r)
{
    char provider[64];

    if ((r->cfg.listen ? accept_session(r) : connect_session(r)) != 0)
        return -1;
    /* Right after the session is made, as the spec says: the peer can address our pool from now on. */
    if (check(r, sg_session_export_kv(r->session, r->kv), "sg_session_export_kv") != 0)
        return -1;
    if (check(r, sg_session_provider(r->session, provider, sizeof provider), "sg_session_provider") != 0)
        return -1;
    progress(r, "session with %s:%u over %s", r->cfg.addr, (unsigned)r->cfg.port, provider);
    return 0;
}

/* ---- notifications -------------------------------------------------------------------------- */
static int send_ready(struct run *r, int req)
{
    char msg[sizeof READY_PREFIX + SG_REQUEST_ID_MAX];
    int len = snprintf(msg, sizeof msg, READY_PREFIX "%s", REQUEST_IDS[req]);

    /* Sent without a NUL: the message is its bytes. */
    return check(r, sg_session_notify(r->session, msg, (size_t)len), "sg_session_notify");
}

/* Prefill: polls for "ready <id>", sleeping on the context's event fd in between (it fires when a
 * notification arrives or the session is lost). The wait on the fd is capped so that the session's
 * health is looked at now and then even without an event. */
static int await_ready(struct run *r, int req)
{
    char want[sizeof READY_PREFIX + SG_REQUEST_ID_MAX];
    char got[SG_NOTIFY_MAX + 1];
    char detail[SG_ERROR_MESSAGE_MAX];
    uint64_t deadline = now_ns() + r->cfg.timeout_ns;
    size_t want_len = (size_t)snprintf(want, sizeof want, READY_PREFIX "%s", REQUEST_IDS[req]);

    for (;;) {
        struct pollfd pfd;
        uint64_t now, left_ms, counter;
        sg_status_t st, health = SG_OK;
        size_t len = 0;

        st = sg_session_next_notification(r->session, got, SG_NOTIFY_MAX, &len);
        if (st == SG_OK) {
            /* A peer that sends a trailing NUL is read as one that does not. */
            if (len > 0 && got[len - 1] == '\0')
                len--;
            got[len] = '\0';
            if (len == want_len && memcmp(got, want, len) == 0)
                return 0;
            return fail_named(r, "SG_ERR_PROTOCOL", "expected the notification '%s', got '%.200s'", want, got);
        }
        if (st != SG_ERR_AGAIN)
            return check(r, st, "sg_session_next_notification");
        if (check(r, sg_session_error(r->session, &health, detail, sizeof detail), "sg_session_error") != 0)
            return -1;
        if (health != SG_OK)
            return fail_named(r, sg_status_str(health), "session lost while waiting for '%s': %s", want, detail);
        now = now_ns();
        if (now >= deadline)
            return fail_named(r, "SG_ERR_TIMEOUT", "no '%s' notification within --timeout-s %u", want,
                              (unsigned)r->cfg.timeout_s);
        left_ms = (deadline - now + 999999u) / 1000000u;
        pfd.fd = r->event_fd;
        pfd.events = POLLIN;
        pfd.revents = 0;
        if (poll(&pfd, 1, left_ms < NOTIFY_RECHECK_MS ? (int)left_ms : NOTIFY_RECHECK_MS) < 0 && errno != EINTR)
            return fail_named(r, "SG_ERR_INTERNAL", "poll on the context's event fd: %s", strerror(errno));
        /* Re-arm (the fd is non-blocking; nothing to read is fine). */
        if (pfd.revents & POLLIN)
            (void)!read(r->event_fd, &counter, sizeof counter);
    }
}

/* ---- the two roles ------------------------------------------------------------------------- */
static int make_profile(struct run *r)
{
    char json[512];
    sg_error_info_t err;
    int len = snprintf(json, sizeof json, PROFILE_FORMAT, (unsigned)r->cfg.layers);

    sg_error_info_init(&err);
    return check_err(r, sg_profile_parse(json, (size_t)len, &r->profile, &err), "sg_profile_parse", &err);
}

static int post_request(struct run *r, int req)
{
    sg_transfer_options_t topts;
    sg_error_info_t err;
    double start;

    if (await_ready(r, req) != 0)
        return -1;
    sg_transfer_options_init(&topts);
    topts.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
    if (req == REQ_FULL) {
        topts.paths = SG_PATH_FULL;
    } else {
        topts.paths = SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE;
        topts.profile = r->profile;
    }
    sg_error_info_init(&err);
    start = now_s();
    if (check_err(r,
                  sg_transfer_post(r->session, REQUEST_IDS[req], r->kv, r->table, r->n, r->cfg.tokens, &topts,
                                   &r->xfer[req], &err),
                  "sg_transfer_post", &err) != 0)
        return -1;
    /* Complete only once the decode side confirmed every byte in place. */
    if (check_wait(r, sg_transfer_wait(r->xfer[req], r->cfg.timeout_ns), "sg_transfer_wait", r->xfer[req], req) != 0)
        return -1;
    if (req == REQ_FULL)
        r->full_s = now_s() - start;
    r->bytes += request_bytes(r);
    progress(r, "%s delivered and confirmed", REQUEST_IDS[req]);
    /* Released at once: the blocks are refilled for the next request. */
    if (check(r, sg_transfer_release(r->xfer[req]), "sg_transfer_release") != 0)
        return -1;
    r->xfer[req] = NULL;
    return 0;
}

/* Request 0's bytes were written before the session was made (see main). */
static int run_prefill(struct run *r)
{
    if (post_request(r, REQ_FULL) != 0)
        return -1;
    if (!r->cfg.selective)
        return 0;
    fill_request(r, REQ_SELECTIVE);
    if (make_profile(r) != 0)
        return -1;
    return post_request(r, REQ_SELECTIVE);
}

/* Decode: clear the destination, expect, then tell the prefill side it may post. */
static int expect_request(struct run *r, int req, double *start)
{
    sg_transfer_options_t topts;
    sg_error_info_t err;

    clear_request(r);
    /* Default options: the decode side follows the paths of the post, learned at the match. */
    sg_transfer_options_init(&topts);
    sg_error_info_init(&err);
    *start = now_s();
    if (check_err(r,
                  sg_transfer_expect(r->session, REQUEST_IDS[req], r->kv, r->table, r->n, r->cfg.tokens, &topts,
                                     &r->xfer[req], &err),
                  "sg_transfer_expect", &err) != 0)
        return -1;
    return send_ready(r, req);
}

static int receive_full(struct run *r)
{
    double start;

    if (expect_request(r, REQ_FULL, &start) != 0)
        return -1;
    if (check_wait(r, sg_transfer_wait(r->xfer[REQ_FULL], r->cfg.timeout_ns), "sg_transfer_wait", r->xfer[REQ_FULL],
                   REQ_FULL) != 0)
        return -1;
    r->full_s = now_s() - start;
    if (verify_request(r, REQ_FULL) != 0)
        return -1;
    progress(r, "%s: every byte checked (%.3f s)", REQUEST_IDS[REQ_FULL], r->full_s);
    return 0;
}

static int receive_selective(struct run *r)
{
    sg_transfer_stats_t stats;
    sg_transfer_t x;
    uint32_t fetch[3];
    uint32_t l;
    double start;

    if (expect_request(r, REQ_SELECTIVE, &start) != 0)
        return -1;
    x = r->xfer[REQ_SELECTIVE];
    for (l = 0; l < r->cfg.layers; l++)
        if (check_wait(r, sg_transfer_wait_layer_state(x, l, SG_LAYER_ESSENTIAL, r->cfg.timeout_ns),
                       "sg_transfer_wait_layer_state(SG_LAYER_ESSENTIAL)", x, REQ_SELECTIVE) != 0)
            return -1;
    fetch[0] = 1;
    fetch[1] = r->n / 2;
    fetch[2] = r->n - 2;
    if (check(r, sg_transfer_fetch(x, 0, fetch, 3), "sg_transfer_fetch") != 0)
        return -1;
    if (check_wait(r, sg_transfer_wait_blocks(x, 0, fetch, 3, r->cfg.timeout_ns), "sg_transfer_wait_blocks", x,
                   REQ_SELECTIVE) != 0)
        return -1;
    /* The speculative path brings whatever the proactive path and the fetch did not. */
    if (check_wait(r, sg_transfer_wait(x, r->cfg.timeout_ns), "sg_transfer_wait", x, REQ_SELECTIVE) != 0)
        return -1;
    if (verify_request(r, REQ_SELECTIVE) != 0)
        return -1;
    sg_transfer_stats_init(&stats);
    if (check(r, sg_transfer_stats(x, &stats), "sg_transfer_stats") != 0)
        return -1;
    progress(r, "%s: every byte checked (%.3f s); bytes proactive %" PRIu64 ", on demand %" PRIu64
             ", speculative %" PRIu64 "; %" PRIu64 " fetch requests",
             REQUEST_IDS[REQ_SELECTIVE], now_s() - start, stats.bytes_proactive, stats.bytes_on_demand,
             stats.bytes_speculative, stats.fetch_requests);
    if (check(r, sg_transfer_release(x), "sg_transfer_release") != 0)
        return -1;
    r->xfer[REQ_SELECTIVE] = NULL;
    return 0;
}

/* The cost of one call through the ABI: a non-blocking query on a live, completed transfer. */
static int measure_calls(struct run *r)
{
    sg_transfer_t x = r->xfer[REQ_FULL];
    uint32_t state = 0;
    sg_status_t st = SG_OK;
    uint64_t i;
    double start;

    start = now_s();
    for (i = 0; i < r->cfg.calls && st == SG_OK; i++)
        st = sg_transfer_layer_state(x, 0, &state);
    if (check(r, st, "sg_transfer_layer_state") != 0)
        return -1;
    r->calls_ns = (now_s() - start) * 1e9 / (double)r->cfg.calls;
    if (!(state & SG_LAYER_READY))
        return fail_named(r, "SG_ERR_INVALID_STATE", "layer 0 of a completed transfer reads state 0x%x", state);
    progress(r, "%" PRIu64 " calls of sg_transfer_layer_state: %.1f ns each", r->cfg.calls, r->calls_ns);
    return 0;
}

/* Request 0's handle stays live (completed, not released) through the selective transfer: --calls
 * measures on it. */
static int run_decode(struct run *r)
{
    if (receive_full(r) != 0)
        return -1;
    if (r->cfg.selective && receive_selective(r) != 0)
        return -1;
    if (r->cfg.calls > 0 && measure_calls(r) != 0)
        return -1;
    if (check(r, sg_transfer_release(r->xfer[REQ_FULL]), "sg_transfer_release") != 0)
        return -1;
    r->xfer[REQ_FULL] = NULL;
    return 0;
}

/* ---- teardown --------------------------------------------------------------------------------
 * Runs on every path, in the reverse order of creation: transfers (they use the pool), profile,
 * session, listener, pool registration, context, then the memory the registration pointed to. On
 * the success path the session was closed gracefully first; on a failure it is destroyed at once,
 * which cancels what is left. */
static void cleanup(struct run *r)
{
    int i;

    for (i = NUM_REQUESTS - 1; i >= 0; i--)
        if (r->xfer[i] != NULL)
            check(r, sg_transfer_release(r->xfer[i]), "sg_transfer_release");
    check(r, sg_profile_destroy(r->profile), "sg_profile_destroy");
    check(r, sg_session_destroy(r->session), "sg_session_destroy");
    check(r, sg_listener_destroy(r->listener), "sg_listener_destroy");
    check(r, sg_kv_deregister(r->kv), "sg_kv_deregister");
    check(r, sg_context_destroy(r->ctx), "sg_context_destroy");
    if (r->planes != NULL)
        for (i = 0; i < (int)(r->cfg.layers * PLANES); i++)
            free(r->planes[i]);
    free(r->planes);
    free(r->k_bases);
    free(r->v_bases);
    free(r->table);
    free(r->ramp);
}

/* The one stdout line. A reason is quoted, so its own quotes and line breaks are replaced. */
static void print_result(const struct run *r)
{
    const char *role = r->cfg.role ? r->cfg.role : "unknown";
    double gbps;
    char reason[sizeof r->reason];
    size_t i;

    if (r->failed) {
        snprintf(reason, sizeof reason, "%s", r->reason);
        for (i = 0; reason[i] != '\0'; i++)
            if (reason[i] == '"')
                reason[i] = '\'';
            else if (reason[i] == '\n' || reason[i] == '\r')
                reason[i] = ' ';
        printf("interop lang=c role=%s result=FAILED reason=\"%s\"\n", role, reason);
        return;
    }
    gbps = r->full_s > 0 ? (double)request_bytes(r) / r->full_s / 1e9 : 0.0;
    printf("interop lang=c role=%s result=ok full=ok selective=%s bytes=%" PRIu64 " full_s=%.6f full_gbps=%.3f "
           "calls_ns=%.1f\n",
           role, r->cfg.selective ? "ok" : "skipped", r->bytes, r->full_s, gbps, r->calls_ns);
}

/* The steps of one side, in order; the first failure stops them (cleanup follows in main). */
static int run_side(struct run *r)
{
    if (alloc_pool(r) != 0)
        return -1;
    /* The prefill side writes request 0 before it has a session, so the decode side's full_s (from
     * its expect) counts the transfer and the ready round trip, not the time the peer took to
     * write its pool. */
    if (r->cfg.prefill)
        fill_request(r, REQ_FULL);
    if (open_context(r) != 0 || open_session(r) != 0)
        return -1;
    if ((r->cfg.prefill ? run_prefill(r) : run_decode(r)) != 0)
        return -1;
    /* Graceful: returns once the peer has read everything this side sent. */
    return check(r, sg_session_close(r->session, r->cfg.timeout_ns), "sg_session_close");
}

int main(int argc, char **argv)
{
    struct run r;
    int parsed;

    memset(&r, 0, sizeof r);
    r.event_fd = -1;
    parsed = parse_args(&r, argc, argv);
    if (parsed == 1)
        return 0;
    if (parsed == 0)
        run_side(&r);
    cleanup(&r);
    print_result(&r);
    return r.failed ? 1 : 0;
}
