/*
 * kv_demo.c: moves a Llama-shaped paged KV cache between a prefill and a decode process with
 * SmartGen, and compares it with a plain TCP stream of the same bytes between the same processes.
 *
 *   prefill (parent)                                   decode (child)
 *   ----------------                                   --------------
 *   TCP listener for the baseline (before the fork)    connect to it
 *   fill the source pool once (timing excluded)        allocate the destination pool
 *   for each provider:
 *     context, SmartGen listener, port ---- pipe ----> context, sg_session_connect
 *     register + export the source pool                register + export the destination pool
 *     for each iteration i:
 *                                      <--- READY ---- sg_transfer_expect("demo-<i>")
 *       post, layer_written 0..L-1, wait               sg_transfer_wait (verify the last one)
 *                                      <--- RESULT --- decode time, mismatches, release
 *       release
 *       TCP: 1 MiB send()s of the same bytes -------> recv() all of it, 1-byte ack
 *     teardown                                         teardown
 *   print the table (medians), exit with the verdict
 *
 * The fork happens before any SmartGen call: a context owns threads and fabric resources that do
 * not follow a fork, so each process makes its own (see examples/c/transfer_pair.c). The parent and
 * the child talk over two pipes (fixed-size messages, each written atomically).
 *
 * Usage: smartgen-kv-demo [--tokens N] [--layers N] [--iters N] [--provider NAME]
 *                         [--scattered | --contiguous] [--seed N] [--json]
 * Exit status: 0 when every step succeeded and decode received exactly the bytes prefill wrote.
 */
#define _POSIX_C_SOURCE 200809L

#include <smartgen/smartgen.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- fixed shape (Llama-3-8B: 8 KV heads of 128, fp16, 16-token blocks) --------------------- */
#define NUM_KV_HEADS 8u
#define HEAD_DIM 128u
#define TOKENS_PER_BLOCK 16u
#define TOKEN_ELEMS (NUM_KV_HEADS * HEAD_DIM)           /* fp16 values of one token in K (or V) */
#define PLANE_ELEMS (TOKENS_PER_BLOCK * TOKEN_ELEMS)    /* fp16 values of one block's K (or V) */

#define WAIT_TIMEOUT_MS 30000u                          /* accept / connect */
#define WAIT_TIMEOUT_NS (30000ull * 1000ull * 1000ull)  /* every transfer wait */
#define CTL_TIMEOUT_MS 120000                           /* one control message (covers a verify) */
#define SOCK_TIMEOUT_S 30                               /* each send()/recv() of the baseline */
#define WATCHDOG_S 300u                                 /* SIGALRM backstop, re-armed every step */
#define TCP_CHUNK (1u << 20)                            /* baseline send() size */
#define MAX_PROVIDERS 2

#define PREFILL_FILL 0x5Au /* bytes outside the request, source side */
#define DECODE_FILL 0xA5u  /* bytes outside the request, destination side */

/* ---- the shared key ---------------------------------------------------------------------------
 * Sessions are authenticated with a pre-shared key. Here both processes come from one fork, so a
 * random key made before the fork is the secret they share; separate hosts would read the same
 * key from a secret store, or name its file in SG_AUTH_KEY_FILE (then auth_key stays NULL and the
 * library reads the file). */
static unsigned char g_auth_key[32];

static int make_auth_key(void)
{
    FILE *f = fopen("/dev/urandom", "rb");
    size_t n = f ? fread(g_auth_key, 1, sizeof g_auth_key, f) : 0;

    if (f) fclose(f);
    return n == sizeof g_auth_key ? 0 : -1;
}

static void use_auth_key(sg_context_options_t *opts)
{
    const char *file = getenv("SG_AUTH_KEY_FILE");

    if (file == NULL || *file == '\0') {
        opts->auth_key = g_auth_key;
        opts->auth_key_len = sizeof g_auth_key;
    }
}

/* ---- configuration, identical in both processes (parsed before the fork) ---------------------- */
typedef struct config {
    uint64_t tokens;
    uint32_t layers;
    uint32_t iters;
    int scattered;
    int json;
    uint64_t seed;
    const char *providers[MAX_PROVIDERS];
    size_t num_providers;
    /* derived */
    uint64_t req_blocks;  /* blocks the request covers */
    uint64_t pool_blocks; /* blocks per layer in each pool */
    uint64_t bytes;       /* payload of one transfer: tokens x layers x K,V x heads x dim x 2 */
} config_t;

static config_t g_cfg;

/* ---- error handling ------------------------------------------------------------------------ */
static const char *g_role = "main";
static volatile pid_t g_child = -1; /* the parent kills and reaps the child when it gives up */

static void die(void)
{
    fflush(stdout);
    if (g_child > 0) {
        kill(g_child, SIGTERM);
        waitpid(g_child, NULL, 0);
        g_child = -1;
    }
    /* _exit: no atexit/static destructors racing with library threads of a live context. */
    _exit(1);
}

static void on_alarm(int sig)
{
    static const char msg[] = "smartgen-kv-demo: watchdog expired, giving up\n";
    ssize_t r;

    (void)sig;
    r = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)r;
    if (g_child > 0)
        kill(g_child, SIGKILL);
    _exit(2);
}

