/*
 * transfer_pair.c: the smallest complete SmartGen transfer, in two processes on one host.
 *
 *   prefill (parent)                              decode (child)
 *   ----------------                              --------------
 *   context, listener on 127.0.0.1:0
 *   send the port down a pipe  ------------------> read the port
 *                                                 context (its own)
 *   sg_session_accept  <--------- bootstrap ------ sg_session_connect
 *   register + export the source pool             register + export the destination pool
 *   sg_transfer_post("req-1", blocks A)           sg_transfer_expect("req-1", blocks B)
 *   sg_transfer_layer_written(0), (1), ...        sg_transfer_wait_layer(0), (1), ...
 *   sg_transfer_wait                              sg_transfer_wait, then check every byte
 *   print stats, waitpid, exit with the child's verdict
 *
 * Both sides use the same layout (2 layers, 2 KV heads, head_dim 64, 16 tokens per block, fp16,
 * K and V in separate pools of 32 blocks per layer) but put the request's tokens in different
 * blocks: the runtime maps prefill's block table onto decode's.
 *
 * Why the fork happens before any SmartGen call: a context owns threads (the progress thread),
 * sockets and fabric resources (possibly memory pinned for RDMA). A child forked from a process
 * that holds one inherits copies of those fds and mappings but none of the threads, and may only
 * call async-signal-safe functions until it execs. So this program forks first, while it is still
 * single-threaded and owns no SmartGen object, and each process creates its own context afterwards;
 * the parent tells the child the listener's port through a pipe.
 *
 * Usage: transfer_pair [--provider NAME]     (NAME as sg_context_options_t.provider; default auto)
 * Exit status: 0 when decode received exactly the bytes prefill wrote, 1 otherwise.
 */
#define _POSIX_C_SOURCE 200809L

#include <smartgen/smartgen.h>

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- layout shared by both sides ---------------------------------------------------------- */
#define NUM_LAYERS 2u
#define NUM_KV_HEADS 2u
#define HEAD_DIM 64u
#define TOKENS_PER_BLOCK 16u
#define POOL_BLOCKS 32u /* blocks per layer in each pool */
#define NUM_TOKENS 100u /* 7 blocks: 6 full, the last holds 4 tokens */
#define NUM_BLOCKS ((NUM_TOKENS + TOKENS_PER_BLOCK - 1u) / TOKENS_PER_BLOCK)

/* Elements (uint16_t, fp16 bit patterns) in one token row of a block and in one K or V plane. */
#define TOKEN_ELEMS (NUM_KV_HEADS * HEAD_DIM)
#define PLANE_ELEMS (TOKENS_PER_BLOCK * TOKEN_ELEMS)
#define POOL_ELEMS ((size_t)POOL_BLOCKS * PLANE_ELEMS)

/* Where the request's blocks live on each side: same tokens, different (unordered) block ids. */
static const uint32_t PREFILL_BLOCKS[NUM_BLOCKS] = {1, 2, 20, 21, 7, 30, 4};
static const uint32_t DECODE_BLOCKS[NUM_BLOCKS] = {5, 3, 9, 0, 31, 17, 12};
/* Compile-time guard: the tables above must list exactly NUM_BLOCKS ids (C99 has no static_assert). */
typedef char block_tables_match_num_blocks[NUM_BLOCKS == 7u ? 1 : -1];

#define REQUEST_ID "req-1"
#define TIMEOUT_MS 5000u                           /* accept / connect */
#define TIMEOUT_NS (5000ull * 1000ull * 1000ull)   /* every transfer wait */
#define PORT_PIPE_TIMEOUT_MS 10000                 /* child waiting for the parent's port */
#define WATCHDOG_S 60u                             /* last resort: SIGALRM ends a stuck process */

/* Fill values outside the request, so a block written where it should not be is noticed. */
#define PREFILL_FILL 0xDEADu
#define DECODE_FILL 0xBEEFu

/* The value of element `elem` (0..TOKEN_ELEMS) of token `token`, in K (kv = 0) or V (kv = 1) of
 * layer `layer`. Any function of the four would do; this one differs in every argument. */
static uint16_t pattern(uint32_t layer, uint32_t kv, uint32_t token, uint32_t elem)
{
    uint32_t x = layer * 0x9E37u + kv * 0x7F4Bu + token * 0x0131u + elem * 0x0007u;
    return (uint16_t)((x ^ (x >> 7)) & 0xFFFFu);
}

