/* One side of the link-down test (tests/integration/netns_link_down.sh), public header only.
 *   link_peer decode  LOCAL_ADDR PORT            listens, expects "link", waits
 *   link_peer prefill LOCAL_ADDR PEER_ADDR PORT  connects, posts "link", writes layer 0, waits
 * Each prints "READY" once layer 0 is across, then waits for the transfer to end. It exits 0 only
 * when the transfer fails with SG_ERR_PEER_LOST within 3 s of the link going down (the script
 * signals that moment by writing a line to our stdin), and prints the time it took.
 * Under a sanitizer the bound is the runtime's own cap, four peer timeouts (8.5 s): the silence a
 * peer is allowed grows with the gaps this host's progress shows (docs/protocol.md 4.10), and
 * ThreadSanitizer on two busy cores shows gaps of a second (CI: PEER_LOST after 3.36 s, allowed
 * 3.34 s after gaps of 1.11 s). */
#define _POSIX_C_SOURCE 200809L
#include <smartgen/smartgen.h>

#include "../test_key.h"
#include "netns_peer.h"

#include <string.h>

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: link_peer decode LOCAL PORT | link_peer prefill LOCAL PEER PORT\n");
        return 2;
    }
    const int prefill = strcmp(argv[1], "prefill") == 0;
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.peer_timeout_ms = 2000; /* the test times peer-loss detection: whatever SG_PEER_TIMEOUT_MS says */
    o.provider = "tcp";
    o.local_addr = argv[2];
    SG_TEST_USE_KEY(o);
    sg_context_t ctx;
    CHECK(sg_context_create(&o, &ctx, NULL), "context");

    enum { LAYERS = 4, BLOCKS = 16, ELEMS = 16 * 2 * 64 };
    static uint16_t k[LAYERS][BLOCKS * ELEMS], v[LAYERS][BLOCKS * ELEMS];
    void *kp[LAYERS], *vp[LAYERS];
    for (int l = 0; l < LAYERS; ++l) {
        kp[l] = k[l];
        vp[l] = v[l];
    }
    sg_kv_handle_t kv = register_pool(ctx, LAYERS, 2, 64, BLOCKS, kp, vp);
    sg_session_t s = open_session(ctx, prefill, argv);
    CHECK(sg_session_export_kv(s, kv), "export");
    const uint32_t table[4] = {0, 1, 2, 3};
    sg_transfer_t x;
    if (prefill) {
        CHECK(sg_transfer_post(s, "link", kv, table, 4, 64, NULL, &x, NULL), "post");
        CHECK(sg_transfer_layer_written(x, 0, NULL), "layer 0");
        /* Prefill's layer 0 is ready once its writes completed and the notice went out. */
        CHECK(sg_transfer_wait_layer(x, 0, 10 * NS), "layer 0 delivered");
    } else {
        CHECK(sg_transfer_expect(s, "link", kv, table, 4, 64, NULL, &x, NULL), "expect");
        CHECK(sg_transfer_wait_layer(x, 0, 10 * NS), "layer 0 arrived");
    }
    printf("READY\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 1; /* the script took the link down */
    const double t0 = now_s();
    if (prefill) CHECK(sg_transfer_layer_written(x, 1, NULL), "layer 1"); /* work toward a dead link */
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
    const double bound_s = 8.5;
#else
    const double bound_s = 3.0;
#endif
    const sg_status_t st = sg_transfer_wait(x, 10 * NS);
    const double took = now_s() - t0;
    sg_status_t se = SG_OK;
    sg_session_error(s, &se, NULL, 0);
    printf("%s: transfer %s, session %s after %.0f ms\n", argv[1], sg_status_str(st), sg_status_str(se), took * 1000);
    sg_transfer_release(x);
    sg_session_destroy(s);
    sg_kv_deregister(kv);
    sg_context_destroy(ctx);
    return (st == SG_ERR_PEER_LOST && se == SG_ERR_PEER_LOST && took < bound_s) ? 0 : 1;
}
