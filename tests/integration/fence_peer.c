/* One side of the fence test (tests/integration/netns_fence.sh), public header only: nothing a
 * lost session's peer sends may land in blocks this side was told are free, and nothing this side
 * released may still be read and sent.
 *   fence_peer decode  LOCAL PORT TIMEOUT_MS LANES MODE
 *   fence_peer prefill LOCAL PEER PORT TIMEOUT_MS LANES
 * The pair moves 8 layers of 256 blocks (128 MiB) over a shaped link. Once layer 0 is across each
 * prints "READY"; the script then drops every packet on the link (the line "down" on our stdin).
 * The side with the short peer timeout loses the session, releases its transfer (MODE "destroy":
 * also destroys the session and deregisters the pool), overwrites its blocks with a pattern at once
 * and prints "RELEASED"; the other side, with a long timeout, keeps its session through the outage.
 * The script heals the link ("healed" on stdin) and the decode side watches its blocks for
 * SG_FENCE_WATCH_S seconds (default 10):
 * - decode lost the session: its pattern must stay intact (a write of the live prefill side that
 *   lands after release fails the test);
 * - prefill lost the session: the prefill side's pattern must never reach the decode blocks (a
 *   write read from the released source blocks fails it).
 * Exits 0 when the check holds, 1 when it does not, and prints what it saw. */
#define _POSIX_C_SOURCE 200809L
#include <smartgen/smartgen.h>

#include "../test_key.h"
#include "netns_peer.h"

#include <stdint.h>
#include <string.h>

enum { LAYERS = 8, BLOCKS = 256, HEADS = 8, HEAD_DIM = 128, TOKENS = 16 };
#define PLANE_BYTES ((size_t)TOKENS * HEADS * HEAD_DIM * 2)
#define LAYER_BYTES (PLANE_BYTES * BLOCKS)
static const uint64_t kReleasedPattern = 0x5a5a5a5a5a5a5a5aull;
static const uint64_t kSourcePattern = 0xa5a5a5a5a5a5a5a5ull;

static uint64_t *planes[2][LAYERS]; /* [0] K, [1] V */

static void fill(uint64_t word) {
    for (int kv = 0; kv < 2; ++kv)
        for (int l = 0; l < LAYERS; ++l)
            for (size_t i = 0; i < LAYER_BYTES / 8; ++i) planes[kv][l][i] = word;
}

/* Words that are not `word` (decode fenced: its pattern must stay), or that are (prefill fenced:
 * its released source pattern must never arrive). */
static size_t count(uint64_t word, int equal) {
    size_t n = 0;
    for (int kv = 0; kv < 2; ++kv)
        for (int l = 0; l < LAYERS; ++l)
            for (size_t i = 0; i < LAYER_BYTES / 8; ++i) n += (planes[kv][l][i] == word) == equal;
    return n;
}