/* Address of token `token`'s row inside a token-major pool ([block][token][kv_head][head_dim]). */
static uint16_t *token_row(uint16_t *pool, const uint32_t *block_ids, uint32_t token)
{
    uint32_t block = block_ids[token / TOKENS_PER_BLOCK];
    uint32_t slot = token % TOKENS_PER_BLOCK;
    return pool + (size_t)block * PLANE_ELEMS + (size_t)slot * TOKEN_ELEMS;
}

/* ---- error handling ------------------------------------------------------------------------ */
static const char *g_role = "main";
static pid_t g_child = -1; /* the parent kills and reaps the child when it gives up */

static void die(void)
{
    if (g_child > 0) {
        kill(g_child, SIGTERM);
        waitpid(g_child, NULL, 0);
    }
    exit(1);
}

/* Exits with a message unless status is SG_OK. err may be NULL for calls that take none; the detail
 * then comes from sg_last_error_message(), read before any other SmartGen call can replace it. */
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

/* The transfer waits return SG_ERR_TIMEOUT when their timeout passes (the transfer goes on, so the
 * library could be asked again); for this program that is the end. */
static void check_wait(sg_status_t status, const char *what)
{
    if (status == SG_ERR_TIMEOUT) {
        fprintf(stderr, "[%s] %s: still in progress after %u ms\n", g_role, what, TIMEOUT_MS);
        die();
    }
    check(status, what, NULL);
}

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

/* ---- the common setup ---------------------------------------------------------------------- */
static sg_context_t make_context(const char *provider)
{
    sg_context_options_t opts;
    sg_error_info_t err;
    sg_context_t ctx = NULL;

    sg_context_options_init(&opts); /* sets struct_size and header_version: always call it */
    opts.provider = provider;       /* NULL = rank what is present */
    use_auth_key(&opts);
    /* local_addr stays NULL = 127.0.0.1, right for two processes on one host. */
    sg_error_info_init(&err);
    check(sg_context_create(&opts, &ctx, &err), "sg_context_create", &err);
    return ctx;
}

/* Describes a host pool (K and V arrays per layer) and registers it. The layout struct is copied by
 * the library, but the pointer arrays and the memory they point to must outlive the handle. */
static sg_kv_handle_t register_pool(sg_context_t ctx, void *const *k_bases, void *const *v_bases)
{
    sg_kv_layout_t layout;
    sg_error_info_t err;
    sg_kv_handle_t kv = NULL;

    sg_kv_layout_init(&layout); /* defaults: fp16, separate K/V, token-major, host, packed */
    layout.num_layers = NUM_LAYERS;
    layout.num_kv_heads = NUM_KV_HEADS;
    layout.head_dim = HEAD_DIM;
    layout.tokens_per_block = TOKENS_PER_BLOCK;
    layout.num_blocks = POOL_BLOCKS;
    layout.dtype = SG_DTYPE_FP16;
    layout.packing = SG_KV_SEPARATE;
    layout.block_order = SG_BLOCK_TOKEN_MAJOR;
    layout.mem_kind = SG_MEM_HOST;
    layout.layer_k_base = k_bases;
    layout.layer_v_base = v_bases;
    layout.layer_base_count = NUM_LAYERS;
    layout.block_stride_bytes = 0; /* packed: block b starts at base + b * plane bytes */

    sg_error_info_init(&err);
    check(sg_kv_register(ctx, &layout, &kv, &err), "sg_kv_register", &err);
    return kv;
}

/* One pool per (layer, K/V), each POOL_ELEMS fp16 values, every element set to `fill`. */
static void alloc_pools(uint16_t *pools[NUM_LAYERS][2], uint16_t fill)
{
    uint32_t l, kv;
    size_t i;

    for (l = 0; l < NUM_LAYERS; l++) {
        for (kv = 0; kv < 2; kv++) {
            pools[l][kv] = malloc(POOL_ELEMS * sizeof(uint16_t));
            if (pools[l][kv] == NULL) {
                fprintf(stderr, "[%s] out of memory\n", g_role);
                die();
            }
            for (i = 0; i < POOL_ELEMS; i++)
                pools[l][kv][i] = fill;
        }
    }
}

static void free_pools(uint16_t *pools[NUM_LAYERS][2])
{
    uint32_t l;

    for (l = 0; l < NUM_LAYERS; l++) {
        free(pools[l][0]);
        free(pools[l][1]);
    }
}

/* ---- decode: the child ----------------------------------------------------------------------- */

/* Checks every element the request covers, and that the pool's other blocks were not touched.
 * (The slots of the last block past NUM_TOKENS are not checked: the header does not say whether
 * the runtime moves whole blocks or only the request's tokens.) Returns the number of mismatches. */