static void watchdog(void)
{
    alarm(WATCHDOG_S);
}

/* Exits with a message unless status is SG_OK. The detail comes from err when given and filled,
 * else from sg_last_error_message(), read before any other SmartGen call can replace it. */
static void check(sg_status_t status, const char *what, const sg_error_info_t *err)
{
    char detail[SG_ERROR_MESSAGE_MAX];

    if (status == SG_OK)
        return;
    if (err != NULL && err->message[0] != '\0')
        snprintf(detail, sizeof detail, "%s", err->message);
    else
        snprintf(detail, sizeof detail, "%s", sg_last_error_message());
    fprintf(stderr, "[%s] %s failed: %s (%d)%s%s\n", g_role, what, sg_status_str(status), (int)status,
            detail[0] ? ": " : "", detail);
    die();
}

/* A transfer wait: SG_ERR_TIMEOUT means the wait's timeout passed (an error here); a transfer error gets
 * the transfer's own detail (errors that happened in the background land there). */
static void check_wait(sg_status_t status, const char *what, sg_transfer_t xfer)
{
    char detail[SG_ERROR_MESSAGE_MAX];
    char msg[SG_ERROR_MESSAGE_MAX];
    sg_status_t xs = SG_OK;

    if (status == SG_OK)
        return;
    if (status == SG_ERR_TIMEOUT) {
        fprintf(stderr, "[%s] %s: still in progress after %u ms\n", g_role, what, WAIT_TIMEOUT_MS);
        die();
    }
    snprintf(detail, sizeof detail, "%s", sg_last_error_message());
    msg[0] = '\0';
    if (sg_transfer_status(xfer, &xs, msg, sizeof msg) == SG_OK && msg[0] != '\0')
        snprintf(detail, sizeof detail, "%s", msg);
    fprintf(stderr, "[%s] %s failed: %s (%d)%s%s\n", g_role, what, sg_status_str(status), (int)status,
            detail[0] ? ": " : "", detail);
    die();
}

static void fail(const char *what)
{
    fprintf(stderr, "[%s] %s\n", g_role, what);
    die();
}

static void fail_errno(const char *what)
{
    fprintf(stderr, "[%s] %s: %s\n", g_role, what, strerror(errno));
    die();
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n);
    if (p == NULL) {
        fprintf(stderr, "[%s] out of memory (%lu bytes)\n", g_role, (unsigned long)n);
        die();
    }
    return p;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- data pattern -------------------------------------------------------------------------- */
static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* The fp16 bit patterns of token `token`, K (kv 0) or V (kv 1), layer `layer`: TOKEN_ELEMS values. */
static void token_pattern(uint32_t layer, uint32_t kv, uint64_t token, uint16_t *out)
{
    uint32_t h, d;

    for (h = 0; h < NUM_KV_HEADS; h++) {
        uint64_t x = mix64(g_cfg.seed * 0x9e3779b97f4a7c15ull ^ ((uint64_t)(layer * 2u + kv) << 40) ^
                           (token << 8) ^ h);
        for (d = 0; d < HEAD_DIM; d++)
            out[h * HEAD_DIM + d] = (uint16_t)((x >> 16) + d * 0x9e37u);
    }
}

/* xorshift64* random numbers for the block tables. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545f4914f6cdd1dull;
}

/* A block table of g_cfg.req_blocks ids in a pool of g_cfg.pool_blocks: the first req_blocks of a
 * random permutation when scattered, 0..req_blocks-1 otherwise. */