static void read_line(const char *expected) {
    char line[32];
    if (!fgets(line, sizeof line, stdin) || strncmp(line, expected, strlen(expected)) != 0) {
        fprintf(stderr, "fence_peer: expected '%s' from the script\n", expected);
        exit(2);
    }
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: fence_peer decode LOCAL PORT TIMEOUT_MS LANES [release|destroy]\n"
                        "       fence_peer prefill LOCAL PEER PORT TIMEOUT_MS LANES\n");
        return 2;
    }
    const int prefill = strcmp(argv[1], "prefill") == 0;
    const int arg = prefill ? 4 : 3; /* index of PORT */
    const uint32_t timeout_ms = (uint32_t)atoi(argv[arg + 1]);
    const uint32_t lanes = (uint32_t)atoi(argv[arg + 2]);
    const int destroy = !prefill && argc > 6 && strcmp(argv[6], "destroy") == 0;
    const double watch_s = getenv("SG_FENCE_WATCH_S") ? atof(getenv("SG_FENCE_WATCH_S")) : 10.0;

    sg_context_options_t o;
    sg_context_options_init(&o);
    o.peer_timeout_ms = timeout_ms;
    o.provider = "tcp";
    o.local_addr = argv[2];
    o.lanes = lanes;
    SG_TEST_USE_KEY(o);
    sg_context_t ctx;
    CHECK(sg_context_create(&o, &ctx, NULL), "context");

    void *kp[LAYERS], *vp[LAYERS];
    for (int l = 0; l < LAYERS; ++l) {
        /* The host's own memory: deregistering it hands it back to the host, which keeps it here to
         * see what still lands. */
        void *k = NULL, *v = NULL;
        if (posix_memalign(&k, 4096, LAYER_BYTES) || posix_memalign(&v, 4096, LAYER_BYTES))
            die("posix_memalign", SG_ERR_NO_MEMORY);
        planes[0][l] = k;
        planes[1][l] = v;
        kp[l] = planes[0][l];
        vp[l] = planes[1][l];
    }
    if (prefill) {
        /* Data no word of which is either pattern. */
        for (int kv = 0; kv < 2; ++kv)
            for (int l = 0; l < LAYERS; ++l)
                for (size_t i = 0; i < LAYER_BYTES / 8; ++i)
                    planes[kv][l][i] = ((uint64_t)(kv * LAYERS + l) << 40) | (uint64_t)i;
    } else {
        fill(0);
    }
    sg_kv_handle_t kv = register_pool(ctx, LAYERS, HEADS, HEAD_DIM, BLOCKS, kp, vp);
    sg_session_t s = open_session(ctx, prefill, argv);
    CHECK(sg_session_export_kv(s, kv), "export");
    uint32_t table[BLOCKS];
    for (uint32_t i = 0; i < BLOCKS; ++i) table[i] = i;
    const uint32_t tokens = BLOCKS * TOKENS;
    sg_transfer_t x;
    if (prefill) {
        CHECK(sg_transfer_post(s, "fence", kv, table, BLOCKS, tokens, NULL, &x, NULL), "post");
        for (uint32_t l = 0; l < LAYERS; ++l) CHECK(sg_transfer_layer_written(x, l, NULL), "layer written");
        CHECK(sg_transfer_wait_layer(x, 0, 30 * NS), "layer 0 delivered");
    } else {
        CHECK(sg_transfer_expect(s, "fence", kv, table, BLOCKS, tokens, NULL, &x, NULL), "expect");
        CHECK(sg_transfer_wait_layer(x, 0, 30 * NS), "layer 0 arrived");
    }
    printf("READY\n");
    fflush(stdout);
    read_line("down");
    const double down = now_s();
    const int short_side = timeout_ms < 10000;
    if (short_side) {
        /* This side loses the session; release must fence it before it returns. */
        const sg_status_t st = sg_transfer_wait(x, 30 * NS);
        sg_status_t se = SG_OK;
        sg_session_error(s, &se, NULL, 0);
        const double lost = now_s();
        sg_transfer_release(x);
        if (destroy) {
            sg_session_destroy(s);
            sg_kv_deregister(kv);
        }
        const double released = now_s();
        fill(prefill ? kSourcePattern : kReleasedPattern);
        printf("%s: transfer %s, session %s %.0f ms after the link went down; release took %.0f ms\n", argv[1],
               sg_status_str(st), sg_status_str(se), (lost - down) * 1000, (released - lost) * 1000);
        printf("RELEASED\n");
        fflush(stdout);
        if (st != SG_ERR_PEER_LOST) {
            printf("FAIL: the transfer should have lost its peer\n");
            return 1;
        }
    }
    read_line("healed");
    int failed = 0;
    if (!prefill) {
        /* Watch the blocks while whatever the peer still had queued could arrive. */
        const double until = now_s() + watch_s;
        size_t worst = 0;
        double first_seen = 0;
        while (now_s() < until) {
            const size_t bad = short_side ? count(kReleasedPattern, 0) : count(kSourcePattern, 1);
            if (bad && !first_seen) first_seen = now_s();
            if (bad > worst) worst = bad;
            const struct timespec pause = {0, 50 * 1000 * 1000};
            nanosleep(&pause, NULL);
        }
        if (worst) {
            printf("FAIL: %s %zu bytes of the decode blocks, first seen %.2f s after the link healed\n",
                   short_side ? "a write after release changed" : "the released source pattern reached",
                   worst * 8, first_seen - (until - watch_s));
            failed = 1;
        } else {
            printf("decode: the blocks held for %.1f s after the link healed\n", watch_s);
        }
    }
    if (!short_side || !destroy) {
        if (short_side) {
            sg_session_destroy(s);
            sg_kv_deregister(kv);
        } else {
            sg_transfer_release(x);
            sg_session_destroy(s);
            sg_kv_deregister(kv);
        }
    }
    sg_context_destroy(ctx);
    for (int l = 0; l < LAYERS; ++l) {
        free(planes[0][l]);
        free(planes[1][l]);
    }
    return failed;
}