static size_t verify(uint16_t *pools[NUM_LAYERS][2])
{
    size_t bad = 0;
    uint32_t l, kv, t, e, b, i;

    for (l = 0; l < NUM_LAYERS; l++) {
        for (kv = 0; kv < 2; kv++) {
            for (t = 0; t < NUM_TOKENS; t++) {
                const uint16_t *row = token_row(pools[l][kv], DECODE_BLOCKS, t);
                for (e = 0; e < TOKEN_ELEMS; e++) {
                    uint16_t want = pattern(l, kv, t, e);
                    if (row[e] != want && bad++ < 5)
                        fprintf(stderr, "[decode] layer %u %c token %u elem %u: got 0x%04x want 0x%04x\n",
                                l, kv ? 'V' : 'K', t, e, row[e], want);
                }
            }
            for (b = 0; b < POOL_BLOCKS; b++) {
                int in_request = 0;
                for (i = 0; i < NUM_BLOCKS; i++)
                    in_request |= DECODE_BLOCKS[i] == b;
                if (in_request)
                    continue;
                for (e = 0; e < PLANE_ELEMS; e++) {
                    if (pools[l][kv][(size_t)b * PLANE_ELEMS + e] != DECODE_FILL) {
                        if (bad++ < 5)
                            fprintf(stderr, "[decode] layer %u %c block %u (not in the request) was written\n",
                                    l, kv ? 'V' : 'K', b);
                        break;
                    }
                }
            }
        }
    }
    return bad;
}

/* Reads the listener's port from the parent, waiting at most PORT_PIPE_TIMEOUT_MS. */
static uint16_t read_port(int fd)
{
    struct pollfd pfd;
    unsigned char buf[2];
    size_t got = 0;

    while (got < sizeof buf) {
        ssize_t n;
        int r;

        pfd.fd = fd;
        pfd.events = POLLIN;
        pfd.revents = 0;
        r = poll(&pfd, 1, PORT_PIPE_TIMEOUT_MS);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            fprintf(stderr, "[decode] no port from the parent\n");
            exit(1);
        }
        n = read(fd, buf + got, sizeof buf - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) { /* EOF: the parent failed before it had a listener */
            fprintf(stderr, "[decode] parent closed the pipe without a port\n");
            exit(1);
        }
        got += (size_t)n;
    }
    return (uint16_t)((buf[0] << 8) | buf[1]);
}

static int run_decode(int port_fd, const char *provider)
{
    uint16_t *pools[NUM_LAYERS][2];
    void *k_bases[NUM_LAYERS], *v_bases[NUM_LAYERS];
    sg_context_t ctx;
    sg_session_options_t sopts;
    sg_session_t session = NULL;
    sg_kv_handle_t kv;
    sg_transfer_options_t topts;
    sg_transfer_t xfer = NULL;
    sg_error_info_t err;
    char session_provider[64];
    uint16_t port;
    uint32_t l;
    size_t bad;

    g_role = "decode";
    port = read_port(port_fd);
    close(port_fd);

    /* This process's own context, made after the fork. */
    ctx = make_context(provider);

    sg_session_options_init(&sopts); /* provider NULL: shm for a same-host peer when available */
    sg_error_info_init(&err);
    check(sg_session_connect(ctx, "127.0.0.1", port, &sopts, TIMEOUT_MS * 1000000ull, &session, &err),
          "sg_session_connect", &err);
    check(sg_session_provider(session, session_provider, sizeof session_provider),
          "sg_session_provider", NULL);
    printf("[decode] connected to 127.0.0.1:%u over %s\n", (unsigned)port, session_provider);

    /* The destination pool. It must be exported to the session before sg_transfer_expect: exporting
     * is what lets this peer (and only this peer) write into it. */
    alloc_pools(pools, DECODE_FILL);
    for (l = 0; l < NUM_LAYERS; l++) {
        k_bases[l] = pools[l][0];
        v_bases[l] = pools[l][1];
    }
    kv = register_pool(ctx, k_bases, v_bases);
    check(sg_session_export_kv(session, kv), "sg_session_export_kv", NULL);

    sg_transfer_options_init(&topts);
    sg_error_info_init(&err);
    check(sg_transfer_expect(session, REQUEST_ID, kv, DECODE_BLOCKS, NUM_BLOCKS, NUM_TOKENS, &topts,
                             &xfer, &err),
          "sg_transfer_expect", &err);

    /* Layers become ready one by one as prefill marks them written; an engine would start decoding
     * layer l here while later layers are still on the wire. */
    for (l = 0; l < NUM_LAYERS; l++) {
        uint64_t ns = 0;
        check_wait(sg_transfer_wait_layer(xfer, l, TIMEOUT_NS), "sg_transfer_wait_layer");
        check(sg_transfer_layer_time(xfer, l, &ns), "sg_transfer_layer_time", NULL);
        printf("[decode] layer %u ready (%.1f us)\n", l, (double)ns / 1e3);
    }
    check_wait(sg_transfer_wait(xfer, TIMEOUT_NS), "sg_transfer_wait");

    bad = verify(pools);
    if (bad == 0)
        printf("[decode] %s: all %u tokens x %u layers x K/V match\n", REQUEST_ID, NUM_TOKENS, NUM_LAYERS);
    else
        printf("[decode] %s: %lu mismatches\n", REQUEST_ID, (unsigned long)bad);

    /* Release in reverse order: the transfer (which uses the pool), the pool, the session, the
     * context. The memory is freed only after the handle that points into it is gone. */
    check(sg_transfer_release(xfer), "sg_transfer_release", NULL);
    check(sg_kv_deregister(kv), "sg_kv_deregister", NULL);
    check(sg_session_destroy(session), "sg_session_destroy", NULL);
    check(sg_context_destroy(ctx), "sg_context_destroy", NULL);
    free_pools(pools);
    return bad == 0 ? 0 : 1;
}