static void make_table(uint32_t *table, uint64_t seed)
{
    uint64_t n = g_cfg.pool_blocks, i, s = mix64(seed) | 1u;
    uint32_t *perm = xmalloc((size_t)n * sizeof *perm);

    for (i = 0; i < n; i++)
        perm[i] = (uint32_t)i;
    if (g_cfg.scattered) {
        for (i = n - 1; i > 0; i--) {
            uint64_t j = rng_next(&s) % (i + 1);
            uint32_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
    }
    memcpy(table, perm, (size_t)g_cfg.req_blocks * sizeof *table);
    free(perm);
}

/* ---- the pools ------------------------------------------------------------------------------- */
typedef struct pool {
    void **k; /* num_layers pointers, each pool_blocks * PLANE_ELEMS fp16 values */
    void **v;
    size_t layer_bytes;
} pool_t;

static void pool_alloc(pool_t *p, unsigned char fill)
{
    uint32_t l;

    p->layer_bytes = (size_t)g_cfg.pool_blocks * PLANE_ELEMS * sizeof(uint16_t);
    p->k = xmalloc(g_cfg.layers * sizeof *p->k);
    p->v = xmalloc(g_cfg.layers * sizeof *p->v);
    for (l = 0; l < g_cfg.layers; l++) {
        p->k[l] = xmalloc(p->layer_bytes);
        p->v[l] = xmalloc(p->layer_bytes);
        memset(p->k[l], fill, p->layer_bytes); /* also faults every page in before any timing */
        memset(p->v[l], fill, p->layer_bytes);
    }
}

static void pool_fill(pool_t *p, unsigned char fill)
{
    uint32_t l;

    for (l = 0; l < g_cfg.layers; l++) {
        memset(p->k[l], fill, p->layer_bytes);
        memset(p->v[l], fill, p->layer_bytes);
    }
}

static void pool_free(pool_t *p)
{
    uint32_t l;

    for (l = 0; l < g_cfg.layers; l++) {
        free(p->k[l]);
        free(p->v[l]);
    }
    free(p->k);
    free(p->v);
}

static uint16_t *token_row(void *plane_base, const uint32_t *table, uint64_t token)
{
    uint16_t *base = plane_base;
    return base + (size_t)table[token / TOKENS_PER_BLOCK] * PLANE_ELEMS +
           (size_t)(token % TOKENS_PER_BLOCK) * TOKEN_ELEMS;
}

static sg_kv_handle_t pool_register(sg_context_t ctx, pool_t *p)
{
    sg_kv_layout_t layout;
    sg_error_info_t err;
    sg_kv_handle_t kv = NULL;

    sg_kv_layout_init(&layout);
    layout.num_layers = g_cfg.layers;
    layout.num_kv_heads = NUM_KV_HEADS;
    layout.head_dim = HEAD_DIM;
    layout.tokens_per_block = TOKENS_PER_BLOCK;
    layout.num_blocks = g_cfg.pool_blocks;
    layout.dtype = SG_DTYPE_FP16;
    layout.packing = SG_KV_SEPARATE;
    layout.block_order = SG_BLOCK_TOKEN_MAJOR;
    layout.mem_kind = SG_MEM_HOST;
    layout.layer_k_base = p->k;
    layout.layer_v_base = p->v;
    layout.layer_base_count = g_cfg.layers;
    layout.block_stride_bytes = 0;
    sg_error_info_init(&err);
    check(sg_kv_layout_validate(&layout, &err), "sg_kv_layout_validate", &err);
    sg_error_info_init(&err);
    check(sg_kv_register(ctx, &layout, &kv, &err), "sg_kv_register", &err);
    return kv;
}

/* Checks every token of every layer (K and V) against the pattern, and that the destination
 * blocks outside the request still hold DECODE_FILL. Returns the number of mismatches. */
static uint64_t verify(pool_t *p, const uint32_t *table)
{
    uint16_t want[TOKEN_ELEMS];
    unsigned char *in_request = xmalloc((size_t)g_cfg.pool_blocks);
    uint64_t bad = 0, t, b, i;
    uint32_t l, kv;

    memset(in_request, 0, (size_t)g_cfg.pool_blocks);
    for (i = 0; i < g_cfg.req_blocks; i++)
        in_request[table[i]] = 1;
    for (l = 0; l < g_cfg.layers; l++) {
        for (kv = 0; kv < 2; kv++) {
            void *base = kv ? p->v[l] : p->k[l];
            for (t = 0; t < g_cfg.tokens; t++) {
                token_pattern(l, kv, t, want);
                if (memcmp(token_row(base, table, t), want, sizeof want) != 0 && bad++ < 5)
                    fprintf(stderr, "[decode] layer %u %c token %llu: bytes differ from the source\n", l,
                            kv ? 'V' : 'K', (unsigned long long)t);
            }
            for (b = 0; b < g_cfg.pool_blocks; b++) {
                const unsigned char *blk;
                size_t j;
                if (in_request[b])
                    continue;
                blk = (const unsigned char *)base + (size_t)b * PLANE_ELEMS * sizeof(uint16_t);
                for (j = 0; j < PLANE_ELEMS * sizeof(uint16_t); j++) {
                    if (blk[j] != DECODE_FILL) {
                        if (bad++ < 5)
                            fprintf(stderr, "[decode] layer %u %c block %llu (not in the request) was written\n",
                                    l, kv ? 'V' : 'K', (unsigned long long)b);
                        break;
                    }
                }
            }
        }
    }
    free(in_request);
    return bad;
}

/* ---- control channel: fixed-size messages over a pipe pair --------------------------------- */
enum msg_type {
    MSG_HELLO = 1,     /* prefill -> decode: SmartGen listener port for provider `iter` */
    MSG_READY = 2,     /* decode -> prefill: expect of demo-<iter> made */
    MSG_RESULT = 3,    /* decode -> prefill: decode time, mismatches, verified flag */
    MSG_TCP_GO = 4,    /* prefill -> decode: baseline iteration `iter` starts */
    MSG_TCP_READY = 5  /* decode -> prefill: receiving */
};

typedef struct ctl_msg {
    uint32_t type;
    uint32_t iter;
    uint32_t port;
    uint32_t verified; /* RESULT: 1 when this iteration's bytes were checked */
    uint64_t ns;       /* RESULT: decode expect -> complete */
    uint64_t bad;      /* RESULT: mismatches found (0 when not verified) */
    uint64_t bytes;    /* RESULT: decode-side stats.bytes */
} ctl_msg_t;

static int g_ctl_in = -1, g_ctl_out = -1;

static void ctl_send(uint32_t type, uint32_t iter, const ctl_msg_t *body)
{
    ctl_msg_t m;
    ssize_t n;

    if (body != NULL)
        m = *body;
    else
        memset(&m, 0, sizeof m);
    m.type = type;
    m.iter = iter;
    do {
        n = write(g_ctl_out, &m, sizeof m); /* < PIPE_BUF: whole or not at all */
    } while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof m)
        fail_errno("control channel write (peer gone?)");
}

