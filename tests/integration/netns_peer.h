/* What both sides of the network-namespace tests share (link_peer.c, fence_peer.c): public header
 * only. Each program is called as
 *   PROGRAM decode  LOCAL PORT ...
 *   PROGRAM prefill LOCAL PEER PORT ...
 * and exits 2 when a call it needs fails. */
#ifndef SMARTGEN_TESTS_NETNS_PEER_H
#define SMARTGEN_TESTS_NETNS_PEER_H

#include <smartgen/smartgen.h>

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define NS 1000000000ull

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *what, sg_status_t st) {
    fprintf(stderr, "%s: %s (%s)\n", what, sg_status_str(st), sg_last_error_message());
    exit(2);
}
#define CHECK(call, what)                 \
    do {                                  \
        sg_status_t st_ = (call);         \
        if (st_ != SG_OK) die(what, st_); \
    } while (0)

/* A pool of fp16 K and V planes, one base per layer; the memory stays the caller's. */
static sg_kv_handle_t register_pool(sg_context_t ctx, uint32_t layers, uint32_t heads, uint32_t head_dim,
                                    uint32_t blocks, void **k, void **v) {
    sg_kv_layout_t lay;
    sg_kv_layout_init(&lay);
    lay.num_layers = layers;
    lay.num_kv_heads = heads;
    lay.head_dim = head_dim;
    lay.tokens_per_block = 16;
    lay.num_blocks = blocks;
    lay.layer_k_base = k;
    lay.layer_v_base = v;
    lay.layer_base_count = layers;
    sg_kv_handle_t kv;
    CHECK(sg_kv_register(ctx, &lay, &kv, NULL), "register");
    return kv;
}

/* The prefill side connects to PEER:PORT, the decode side accepts one session on LOCAL:PORT. */
static sg_session_t open_session(sg_context_t ctx, int prefill, char **argv) {
    sg_session_t s;
    if (prefill) {
        CHECK(sg_session_connect(ctx, argv[3], (uint16_t)atoi(argv[4]), NULL, 10 * NS, &s, NULL), "connect");
    } else {
        sg_listener_t l;
        CHECK(sg_listener_create(ctx, argv[2], (uint16_t)atoi(argv[3]), &l, NULL), "listen");
        CHECK(sg_session_accept(l, NULL, 10 * NS, &s, NULL), "accept");
        sg_listener_destroy(l);
    }
    return s;
}

#endif