/* ---- prefill: the parent ------------------------------------------------------------------------ */

/* Writes the pattern into the request's tokens, as the prefill forward pass would. */
static void fill_request(uint16_t *pools[NUM_LAYERS][2])
{
    uint32_t l, kv, t, e;

    for (l = 0; l < NUM_LAYERS; l++)
        for (kv = 0; kv < 2; kv++)
            for (t = 0; t < NUM_TOKENS; t++) {
                uint16_t *row = token_row(pools[l][kv], PREFILL_BLOCKS, t);
                for (e = 0; e < TOKEN_ELEMS; e++)
                    row[e] = pattern(l, kv, t, e);
            }
}

static void write_port(int fd, uint16_t port)
{
    unsigned char buf[2];
    ssize_t n;

    buf[0] = (unsigned char)(port >> 8);
    buf[1] = (unsigned char)(port & 0xFFu);
    do {
        n = write(fd, buf, sizeof buf); /* 2 bytes < PIPE_BUF: written whole or not at all */
    } while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof buf) {
        fprintf(stderr, "[prefill] cannot send the port to the child\n");
        die();
    }
}

static int run_prefill(int port_fd, const char *provider)
{
    uint16_t *pools[NUM_LAYERS][2];
    void *k_bases[NUM_LAYERS], *v_bases[NUM_LAYERS];
    sg_context_t ctx;
    sg_listener_t listener = NULL;
    sg_session_options_t sopts;
    sg_session_t session = NULL;
    sg_kv_handle_t kv;
    sg_transfer_options_t topts;
    sg_transfer_t xfer = NULL;
    sg_transfer_stats_t stats;
    sg_error_info_t err;
    char ctx_provider[64];
    uint16_t port = 0;
    uint32_t l;
    int wstatus = 0;
    pid_t r;

    g_role = "prefill";
    ctx = make_context(provider);
    check(sg_context_provider(ctx, ctx_provider, sizeof ctx_provider), "sg_context_provider", NULL);

    /* Port 0: the kernel picks a free port, so parallel runs (ctest -j) do not collide. */
    sg_error_info_init(&err);
    check(sg_listener_create(ctx, "127.0.0.1", 0, &listener, &err), "sg_listener_create", &err);
    check(sg_listener_port(listener, &port), "sg_listener_port", NULL);
    printf("[prefill] context on %s, listening on 127.0.0.1:%u\n", ctx_provider, (unsigned)port);
    write_port(port_fd, port);
    close(port_fd);

    sg_session_options_init(&sopts);
    sg_error_info_init(&err);
    check(sg_session_accept(listener, &sopts, TIMEOUT_MS * 1000000ull, &session, &err), "sg_session_accept", &err);
    /* One peer is all this program expects; the session outlives its listener. */
    check(sg_listener_destroy(listener), "sg_listener_destroy", NULL);

    alloc_pools(pools, PREFILL_FILL);
    fill_request(pools);
    for (l = 0; l < NUM_LAYERS; l++) {
        k_bases[l] = pools[l][0];
        v_bases[l] = pools[l][1];
    }
    kv = register_pool(ctx, k_bases, v_bases);
    check(sg_session_export_kv(session, kv), "sg_session_export_kv", NULL);

    /* flags = 0: nothing is sent until layers are marked written, as a prefill engine would mark
     * each layer when its forward pass finishes it (SG_TRANSFER_ALL_LAYERS_WRITTEN sends at once). */
    sg_transfer_options_init(&topts);
    topts.flags = 0;
    sg_error_info_init(&err);
    check(sg_transfer_post(session, REQUEST_ID, kv, PREFILL_BLOCKS, NUM_BLOCKS, NUM_TOKENS, &topts, &xfer,
                           &err),
          "sg_transfer_post", &err);
    for (l = 0; l < NUM_LAYERS; l++)
        check(sg_transfer_layer_written(xfer, l, NULL /* host memory: no CUDA stream */),
              "sg_transfer_layer_written", NULL);

    /* Prefill completes when every byte is delivered and acknowledged by decode. */
    check_wait(sg_transfer_wait(xfer, TIMEOUT_NS), "sg_transfer_wait");

    memset(&stats, 0, sizeof stats);
    stats.struct_size = sizeof stats; /* no init function for stats: the caller sets the size */
    check(sg_transfer_stats(xfer, &stats), "sg_transfer_stats", NULL);
    printf("[prefill] %s: %llu bytes in %llu RMA ops (%llu segments, %llu staged bytes), %.1f us\n",
           REQUEST_ID, (unsigned long long)stats.bytes, (unsigned long long)stats.rma_ops,
           (unsigned long long)stats.segments, (unsigned long long)stats.staged_bytes,
           (double)(stats.end_ns - stats.start_ns) / 1e3);

    check(sg_transfer_release(xfer), "sg_transfer_release", NULL);
    check(sg_kv_deregister(kv), "sg_kv_deregister", NULL);
    check(sg_session_destroy(session), "sg_session_destroy", NULL);
    check(sg_context_destroy(ctx), "sg_context_destroy", NULL);
    free_pools(pools);
    fflush(stdout);

    /* The child's exit status is the verdict on the bytes. */
    do {
        r = waitpid(g_child, &wstatus, 0);
    } while (r < 0 && errno == EINTR);
    g_child = -1;
    if (r < 0) {
        perror("[prefill] waitpid");
        return 1;
    }
    if (!WIFEXITED(wstatus)) {
        fprintf(stderr, "[prefill] decode did not exit normally\n");
        return 1;
    }
    printf("[prefill] decode exited with %d: %s\n", WEXITSTATUS(wstatus),
           WEXITSTATUS(wstatus) == 0 ? "PASS" : "FAIL");
    return WEXITSTATUS(wstatus) == 0 ? 0 : 1;
}