static ctl_msg_t ctl_recv(uint32_t type, uint32_t iter)
{
    ctl_msg_t m;
    size_t got = 0;

    while (got < sizeof m) {
        struct pollfd pfd;
        ssize_t n;
        int r;

        pfd.fd = g_ctl_in;
        pfd.events = POLLIN;
        pfd.revents = 0;
        r = poll(&pfd, 1, CTL_TIMEOUT_MS);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            fail_errno("control channel poll");
        if (r == 0)
            fail("control channel: no message from the other process in time");
        n = read(g_ctl_in, (char *)&m + got, sizeof m - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            fail_errno("control channel read");
        if (n == 0)
            fail("control channel closed: the other process failed (see its messages above)");
        got += (size_t)n;
    }
    if (m.type != type || m.iter != iter) {
        fprintf(stderr, "[%s] control channel out of step: got message %u/%u, expected %u/%u\n", g_role,
                m.type, m.iter, type, iter);
        die();
    }
    return m;
}

/* ---- TCP baseline ---------------------------------------------------------------------------- */
static void set_sock_timeouts(int fd)
{
    struct timeval tv;

    tv.tv_sec = SOCK_TIMEOUT_S;
    tv.tv_usec = 0;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0)
        fail_errno("setsockopt(SO_RCVTIMEO/SO_SNDTIMEO)");
}

static void send_all(int fd, const unsigned char *buf, uint64_t len, size_t chunk)
{
    uint64_t off = 0;

    while (off < len) {
        size_t n = (size_t)(len - off < chunk ? len - off : chunk);
        ssize_t w = send(fd, buf + off, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            fail_errno(errno == EAGAIN || errno == EWOULDBLOCK ? "baseline send() timed out" : "baseline send()");
        off += (uint64_t)w;
    }
}

static void recv_all(int fd, unsigned char *buf, uint64_t len)
{
    uint64_t off = 0;

    while (off < len) {
        ssize_t r = recv(fd, buf + off, (size_t)(len - off), 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            fail_errno(errno == EAGAIN || errno == EWOULDBLOCK ? "baseline recv() timed out" : "baseline recv()");
        if (r == 0)
            fail("baseline connection closed by the peer");
        off += (uint64_t)r;
    }
}

/* ---- medians and output --------------------------------------------------------------------- */
static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const double *v, size_t n)
{
    double *s = xmalloc(n * sizeof *s);
    double m;

    memcpy(s, v, n * sizeof *s);
    qsort(s, n, sizeof *s, cmp_double);
    m = n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2.0;
    free(s);
    return m;
}

typedef struct result {
    char provider[64];
    double sg_ms, sg_decode_ms, tcp_ms; /* medians */
    double rma_ops, staged_bytes, moved_bytes;
    int verified;
} result_t;

static void json_string(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static void print_json_row(const result_t *r, int smartgen)
{
    double ms = smartgen ? r->sg_ms : r->tcp_ms;

    printf("{\"provider\":");
    json_string(r->provider);
    printf(",\"path\":\"%s\",\"bytes\":%llu,\"tokens\":%llu,\"layers\":%u,\"kv_heads\":%u,\"head_dim\":%u,"
           "\"tokens_per_block\":%u,\"dtype\":\"fp16\",\"scattered\":%s,\"iterations\":%u,\"time_ms\":%.3f,",
           smartgen ? "smartgen" : "tcp-raw", (unsigned long long)g_cfg.bytes, (unsigned long long)g_cfg.tokens,
           g_cfg.layers, NUM_KV_HEADS, HEAD_DIM, TOKENS_PER_BLOCK, g_cfg.scattered ? "true" : "false",
           g_cfg.iters, ms);
    printf("\"gb_per_s\":%.3f,\"vs_tcp_stream\":%.3f", (double)g_cfg.bytes / 1e9 / (ms / 1e3),
           smartgen ? r->tcp_ms / r->sg_ms : 1.0);
    if (smartgen)
        printf(",\"decode_time_ms\":%.3f,\"rma_ops\":%.0f,\"staged_bytes\":%.0f,\"moved_bytes\":%.0f,"
               "\"verified\":%s",
               r->sg_decode_ms, r->rma_ops, r->staged_bytes, r->moved_bytes, r->verified ? "true" : "false");
    printf("}\n");
}

static void print_table(const result_t *res, size_t n)
{
    double mib = (double)g_cfg.bytes / 1048576.0;
    size_t i;

    printf("SmartGen KV demo: Llama-3-8B-shaped KV (%u layers x %u KV heads x %u dim, fp16, %u-token blocks), "
           "%llu tokens = %.1f MiB per transfer, %s block tables, %u iteration%s (medians)\n",
           g_cfg.layers, NUM_KV_HEADS, HEAD_DIM, TOKENS_PER_BLOCK, (unsigned long long)g_cfg.tokens, mib,
           g_cfg.scattered ? "scattered" : "contiguous", g_cfg.iters, g_cfg.iters == 1 ? "" : "s");
    printf("%-13s %-8s %-11s %9s %10s %7s %13s %8s %10s %s\n", "provider", "path", "bytes", "time(ms)",
           "decode(ms)", "GB/s", "vs TCP stream", "RMA ops", "staged MiB", "verified");
    for (i = 0; i < n; i++) {
        const result_t *r = &res[i];
        printf("%-13s %-8s %7.1f MiB %9.2f %10.2f %7.2f %12.2fx %8.0f %10.1f %s\n", r->provider, "smartgen", mib,
               r->sg_ms, r->sg_decode_ms, (double)g_cfg.bytes / 1e9 / (r->sg_ms / 1e3), r->tcp_ms / r->sg_ms,
               r->rma_ops, r->staged_bytes / 1048576.0, r->verified ? "yes" : "NO");
        printf("%-13s %-8s %7.1f MiB %9.2f %10s %7.2f %12.2fx %8s %10s %s\n", r->provider, "tcp-raw", mib, r->tcp_ms,
               "-", (double)g_cfg.bytes / 1e9 / (r->tcp_ms / 1e3), 1.0, "-", "-", "-");
    }
}

/* ---- decode: the child ------------------------------------------------------------------------ */
static int run_decode(uint16_t tcp_port)
{
    pool_t pool;
    unsigned char *rbuf;
    uint32_t *table = xmalloc((size_t)g_cfg.req_blocks * sizeof *table);
    struct sockaddr_in sa;
    int sock, any_bad = 0;
    size_t pi;
    uint32_t i;
    unsigned char ack = 1;

    g_role = "decode";

    /* Baseline connection, made once. */
    sock = socket(AF_INET, SOCK_STREAM, 0);
    if (sock < 0)
        fail_errno("socket");
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons(tcp_port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(sock, (struct sockaddr *)&sa, sizeof sa) != 0)
        fail_errno("baseline connect to 127.0.0.1");
    set_sock_timeouts(sock);

    pool_alloc(&pool, DECODE_FILL);
    rbuf = xmalloc((size_t)g_cfg.bytes);
    memset(rbuf, 0, (size_t)g_cfg.bytes);

    for (pi = 0; pi < g_cfg.num_providers; pi++) {
        sg_context_options_t copts;
        sg_session_options_t sopts;
        sg_error_info_t err;
        sg_context_t ctx = NULL;
        sg_session_t session = NULL;
        sg_kv_handle_t kv;
        ctl_msg_t hello;

        watchdog();
        hello = ctl_recv(MSG_HELLO, (uint32_t)pi);

        sg_context_options_init(&copts);
        copts.provider = g_cfg.providers[pi];
        use_auth_key(&copts);
        sg_error_info_init(&err);
        check(sg_context_create(&copts, &ctx, &err), "sg_context_create", &err);
        sg_session_options_init(&sopts);
        sg_error_info_init(&err);
        check(sg_session_connect(ctx, "127.0.0.1", (uint16_t)hello.port, &sopts, WAIT_TIMEOUT_MS * 1000000ull, &session, &err),
              "sg_session_connect", &err);
        kv = pool_register(ctx, &pool);
        check(sg_session_export_kv(session, kv), "sg_session_export_kv", NULL);

        for (i = 0; i < g_cfg.iters; i++) {
            sg_transfer_options_t topts;
            sg_transfer_stats_t stats;
            sg_transfer_t xfer = NULL;
            ctl_msg_t res;
            char rid[32];
            int last = i + 1 == g_cfg.iters;
            uint64_t t0, t1;

            watchdog();
            /* A fresh destination block table every iteration. Before the verified (last) one, every
             * byte of the pool is reset so nothing left by an earlier transfer can pass. */
            make_table(table, g_cfg.seed ^ (0xdec0de00ull + pi * 1000u + i));
            if (last)
                pool_fill(&pool, DECODE_FILL);
            snprintf(rid, sizeof rid, "demo-%u", i);
            sg_transfer_options_init(&topts);
            sg_error_info_init(&err);
            t0 = now_ns();
            check(sg_transfer_expect(session, rid, kv, table, (size_t)g_cfg.req_blocks, g_cfg.tokens, &topts, &xfer,
                                     &err),
                  "sg_transfer_expect", &err);
            ctl_send(MSG_READY, i, NULL);
            check_wait(sg_transfer_wait(xfer, WAIT_TIMEOUT_NS), "sg_transfer_wait (decode)", xfer);
            t1 = now_ns();

            memset(&res, 0, sizeof res);
            sg_transfer_stats_init(&stats);
            check(sg_transfer_stats(xfer, &stats), "sg_transfer_stats", NULL);
            check(sg_transfer_release(xfer), "sg_transfer_release", NULL);
            res.ns = t1 - t0;
            res.bytes = stats.bytes;
            if (last) {
                res.verified = 1;
                res.bad = verify(&pool, table);
                if (res.bad != 0) {
                    fprintf(stderr, "[decode] %s over %s: %llu mismatches\n", rid, g_cfg.providers[pi],
                            (unsigned long long)res.bad);
                    any_bad = 1;
                }
            }
            ctl_send(MSG_RESULT, i, &res);

            /* Baseline: receive the same number of bytes, then a 1-byte ack. */
            (void)ctl_recv(MSG_TCP_GO, i);
            ctl_send(MSG_TCP_READY, i, NULL);
            recv_all(sock, rbuf, g_cfg.bytes);
            send_all(sock, &ack, 1, 1);
        }

        check(sg_kv_deregister(kv), "sg_kv_deregister", NULL);
        check(sg_session_destroy(session), "sg_session_destroy", NULL);
        check(sg_context_destroy(ctx), "sg_context_destroy", NULL);
    }

    close(sock);
    free(rbuf);
    free(table);
    pool_free(&pool);
    return any_bad ? 1 : 0;
}

/* ---- prefill: the parent ---------------------------------------------------------------------- */
static int run_prefill(int tcp_listen_fd)
{
    pool_t pool;
    unsigned char *sbuf;
    uint32_t *table = xmalloc((size_t)g_cfg.req_blocks * sizeof *table);
    result_t res[MAX_PROVIDERS];
    double *sg_ms = xmalloc(g_cfg.iters * sizeof(double)), *dec_ms = xmalloc(g_cfg.iters * sizeof(double));
    double *tcp_ms = xmalloc(g_cfg.iters * sizeof(double)), *ops = xmalloc(g_cfg.iters * sizeof(double));
    double *staged = xmalloc(g_cfg.iters * sizeof(double)), *moved = xmalloc(g_cfg.iters * sizeof(double));
    struct pollfd pfd;
    int sock, r, wstatus = 0, ok = 1;
    size_t pi, j;
    uint64_t t, b;
    uint32_t l, kv, i;
    pid_t w;

    g_role = "prefill";

    /* Baseline connection, accepted once (the child connects right after the fork). */
    pfd.fd = tcp_listen_fd;
    pfd.events = POLLIN;
    pfd.revents = 0;
    do {
        r = poll(&pfd, 1, (int)WAIT_TIMEOUT_MS);
    } while (r < 0 && errno == EINTR);
    if (r <= 0)
        fail("baseline: decode did not connect");
    sock = accept(tcp_listen_fd, NULL, NULL);
    if (sock < 0)
        fail_errno("baseline accept");
    close(tcp_listen_fd);
    set_sock_timeouts(sock);

    /* The source pool: the request's tokens hold the pattern (as a prefill forward pass would have
     * written them), every other byte PREFILL_FILL. Written once, before any timing. */
    fprintf(stderr, "[demo] preparing %.1f MiB of source KV and the baseline buffer ...\n",
            (double)g_cfg.bytes / 1048576.0);
    pool_alloc(&pool, PREFILL_FILL);
    make_table(table, g_cfg.seed ^ 0x9ef111ull);
    for (l = 0; l < g_cfg.layers; l++)
        for (kv = 0; kv < 2; kv++)
            for (t = 0; t < g_cfg.tokens; t++)
                token_pattern(l, kv, t, token_row(kv ? pool.v[l] : pool.k[l], table, t));
    sbuf = xmalloc((size_t)g_cfg.bytes);
    for (b = 0; b < g_cfg.bytes; b++)
        sbuf[b] = (unsigned char)(b * 131u + (b >> 20));

    for (pi = 0; pi < g_cfg.num_providers; pi++) {
        sg_context_options_t copts;
        sg_session_options_t sopts;
        sg_error_info_t err;
        sg_context_t ctx = NULL;
        sg_listener_t listener = NULL;
        sg_session_t session = NULL;
        sg_kv_handle_t kvh;
        ctl_msg_t hello;
        uint16_t port = 0;
        int verified = 1;

        watchdog();
        sg_context_options_init(&copts);
        copts.provider = g_cfg.providers[pi];
        use_auth_key(&copts);
        sg_error_info_init(&err);
        check(sg_context_create(&copts, &ctx, &err), "sg_context_create", &err);
        sg_error_info_init(&err);
        check(sg_listener_create(ctx, "127.0.0.1", 0, &listener, &err), "sg_listener_create", &err);
        check(sg_listener_port(listener, &port), "sg_listener_port", NULL);
        memset(&hello, 0, sizeof hello);
        hello.port = port;
        ctl_send(MSG_HELLO, (uint32_t)pi, &hello);
        sg_session_options_init(&sopts);
        sg_error_info_init(&err);
        check(sg_session_accept(listener, &sopts, WAIT_TIMEOUT_MS * 1000000ull, &session, &err), "sg_session_accept", &err);
        check(sg_listener_destroy(listener), "sg_listener_destroy", NULL);
        check(sg_session_provider(session, res[pi].provider, sizeof res[pi].provider), "sg_session_provider",
              NULL);
        kvh = pool_register(ctx, &pool);
        check(sg_session_export_kv(session, kvh), "sg_session_export_kv", NULL);

        for (i = 0; i < g_cfg.iters; i++) {
            sg_transfer_options_t topts;
            sg_transfer_stats_t stats;
            sg_transfer_t xfer = NULL;
            ctl_msg_t dres;
            char rid[32];
            uint64_t t0, t1;
            unsigned char ack = 0;

            watchdog();
            fprintf(stderr, "[demo] %s: iteration %u/%u ...\n", res[pi].provider, i + 1, g_cfg.iters);

            /* SmartGen: post with layer streaming, as a prefill engine marks each layer written. */
            snprintf(rid, sizeof rid, "demo-%u", i);
            (void)ctl_recv(MSG_READY, i);
            sg_transfer_options_init(&topts);
            topts.flags = 0;
            sg_error_info_init(&err);
            t0 = now_ns();
            check(sg_transfer_post(session, rid, kvh, table, (size_t)g_cfg.req_blocks, g_cfg.tokens, &topts, &xfer,
                                   &err),
                  "sg_transfer_post", &err);
            for (l = 0; l < g_cfg.layers; l++)
                check(sg_transfer_layer_written(xfer, l, NULL), "sg_transfer_layer_written", NULL);
            check_wait(sg_transfer_wait(xfer, WAIT_TIMEOUT_NS), "sg_transfer_wait (prefill)", xfer);
            t1 = now_ns();
            sg_transfer_stats_init(&stats);
            check(sg_transfer_stats(xfer, &stats), "sg_transfer_stats", NULL);
            dres = ctl_recv(MSG_RESULT, i);
            check(sg_transfer_release(xfer), "sg_transfer_release", NULL);
            sg_ms[i] = (double)(t1 - t0) / 1e6;
            dec_ms[i] = (double)dres.ns / 1e6;
            ops[i] = (double)stats.rma_ops;
            staged[i] = (double)stats.staged_bytes;
            moved[i] = (double)stats.bytes;
            if (dres.verified && dres.bad != 0)
                verified = 0;

            /* Baseline: the same bytes as one TCP stream in 1 MiB send()s, until decode's ack. */
            ctl_send(MSG_TCP_GO, i, NULL);
            (void)ctl_recv(MSG_TCP_READY, i);
            t0 = now_ns();
            send_all(sock, sbuf, g_cfg.bytes, TCP_CHUNK);
            recv_all(sock, &ack, 1);
            t1 = now_ns();
            tcp_ms[i] = (double)(t1 - t0) / 1e6;
            fprintf(stderr, "[demo] %s: iteration %u/%u: smartgen %.1f ms (decode %.1f ms), tcp stream %.1f ms%s\n",
                    res[pi].provider, i + 1, g_cfg.iters, sg_ms[i], dec_ms[i], tcp_ms[i],
                    dres.verified ? (dres.bad == 0 ? ", verified" : ", VERIFY FAILED") : "");
        }

        check(sg_kv_deregister(kvh), "sg_kv_deregister", NULL);
        check(sg_session_destroy(session), "sg_session_destroy", NULL);
        check(sg_context_destroy(ctx), "sg_context_destroy", NULL);

        res[pi].sg_ms = median(sg_ms, g_cfg.iters);
        res[pi].sg_decode_ms = median(dec_ms, g_cfg.iters);
        res[pi].tcp_ms = median(tcp_ms, g_cfg.iters);
        res[pi].rma_ops = median(ops, g_cfg.iters);
        res[pi].staged_bytes = median(staged, g_cfg.iters);
        res[pi].moved_bytes = median(moved, g_cfg.iters);
        res[pi].verified = verified;
        if (!verified)
            ok = 0;
    }

    close(sock);

    do {
        w = waitpid(g_child, &wstatus, 0);
    } while (w < 0 && errno == EINTR);
    g_child = -1;
    if (w < 0) {
        perror("[prefill] waitpid");
        ok = 0;
    } else if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
        fprintf(stderr, "[prefill] decode process failed (%s %d)\n",
                WIFEXITED(wstatus) ? "exit status" : "signal",
                WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : WTERMSIG(wstatus));
        ok = 0;
    }

    if (g_cfg.json) {
        for (j = 0; j < g_cfg.num_providers; j++) {
            print_json_row(&res[j], 1);
            print_json_row(&res[j], 0);
        }
    } else {
        print_table(res, g_cfg.num_providers);
    }
    if (!ok)
        fprintf(stderr, "[demo] FAILED: decode did not receive exactly the bytes prefill wrote\n");

    free(sbuf);
    free(table);
    free(sg_ms);
    free(dec_ms);
    free(tcp_ms);
    free(ops);
    free(staged);
    free(moved);
    pool_free(&pool);
    return ok ? 0 : 1;
}

/* ---- main ---------------------------------------------------------------------------------- */
static void usage(FILE *out, const char *argv0)
{
    fprintf(out,
            "usage: %s [options]\n"
            "  Moves a Llama-3-8B-shaped paged KV cache (8 KV heads x 128 dim, fp16, 16-token blocks,\n"
            "  K and V separate) from a prefill process to a decode process with SmartGen, and the same\n"
            "  bytes over a plain TCP stream between the same processes, and prints medians.\n"
            "  --tokens N       tokens per transfer (default 4096)\n"
            "  --layers N       layers (default 32)\n"
            "  --iters N        iterations per provider (default 3)\n"
            "  --provider NAME  one provider (\"tcp\", \"shm\", ...); default: tcp, then shm\n"
            "  --scattered      random block tables in pools of twice the blocks needed (default)\n"
            "  --contiguous     block ids 0..n-1 on both sides\n"
            "  --seed N         seed of the data pattern and the block tables (default 1)\n"
            "  --json           one JSON object per row instead of the table\n",
            argv0);
}

static int parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
    char *end = NULL;
    unsigned long long v;

    if (s == NULL || *s == '\0' || *s == '-')
        return 0;
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0' || v < min || v > max)
        return 0;
    *out = v;
    return 1;
}