/* ---- main ---------------------------------------------------------------------------------- */
static void usage(FILE *out, const char *argv0)
{
    fprintf(out,
            "usage: %s [--provider NAME]\n"
            "  Runs a prefill (parent) and a decode (child) process on 127.0.0.1 and moves one\n"
            "  request's KV blocks between them. NAME as sg_context_options_t.provider\n"
            "  (\"tcp\", \"shm\", \"verbs;ofi_rxm\", ...); default: automatic.\n",
            argv0);
}

int main(int argc, char **argv)
{
    const char *provider = NULL;
    int fds[2];
    int i;
    pid_t pid;

    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--provider") == 0 && i + 1 < argc) {
            provider = argv[++i];
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout, argv[0]);
            return 0;
        } else {
            usage(stderr, argv[0]);
            return 1;
        }
    }

    /* Line-buffered so the two processes' lines interleave in order even when piped (ctest). */
    setvbuf(stdout, NULL, _IOLBF, 0);

    /* Every SmartGen wait below has a timeout; this only catches a bug that blocks anyway. */
    alarm(WATCHDOG_S);

    /* Fork before any SmartGen call (see the top of the file); the pipe carries the port. */
    if (make_auth_key() != 0) {
        fprintf(stderr, "cannot read /dev/urandom for the session key\n");
        return 1;
    }
    if (pipe(fds) != 0) {
        perror("pipe");
        return 1;
    }
    fflush(NULL); /* nothing buffered may be written twice */
    pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) {
        close(fds[1]); /* so the child sees EOF if the parent dies before sending the port */
        alarm(WATCHDOG_S);
        return run_decode(fds[0], provider);
    }
    g_child = pid;
    close(fds[0]);
    return run_prefill(fds[1], provider);
}