int main(int argc, char **argv)
{
    int to_child[2], to_parent[2];
    int lfd, i;
    struct sockaddr_in sa;
    socklen_t salen = sizeof sa;
    struct sigaction act;
    uint64_t v;
    pid_t pid;

    memset(&g_cfg, 0, sizeof g_cfg);
    g_cfg.tokens = 4096;
    g_cfg.layers = 32;
    g_cfg.iters = 3;
    g_cfg.scattered = 1;
    g_cfg.seed = 1;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--tokens") == 0 && parse_u64(val, 1, 1u << 24, &v)) {
            g_cfg.tokens = v;
            i++;
        } else if (strcmp(a, "--layers") == 0 && parse_u64(val, 1, 1024, &v)) {
            g_cfg.layers = (uint32_t)v;
            i++;
        } else if (strcmp(a, "--iters") == 0 && parse_u64(val, 1, 1000, &v)) {
            g_cfg.iters = (uint32_t)v;
            i++;
        } else if (strcmp(a, "--seed") == 0 && parse_u64(val, 0, UINT64_MAX, &v)) {
            g_cfg.seed = v;
            i++;
        } else if (strcmp(a, "--provider") == 0 && val != NULL && val[0] != '\0') {
            g_cfg.providers[0] = val;
            g_cfg.num_providers = 1;
            i++;
        } else if (strcmp(a, "--scattered") == 0) {
            g_cfg.scattered = 1;
        } else if (strcmp(a, "--contiguous") == 0 || strcmp(a, "--no-scattered") == 0) {
            g_cfg.scattered = 0;
        } else if (strcmp(a, "--json") == 0) {
            g_cfg.json = 1;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout, argv[0]);
            return 0;
        } else {
            fprintf(stderr, "%s: bad or incomplete option '%s'\n", argv[0], a);
            usage(stderr, argv[0]);
            return 2;
        }
    }
    if (g_cfg.num_providers == 0) {
        g_cfg.providers[0] = "tcp";
        g_cfg.providers[1] = "shm";
        g_cfg.num_providers = 2;
    }
    g_cfg.req_blocks = (g_cfg.tokens + TOKENS_PER_BLOCK - 1) / TOKENS_PER_BLOCK;
    g_cfg.pool_blocks = g_cfg.scattered ? 2 * g_cfg.req_blocks : g_cfg.req_blocks;
    g_cfg.bytes = g_cfg.tokens * g_cfg.layers * 2u * TOKEN_ELEMS * sizeof(uint16_t);
    if (g_cfg.pool_blocks > UINT32_MAX || g_cfg.bytes > ((uint64_t)1 << 40)) {
        fprintf(stderr, "%s: --tokens/--layers too large\n", argv[0]);
        return 2;
    }

    setvbuf(stdout, NULL, _IOLBF, 0);
    memset(&act, 0, sizeof act);
    act.sa_handler = on_alarm;
    sigemptyset(&act.sa_mask);
    if (sigaction(SIGALRM, &act, NULL) != 0) {
        perror("sigaction");
        return 1;
    }
    act.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &act, NULL);
    watchdog();

    /* Plain sockets and pipes only before the fork: no SmartGen call yet (see the top). */
    if (make_auth_key() != 0) {
        fprintf(stderr, "cannot read /dev/urandom for the session key\n");
        return 1;
    }
    if (pipe(to_child) != 0 || pipe(to_parent) != 0) {
        perror("pipe");
        return 1;
    }
    lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0) {
        perror("socket");
        return 1;
    }
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = 0;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(lfd, 1) != 0 ||
        getsockname(lfd, (struct sockaddr *)&sa, &salen) != 0) {
        perror("baseline listener on 127.0.0.1");
        return 1;
    }

    fflush(NULL);
    pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) {
        close(lfd);
        close(to_child[1]);
        close(to_parent[0]);
        g_ctl_in = to_child[0];
        g_ctl_out = to_parent[1];
        watchdog(); /* alarms are not inherited */
        return run_decode(ntohs(sa.sin_port));
    }
    g_child = pid;
    close(to_child[0]);
    close(to_parent[1]);
    g_ctl_in = to_parent[0];
    g_ctl_out = to_child[1];
    return run_prefill(lfd);
}
