// Behaviour of sessions and transfers, with both contexts in one process (two fabric endpoints on
// loopback): metadata blobs, matching in either order, layout mismatches, bounds checks before any
// byte moves, timeouts, cancel, host-driven progress.
#include <smartgen/smartgen.h>
#include "support/test_time.hpp"

#include "../test_key.h"
#include "support/host_pool.hpp"
#include "support/test_context.hpp"

#include <gtest/gtest.h>

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr uint64_t kSecond = 1000000000ull;
constexpr uint64_t kMs = 1000000ull;

struct Ctx {
    sg_context_t h = nullptr;
    explicit Ctx(bool progress_thread = true, const char *provider = "tcp") {
        sg_context_options_t o;
        sg_context_options_init(&o);
        o.provider = provider;
        o.manual_progress = progress_thread ? 0 : 1;
        SG_TEST_USE_KEY(o);
        EXPECT_EQ(sg_context_create(&o, &h, nullptr), SG_OK) << sg_last_error_message();
    }
    ~Ctx() { EXPECT_EQ(sg_context_destroy(h), SG_OK); }
};

struct Pool : sgtest::HostPool {
    uint32_t layers, heads, dim, tpb;
    uint64_t blocks;
    sg_kv_handle_t kv = nullptr;
    Pool(sg_context_t ctx, uint32_t layers_, uint32_t heads_, uint32_t dim_, uint32_t tpb_, uint64_t blocks_)
        : HostPool({layers_, heads_, dim_, tpb_, blocks_}), layers(layers_), heads(heads_), dim(dim_), tpb(tpb_),
          blocks(blocks_) {
        EXPECT_EQ(sg_kv_register(ctx, &layout, &kv, nullptr), SG_OK) << sg_last_error_message();
    }
    ~Pool() { sg_kv_deregister(kv); }
    void fill(uint16_t seed) {
        for (uint32_t l = 0; l < layers; ++l)
            for (size_t i = 0; i < k[l].size(); ++i) {
                k[l][i] = uint16_t(seed + l * 7 + i);
                v[l][i] = uint16_t(seed * 3 + l + i * 5);
            }
    }
};

// Two sessions joined over the bootstrap listener.
struct Pair {
    Ctx prefill, decode;
    sg_session_t ps = nullptr, ds = nullptr;
    explicit Pair(bool progress_thread = true) : prefill(progress_thread), decode(progress_thread) {
        sg_listener_t l = nullptr;
        EXPECT_EQ(sg_listener_create(prefill.h, "127.0.0.1", 0, &l, nullptr), SG_OK);
        uint16_t port = 0;
        EXPECT_EQ(sg_listener_port(l, &port), SG_OK);
        EXPECT_NE(port, 0);
        std::thread t([&] { EXPECT_EQ(sg_session_connect(decode.h, "127.0.0.1", port, nullptr, sgtest::wait_ns(5 * kSecond), &ds, nullptr), SG_OK); });
        EXPECT_EQ(sg_session_accept(l, nullptr, sgtest::wait_ns(5 * kSecond), &ps, nullptr), SG_OK) << sg_last_error_message();
        t.join();
        EXPECT_EQ(sg_listener_destroy(l), SG_OK);
    }
    ~Pair() {
        sg_session_destroy(ps);
        sg_session_destroy(ds);
    }
};

std::vector<uint32_t> iota_table(size_t n, uint32_t start = 0) {
    std::vector<uint32_t> t(n);
    std::iota(t.begin(), t.end(), start);
    return t;
}

// Joins two contexts by exchanging their metadata blobs, as a host with its own channel would.
void join_by_metadata(sg_context_t a, sg_context_t b, sg_session_t *sa, sg_session_t *sb) {
    size_t la = 0, lb = 0;
    sg_context_get_metadata(a, nullptr, 0, &la);
    sg_context_get_metadata(b, nullptr, 0, &lb);
    std::vector<uint8_t> ma(la), mb(lb);
    ASSERT_EQ(sg_context_get_metadata(a, ma.data(), la, &la), SG_OK);
    ASSERT_EQ(sg_context_get_metadata(b, mb.data(), lb, &lb), SG_OK);
    ASSERT_EQ(sg_session_from_metadata(a, mb.data(), lb, nullptr, sa, nullptr), SG_OK);
    ASSERT_EQ(sg_session_from_metadata(b, ma.data(), la, nullptr, sb, nullptr), SG_OK);
}

TEST(Session, MetadataBlobsMakeAWorkingSession) {
    Ctx a, b;
    size_t len = 0;
    ASSERT_EQ(sg_context_get_metadata(a.h, nullptr, 0, &len), SG_OK);  // a size query
    ASSERT_GT(len, 0u);
    std::vector<uint8_t> blob_a(len), blob_b;
    ASSERT_EQ(sg_context_get_metadata(a.h, blob_a.data(), blob_a.size(), &len), SG_OK);
    ASSERT_EQ(sg_context_get_metadata(b.h, nullptr, 0, &len), SG_OK);
    blob_b.resize(len);
    ASSERT_EQ(sg_context_get_metadata(b.h, blob_b.data(), blob_b.size(), &len), SG_OK);

    // A corrupt or truncated blob is refused with its own status.
    sg_session_t bad = nullptr;
    std::vector<uint8_t> corrupt = blob_a;
    corrupt[0] ^= 0xff;
    EXPECT_EQ(sg_session_from_metadata(b.h, corrupt.data(), corrupt.size(), nullptr, &bad, nullptr), SG_ERR_PROTOCOL);
    EXPECT_EQ(sg_session_from_metadata(b.h, blob_a.data(), blob_a.size() / 2, nullptr, &bad, nullptr), SG_ERR_PROTOCOL);
    EXPECT_EQ(bad, nullptr);
    // A context cannot talk to itself.
    EXPECT_EQ(sg_session_from_metadata(a.h, blob_a.data(), blob_a.size(), nullptr, &bad, nullptr), SG_ERR_INVALID_ARGUMENT);

    sg_session_t sa = nullptr, sb = nullptr;
    ASSERT_EQ(sg_session_from_metadata(a.h, blob_b.data(), blob_b.size(), nullptr, &sa, nullptr), SG_OK);
    ASSERT_EQ(sg_session_from_metadata(b.h, blob_a.data(), blob_a.size(), nullptr, &sb, nullptr), SG_OK);
    EXPECT_EQ(sg_session_from_metadata(b.h, blob_a.data(), blob_a.size(), nullptr, &bad, nullptr), SG_ERR_DUPLICATE);

    Pool src(a.h, 2, 2, 64, 16, 8), dst(b.h, 2, 2, 64, 16, 8);
    src.fill(11);
    ASSERT_EQ(sg_session_export_kv(sb, dst.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(sa, src.kv), SG_OK);
    auto table = iota_table(4);
    sg_transfer_t x = nullptr, y = nullptr;
    ASSERT_EQ(sg_transfer_expect(sb, "blob-1", dst.kv, table.data(), 4, 64, nullptr, &y, nullptr), SG_OK);
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
    ASSERT_EQ(sg_transfer_post(sa, "blob-1", src.kv, table.data(), 4, 64, &o, &x, nullptr), SG_OK);
    EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
    EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
    const size_t used = size_t(4) * 16 * 2 * 64;
    for (uint32_t l = 0; l < 2; ++l) {
        EXPECT_EQ(std::memcmp(src.k[l].data(), dst.k[l].data(), used * 2), 0);
        EXPECT_EQ(std::memcmp(src.v[l].data(), dst.v[l].data(), used * 2), 0);
    }
    sg_transfer_release(x);
    sg_transfer_release(y);
    sg_session_destroy(sa);
    sg_session_destroy(sb);
}

// Either side may come first; the post side may also stream layers in a chosen order.
TEST(Session, PostBeforeExpectWithLayerOrderAndStreaming) {
    Pair p;
    Pool src(p.prefill.h, 3, 1, 32, 8, 16), dst(p.decode.h, 3, 1, 32, 8, 16);
    src.fill(5);
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    auto st = iota_table(5, 3), dt = iota_table(5, 10);
    const uint32_t order[3] = {2, 0, 1};
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    o.layer_order = order;
    o.layer_order_count = 3;
    sg_transfer_t x = nullptr, y = nullptr;
    ASSERT_EQ(sg_transfer_post(p.ps, "early", src.kv, st.data(), 5, 40, &o, &x, nullptr), SG_OK);
    uint32_t state = 0;
    ASSERT_EQ(sg_transfer_layer_state(x, 0, &state), SG_OK);
    EXPECT_EQ(state, 0u);
    ASSERT_EQ(sg_transfer_expect(p.ds, "early", dst.kv, dt.data(), 5, 40, nullptr, &y, nullptr), SG_OK);
    // Nothing moves before a layer is written.
    EXPECT_EQ(sg_transfer_wait_layer(y, 2, 50 * kMs), SG_ERR_TIMEOUT);
    ASSERT_EQ(sg_transfer_layer_written(x, 0, nullptr), SG_OK);
    // Layer 0 is written but layer 2 comes first in the order, so layer 0 must wait for it.
    EXPECT_EQ(sg_transfer_wait_layer(y, 0, 50 * kMs), SG_ERR_TIMEOUT);
    ASSERT_EQ(sg_transfer_layer_state(x, 0, &state), SG_OK);
    EXPECT_EQ(state, SG_LAYER_WRITTEN);
    ASSERT_EQ(sg_transfer_layer_written(x, 2, nullptr), SG_OK);
    EXPECT_EQ(sg_transfer_wait_layer(y, 2, sgtest::wait_ns(5 * kSecond)), SG_OK);
    EXPECT_EQ(sg_transfer_wait_layer(y, 0, sgtest::wait_ns(5 * kSecond)), SG_OK);
    EXPECT_EQ(sg_transfer_test(y), SG_IN_PROGRESS);
    ASSERT_EQ(sg_transfer_layer_written(x, 1, nullptr), SG_OK);
    EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_OK);
    EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_OK);
    const size_t row = 32;
    for (uint32_t l = 0; l < 3; ++l)
        for (uint32_t t = 0; t < 40; ++t)
            EXPECT_EQ(std::memcmp(&src.k[l][(st[t / 8] * 8 + t % 8) * row], &dst.k[l][(dt[t / 8] * 8 + t % 8) * row], row * 2), 0);
    uint64_t ns = 0;
    EXPECT_EQ(sg_transfer_layer_time(y, 1, &ns), SG_OK);
    EXPECT_GT(ns, 0u);
    EXPECT_EQ(sg_transfer_layer_written(y, 0, nullptr), SG_ERR_INVALID_STATE);  // decode side
    EXPECT_EQ(sg_transfer_layer_written(x, 3, nullptr), SG_ERR_OUT_OF_RANGE);
    EXPECT_EQ(sg_transfer_layer_written(x, 0, &ns), SG_ERR_INVALID_ARGUMENT);  // a stream with a host pool
    sg_transfer_release(x);
    sg_transfer_release(y);
}

TEST(Session, LayoutMismatchIsRefusedOnBothSides) {
    Pair p;
    Pool src(p.prefill.h, 2, 2, 64, 16, 8), dst(p.decode.h, 2, 2, 128, 16, 8);  // head_dim differs
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    auto t = iota_table(2);
    sg_transfer_t x = nullptr, y = nullptr;
    ASSERT_EQ(sg_transfer_expect(p.ds, "mm", dst.kv, t.data(), 2, 32, nullptr, &y, nullptr), SG_OK);
    // Post either refuses at once (expect already here) or fails the transfer once it arrives.
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_status_t st = SG_IN_PROGRESS;
    for (int i = 0; i < 100 && st != SG_ERR_LAYOUT_MISMATCH; ++i) {
        sg_transfer_release(x);
        x = nullptr;
        st = sg_transfer_post(p.ps, "mm", src.kv, t.data(), 2, 32, nullptr, &x, &err);
        if (st == SG_OK) st = sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond));
    }
    EXPECT_EQ(st, SG_ERR_LAYOUT_MISMATCH);
    EXPECT_NE(std::string(sg_last_error_message()).find("head_dim"), std::string::npos) << sg_last_error_message();
    EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_ERR_LAYOUT_MISMATCH);
    char msg[256];
    sg_status_t status;
    ASSERT_EQ(sg_transfer_status(y, &status, msg, sizeof msg), SG_OK);
    EXPECT_EQ(status, SG_ERR_LAYOUT_MISMATCH);
    EXPECT_NE(std::string(msg).find("head_dim"), std::string::npos) << msg;
    sg_transfer_release(x);
    sg_transfer_release(y);
}

TEST(Session, BlockIdsAreCheckedBeforeAnyByteMoves) {
    Pair p;
    Pool src(p.prefill.h, 1, 1, 16, 4, 8), dst(p.decode.h, 1, 1, 16, 4, 8);
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    const uint32_t bad[2] = {1, 8};  // 8 is outside an 8-block pool
    sg_transfer_t x = nullptr;
    sg_error_info_t err;
    sg_error_info_init(&err);
    EXPECT_EQ(sg_transfer_post(p.ps, "oob", src.kv, bad, 2, 8, nullptr, &x, &err), SG_ERR_OUT_OF_RANGE);
    EXPECT_NE(std::string(err.message).find("block_ids[1]"), std::string::npos) << err.message;
    EXPECT_EQ(sg_transfer_expect(p.ds, "oob", dst.kv, bad, 2, 8, nullptr, &x, nullptr), SG_ERR_OUT_OF_RANGE);
    const uint32_t few[1] = {0};  // 8 tokens need two 4-token blocks
    EXPECT_EQ(sg_transfer_post(p.ps, "few", src.kv, few, 1, 8, nullptr, &x, nullptr), SG_ERR_OUT_OF_RANGE);
    EXPECT_EQ(x, nullptr);
    std::string long_id(300, 'x');
    const uint32_t ok[2] = {0, 1};
    EXPECT_EQ(sg_transfer_post(p.ps, long_id.c_str(), src.kv, ok, 2, 8, nullptr, &x, nullptr), SG_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(sg_transfer_post(p.ps, "", src.kv, ok, 2, 8, nullptr, &x, nullptr), SG_ERR_INVALID_ARGUMENT);
    // A pool that was never exported to the session cannot be used on it.
    Pool other(p.prefill.h, 1, 1, 16, 4, 8);
    EXPECT_EQ(sg_transfer_post(p.ps, "unexported", other.kv, ok, 2, 8, nullptr, &x, nullptr), SG_ERR_INVALID_STATE);
    // And a duplicate request id is refused.
    sg_transfer_t a = nullptr, b = nullptr;
    ASSERT_EQ(sg_transfer_post(p.ps, "dup", src.kv, ok, 2, 8, nullptr, &a, nullptr), SG_OK);
    EXPECT_EQ(sg_transfer_post(p.ps, "dup", src.kv, ok, 2, 8, nullptr, &b, nullptr), SG_ERR_DUPLICATE);
    EXPECT_EQ(sg_kv_deregister(src.kv), SG_ERR_INVALID_STATE);  // still used by "dup"
    sg_transfer_release(a);
}

TEST(Session, WaitTimesOutWithInProgressAndCancelReachesThePeer) {
    Pair p;
    Pool src(p.prefill.h, 2, 1, 16, 4, 8), dst(p.decode.h, 2, 1, 16, 4, 8);
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    const uint32_t t[2] = {0, 1};
    sg_transfer_t x = nullptr, y = nullptr;
    ASSERT_EQ(sg_transfer_expect(p.ds, "slow", dst.kv, t, 2, 8, nullptr, &y, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_post(p.ps, "slow", src.kv, t, 2, 8, nullptr, &x, nullptr), SG_OK);
    // No layer written: the wait expires, and that is not an error.
    EXPECT_EQ(sg_transfer_wait(y, 20 * kMs), SG_ERR_TIMEOUT);
    EXPECT_EQ(sg_transfer_wait(x, 0), SG_ERR_TIMEOUT);
    EXPECT_EQ(sg_transfer_test(y), SG_IN_PROGRESS);
    ASSERT_EQ(sg_transfer_cancel(x), SG_OK);
    EXPECT_EQ(sg_transfer_wait(x, kSecond), SG_ERR_CANCELED);
    EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_ERR_CANCELED);
    EXPECT_EQ(sg_transfer_release(x), SG_OK);
    EXPECT_EQ(sg_transfer_release(y), SG_OK);
    EXPECT_EQ(sg_transfer_release(y), SG_ERR_INVALID_HANDLE);
}

// A post canceled before the decode side expected it still reaches the decode side, whenever its
// expect comes (regression: the cancel named no decode transfer and was dropped).
// After a cancel on either side, both transfers reach the quiesced state: nothing of them is in
// flight and the prefill side will not write into the decode side's blocks any more.
TEST(Session, CancelOnEitherSideQuiescesBothTransfers) {
    Pair p;
    Pool src(p.prefill.h, 2, 1, 16, 4, 8), dst(p.decode.h, 2, 1, 16, 4, 8);
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    const uint32_t t[2] = {0, 1};
    for (bool decode_cancels : {true, false}) {
        sg_transfer_t x = nullptr, y = nullptr;
        ASSERT_EQ(sg_transfer_expect(p.ds, "q", dst.kv, t, 2, 8, nullptr, &y, nullptr), SG_OK);
        ASSERT_EQ(sg_transfer_post(p.ps, "q", src.kv, t, 2, 8, nullptr, &x, nullptr), SG_OK);
        ASSERT_EQ(sg_transfer_layer_written(x, 0, nullptr), SG_OK);
        ASSERT_EQ(sg_transfer_wait_layer(y, 0, sgtest::wait_ns(5 * kSecond)), SG_OK);
        // Running transfers are not quiesced.
        EXPECT_EQ(sg_transfer_wait_quiesced(y, 10 * kMs), SG_ERR_TIMEOUT);
        EXPECT_EQ(sg_transfer_wait_quiesced(x, 0), SG_ERR_TIMEOUT);
        ASSERT_EQ(sg_transfer_cancel(decode_cancels ? y : x), SG_OK);
        EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_ERR_CANCELED) << decode_cancels;
        EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_ERR_CANCELED) << decode_cancels;
        EXPECT_EQ(sg_transfer_wait_quiesced(y, 5 * kSecond), SG_OK) << decode_cancels;
        EXPECT_EQ(sg_transfer_wait_quiesced(x, 5 * kSecond), SG_OK) << decode_cancels;
        EXPECT_EQ(sg_transfer_release(x), SG_OK);
        EXPECT_EQ(sg_transfer_release(y), SG_OK);
    }
}

// A request id canceled before its match and posted again at once: the decode side's Expect that
// was already on its way must not match the new post (it is answered with a cancel), and the next
// Expect of the id gets the new post's data.
TEST(Session, CancelThenRepostNeverMatchesAStaleExpect) {
    Pair p;
    Pool src(p.prefill.h, 1, 1, 16, 4, 8), dst(p.decode.h, 1, 1, 16, 4, 8);
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    const uint32_t t[2] = {0, 1};
    sg_transfer_options_t all;
    sg_transfer_options_init(&all);
    all.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
    for (int round = 0; round < 20; ++round) {
        const std::string rid = "again-" + std::to_string(round);
        sg_transfer_t x = nullptr, y = nullptr, x2 = nullptr, y2 = nullptr;
        ASSERT_EQ(sg_transfer_post(p.ps, rid.c_str(), src.kv, t, 2, 8, nullptr, &x, nullptr), SG_OK);
        ASSERT_EQ(sg_transfer_cancel(x), SG_OK);
        ASSERT_EQ(sg_transfer_expect(p.ds, rid.c_str(), dst.kv, t, 2, 8, nullptr, &y, nullptr), SG_OK);
        ASSERT_EQ(sg_transfer_release(x), SG_OK);
        ASSERT_EQ(sg_transfer_post(p.ps, rid.c_str(), src.kv, t, 2, 8, &all, &x2, nullptr), SG_OK);
        EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_ERR_CANCELED) << round;
        EXPECT_EQ(sg_transfer_release(y), SG_OK);
        ASSERT_EQ(sg_transfer_expect(p.ds, rid.c_str(), dst.kv, t, 2, 8, nullptr, &y2, nullptr), SG_OK);
        EXPECT_EQ(sg_transfer_wait(y2, sgtest::wait_ns(5 * kSecond)), SG_OK) << round << ": " << sg_last_error_message();
        EXPECT_EQ(sg_transfer_wait(x2, sgtest::wait_ns(5 * kSecond)), SG_OK) << round;
        sg_transfer_release(x2);
        sg_transfer_release(y2);
    }
}

// Graceful close: new transfers are refused, running ones finish, then the peer is told.
TEST(Session, GracefulCloseDrainsThenCloses) {
    Pair p;
    Pool src(p.prefill.h, 2, 1, 16, 4, 8), dst(p.decode.h, 2, 1, 16, 4, 8);
    src.fill(5);
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    const uint32_t t[2] = {0, 1};
    sg_transfer_t x = nullptr, y = nullptr, z = nullptr;
    ASSERT_EQ(sg_transfer_expect(p.ds, "drain", dst.kv, t, 2, 8, nullptr, &y, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_post(p.ps, "drain", src.kv, t, 2, 8, nullptr, &x, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_layer_written(x, 0, nullptr), SG_OK);
    EXPECT_EQ(sg_session_close(p.ps, 30 * kMs), SG_ERR_TIMEOUT);  // layer 1 is not written yet
    EXPECT_EQ(sg_transfer_post(p.ps, "late", src.kv, t, 2, 8, nullptr, &z, nullptr), SG_ERR_INVALID_STATE);
    ASSERT_EQ(sg_transfer_layer_written(x, 1, nullptr), SG_OK);
    EXPECT_EQ(sg_session_close(p.ps, 5 * kSecond), SG_OK) << sg_last_error_message();
    EXPECT_EQ(sg_transfer_wait(x, 0), SG_OK);
    EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_OK);
    // Blocks 0 and 1 (4 tokens x 16 values each) of the last layer arrived.
    EXPECT_TRUE(std::equal(src.k[1].begin(), src.k[1].begin() + 128, dst.k[1].begin()));
    // The decode side hears of the close; nothing failed and no peer counts as lost.
    sg_status_t st = SG_OK;
    for (int i = 0; i < 500 && st == SG_OK; ++i) {
        ASSERT_EQ(sg_session_error(p.ds, &st, nullptr, 0), SG_OK);
        if (st == SG_OK) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_EQ(st, SG_ERR_PEER_LOST);
    char msg[128];
    sg_session_error(p.ds, &st, msg, sizeof msg);
    EXPECT_NE(std::string(msg).find("closed"), std::string::npos) << msg;
    sg_context_stats_t stats;
    sg_context_stats_init(&stats);
    ASSERT_EQ(sg_context_stats(p.decode.h, &stats), SG_OK);
    EXPECT_EQ(stats.peers_lost, 0u);
    EXPECT_EQ(stats.transfers_failed, 0u);
    // One status per state: after this side's graceful close, an export answers as a post does
    // (INVALID_STATE, "closed by sg_session_close"); 0.4's export said PEER_LOST. The side that
    // heard the close gets PEER_LOST from both.
    Pool more(p.prefill.h, 2, 1, 16, 4, 8);
    EXPECT_EQ(sg_transfer_post(p.ps, "after", src.kv, t, 2, 8, nullptr, &z, nullptr), SG_ERR_INVALID_STATE);
    EXPECT_EQ(sg_session_export_kv(p.ps, more.kv), SG_ERR_INVALID_STATE) << sg_last_error_message();
    Pool more_dst(p.decode.h, 2, 1, 16, 4, 8);
    EXPECT_EQ(sg_transfer_expect(p.ds, "after", dst.kv, t, 2, 8, nullptr, &z, nullptr), SG_ERR_PEER_LOST);
    EXPECT_EQ(sg_session_export_kv(p.ds, more_dst.kv), SG_ERR_PEER_LOST);
    sg_transfer_release(x);
    sg_transfer_release(y);
}

// Transfer events reach the callback on the progress thread, in order, and a blocking call made
// from the callback is refused instead of stalling that thread.
struct EventLog {
    std::mutex mu;
    struct Entry {
        sg_transfer_t xfer;
        std::string rid;
        sg_event_kind_t event;
        uint32_t layer;
        sg_status_t status;
        std::thread::id thread;
        sg_status_t wait_from_callback, status_from_callback;
    };
    std::vector<Entry> entries;
    static void record(void *user, const sg_event_t *e) {
        auto *log = static_cast<EventLog *>(user);
        EXPECT_EQ(e->struct_size, sizeof(sg_event_t));
        sg_transfer_t xfer = e->transfer;
        sg_status_t current = SG_OK;
        const sg_status_t got = sg_transfer_status(xfer, &current, nullptr, 0);
        const sg_status_t wait = sg_transfer_wait(xfer, 0);
        std::lock_guard lock(log->mu);
        log->entries.push_back({xfer, e->request_id, e->kind, e->layer, e->status, std::this_thread::get_id(), wait, got});
    }
};

TEST(Session, TransferEventsRunOnTheProgressThread) {
    EventLog events;
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = "tcp";
    SG_TEST_USE_KEY(o);
    sg_context_t a = nullptr, b = nullptr;
    ASSERT_EQ(sg_context_create(&o, &a, nullptr), SG_OK);
    o.event_fn = &EventLog::record;
    o.event_user = &events;
    ASSERT_EQ(sg_context_create(&o, &b, nullptr), SG_OK);
    sg_session_t sa = nullptr, sb = nullptr;
    ASSERT_NO_FATAL_FAILURE(join_by_metadata(a, b, &sa, &sb));
    {
        Pool src(a, 3, 1, 16, 4, 8), dst(b, 3, 1, 16, 4, 8);
        ASSERT_EQ(sg_session_export_kv(sa, src.kv), SG_OK);
        ASSERT_EQ(sg_session_export_kv(sb, dst.kv), SG_OK);
        const uint32_t t[2] = {0, 1};
        sg_transfer_options_t all;
        sg_transfer_options_init(&all);
        all.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
        sg_transfer_t x = nullptr, y = nullptr;
        ASSERT_EQ(sg_transfer_expect(sb, "events", dst.kv, t, 2, 8, nullptr, &y, nullptr), SG_OK);
        ASSERT_EQ(sg_transfer_post(sa, "events", src.kv, t, 2, 8, &all, &x, nullptr), SG_OK);
        // Polling from this thread must not run callbacks here: with a progress thread they run
        // there only (sg_transfer_test and sg_context_progress used to dispatch them here).
        sg_status_t st = SG_IN_PROGRESS;
        for (int i = 0; i < 500000 && st == SG_IN_PROGRESS; ++i) {
            st = sg_transfer_test(y);
            ASSERT_EQ(sg_context_progress(b), SG_OK);
        }
        ASSERT_EQ(st, SG_OK);
        ASSERT_EQ(sg_transfer_wait_quiesced(y, 5 * kSecond), SG_OK);
        for (int i = 0; i < 1000; ++i) {
            sg_transfer_test(y);
            sg_context_progress(b);
        }
        for (int i = 0; i < 500; ++i) {
            {
                std::lock_guard lock(events.mu);
                if (!events.entries.empty() && events.entries.back().event == SG_EVENT_QUIESCED) break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        std::lock_guard lock(events.mu);
        ASSERT_EQ(events.entries.size(), 5u);
        for (uint32_t l = 0; l < 3; ++l) {
            EXPECT_EQ(events.entries[l].event, SG_EVENT_LAYER_READY);
            EXPECT_EQ(events.entries[l].layer, l);
        }
        EXPECT_EQ(events.entries[3].event, SG_EVENT_FINISHED);
        EXPECT_EQ(events.entries[3].status, SG_OK);
        EXPECT_EQ(events.entries[4].event, SG_EVENT_QUIESCED);
        for (auto &e : events.entries) {
            EXPECT_EQ(e.xfer, y);
            EXPECT_EQ(e.rid, "events");
            EXPECT_NE(e.thread, std::this_thread::get_id());
            EXPECT_EQ(e.status_from_callback, SG_OK);
            EXPECT_EQ(e.wait_from_callback, SG_ERR_INVALID_STATE);
        }
        EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_OK);
        sg_transfer_release(x);
        sg_transfer_release(y);
    }
    sg_session_destroy(sa);
    sg_session_destroy(sb);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

// The kinds of event each request id got, as a host's callback records them.
struct KindsByRequest {
    std::mutex mu;
    std::map<std::string, std::vector<sg_event_kind_t>> kinds;
    static void record(void *user, const sg_event_t *e) {
        auto *self = static_cast<KindsByRequest *>(user);
        std::lock_guard lock(self->mu);
        self->kinds[e->request_id].push_back(e->kind);
    }
    size_t count(const std::string &rid, sg_event_kind_t kind) {
        std::lock_guard lock(mu);
        const auto &v = kinds[rid];
        return size_t(std::count(v.begin(), v.end(), kind));
    }
};

// Every event a transfer emitted before its wait's condition held has been delivered when the wait
// returns, so a host that releases right after the wait (the README's pattern) gets them all: 0.4
// delivered LAYER_READY, FINISHED and QUIESCED 1.1-1.5 ms after Wait returned. With the decode
// side's progress thread and without one (then its waits deliver them on the waiting thread).
TEST(Session, EveryEventOfATransferIsDeliveredBeforeItsWaitReturns) {
    for (const bool manual : {false, true}) {
        SCOPED_TRACE(manual ? "decode side without a progress thread" : "progress threads");
        KindsByRequest pe, de;
        sg_context_options_t o;
        sg_context_options_init(&o);
        o.provider = "tcp";
        SG_TEST_USE_KEY(o);
        o.event_fn = &KindsByRequest::record;
        o.event_user = &pe;
        sg_context_t a = nullptr, b = nullptr;
        ASSERT_EQ(sg_context_create(&o, &a, nullptr), SG_OK);
        o.event_user = &de;
        o.manual_progress = manual ? 1 : 0;
        ASSERT_EQ(sg_context_create(&o, &b, nullptr), SG_OK);
        sg_session_t sa = nullptr, sb = nullptr;
        ASSERT_NO_FATAL_FAILURE(join_by_metadata(a, b, &sa, &sb));
        ASSERT_EQ(sg_session_wait_ready(sb, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
        ASSERT_EQ(sg_session_wait_ready(sa, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
        {
            Pool src(a, 3, 1, 16, 4, 8), dst(b, 3, 1, 16, 4, 8);
            ASSERT_EQ(sg_session_export_kv(sa, src.kv), SG_OK);
            ASSERT_EQ(sg_session_export_kv(sb, dst.kv), SG_OK);
            const uint32_t t[2] = {0, 1};
            sg_transfer_options_t all;
            sg_transfer_options_init(&all);
            all.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
            for (int i = 0; i < 20; ++i) {
                const std::string rid = "ev-" + std::to_string(i);
                sg_transfer_t x = nullptr, y = nullptr;
                ASSERT_EQ(sg_transfer_expect(sb, rid.c_str(), dst.kv, t, 2, 8, nullptr, &y, nullptr), SG_OK);
                ASSERT_EQ(sg_transfer_post(sa, rid.c_str(), src.kv, t, 2, 8, &all, &x, nullptr), SG_OK);
                ASSERT_EQ(sg_transfer_wait_layer(y, 2, sgtest::wait_ns(5 * kSecond)), SG_OK);
                EXPECT_GE(de.count(rid, SG_EVENT_LAYER_READY), 1u) << rid << ": layer 2's wait returned first";
                ASSERT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_OK);
                // No sleep, no progress call: the events are there when the wait returns.
                EXPECT_EQ(de.count(rid, SG_EVENT_LAYER_READY), 3u) << rid;
                EXPECT_EQ(de.count(rid, SG_EVENT_FINISHED), 1u) << rid;
                ASSERT_EQ(sg_transfer_wait_quiesced(y, 5 * kSecond), SG_OK);
                EXPECT_EQ(de.count(rid, SG_EVENT_QUIESCED), 1u) << rid;
                ASSERT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_OK);
                EXPECT_EQ(pe.count(rid, SG_EVENT_FINISHED), 1u) << rid;
                EXPECT_EQ(sg_transfer_release(y), SG_OK);
                EXPECT_EQ(sg_transfer_release(x), SG_OK);
            }
        }
        sg_session_destroy(sa);
        sg_session_destroy(sb);
        sg_context_destroy(a);
        sg_context_destroy(b);
    }
}

TEST(Session, CancelBeforeMatchReachesALaterExpect) {
    Pair p;
    Pool src(p.prefill.h, 1, 1, 16, 4, 8), dst(p.decode.h, 1, 1, 16, 4, 8);
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    const uint32_t t[2] = {0, 1};
    sg_transfer_t x = nullptr, y = nullptr;
    ASSERT_EQ(sg_transfer_post(p.ps, "gone", src.kv, t, 2, 8, nullptr, &x, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_cancel(x), SG_OK);
    EXPECT_EQ(sg_transfer_wait(x, kSecond), SG_ERR_CANCELED);
    ASSERT_EQ(sg_transfer_expect(p.ds, "gone", dst.kv, t, 2, 8, nullptr, &y, nullptr), SG_OK);
    EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_ERR_CANCELED);
    sg_transfer_release(x);
    sg_transfer_release(y);
    // The id can be used again afterwards.
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
    ASSERT_EQ(sg_transfer_expect(p.ds, "gone", dst.kv, t, 2, 8, nullptr, &y, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_post(p.ps, "gone", src.kv, t, 2, 8, &o, &x, nullptr), SG_OK);
    EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
    EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_OK);
    sg_transfer_release(x);
    sg_transfer_release(y);
}

// The mirror case, found by the soak (tools/soak, --cancel-modes decode-before): the decode side
// expects and cancels before the prefill side posts; the later post must fail with
// SG_ERR_CANCELED, as sg_transfer_cancel promises, instead of waiting for an Expect that never
// comes.
TEST(Session, DecodeCancelBeforeMatchReachesALaterPost) {
    Pair p;
    Pool src(p.prefill.h, 1, 1, 16, 4, 8), dst(p.decode.h, 1, 1, 16, 4, 8);
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    const uint32_t t[2] = {0, 1};
    sg_transfer_t x = nullptr, y = nullptr;
    ASSERT_EQ(sg_transfer_expect(p.ds, "withdrawn", dst.kv, t, 2, 8, nullptr, &y, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_cancel(y), SG_OK);
    EXPECT_EQ(sg_transfer_wait(y, kSecond), SG_ERR_CANCELED);
    // Quiesced comes from the prefill side's answer to the cancel: it has heard of it now.
    ASSERT_EQ(sg_transfer_wait_quiesced(y, 5 * kSecond), SG_OK);
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
    ASSERT_EQ(sg_transfer_post(p.ps, "withdrawn", src.kv, t, 2, 8, &o, &x, nullptr), SG_OK);
    EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_ERR_CANCELED);
    EXPECT_EQ(sg_transfer_wait_quiesced(x, kSecond), SG_OK);
    sg_transfer_release(x);
    sg_transfer_release(y);
    // A new Expect of the id is a new request: it matches the next post.
    ASSERT_EQ(sg_transfer_expect(p.ds, "withdrawn", dst.kv, t, 2, 8, nullptr, &y, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_post(p.ps, "withdrawn", src.kv, t, 2, 8, &o, &x, nullptr), SG_OK);
    EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
    EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_OK);
    sg_transfer_release(x);
    sg_transfer_release(y);
}

// A match that fails (token counts differ) ends that request only: the id works again afterwards,
// whichever side came first. Before, a post refused at its match stayed registered (the next post
// of the id was SG_ERR_DUPLICATE), and a post failed by a later Expect was remembered as canceled
// before its match (every later Expect of the id was answered with the error).
TEST(Session, AFailedMatchLeavesTheRequestIdUsable) {
    Pair p;
    Pool src(p.prefill.h, 1, 1, 16, 4, 8), dst(p.decode.h, 1, 1, 16, 4, 8);
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    const uint32_t t[3] = {0, 1, 2};
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
    auto run_ok = [&](const char *rid) {
        sg_transfer_t x = nullptr, y = nullptr;
        ASSERT_EQ(sg_transfer_expect(p.ds, rid, dst.kv, t, 2, 8, nullptr, &y, nullptr), SG_OK);
        ASSERT_EQ(sg_transfer_post(p.ps, rid, src.kv, t, 2, 8, &o, &x, nullptr), SG_OK) << sg_last_error_message();
        EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
        EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
        sg_transfer_release(x);
        sg_transfer_release(y);
    };
    // Expect first, then a post of another length: the post call fails at its match.
    {
        sg_transfer_t x = nullptr, y = nullptr;
        ASSERT_EQ(sg_transfer_expect(p.ds, "mismatch-a", dst.kv, t, 3, 12, nullptr, &y, nullptr), SG_OK);
        sg_status_t st = SG_IN_PROGRESS;
        for (int i = 0; i < 500 && st != SG_ERR_LAYOUT_MISMATCH; ++i) {  // until the Expect is there
            st = sg_transfer_post(p.ps, "mismatch-a", src.kv, t, 2, 8, &o, &x, nullptr);
            if (st == SG_OK) {  // it came before the Expect: the match fails on arrival instead
                EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_ERR_LAYOUT_MISMATCH);
                sg_transfer_release(x);
                st = SG_ERR_LAYOUT_MISMATCH;
            }
        }
        EXPECT_EQ(st, SG_ERR_LAYOUT_MISMATCH);
        EXPECT_LT(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), 0);
        sg_transfer_release(y);
    }
    run_ok("mismatch-a");
    // Post first, then an Expect of another length: the match fails when the Expect arrives.
    {
        sg_transfer_t x = nullptr, y = nullptr;
        ASSERT_EQ(sg_transfer_post(p.ps, "mismatch-b", src.kv, t, 2, 8, &o, &x, nullptr), SG_OK);
        ASSERT_EQ(sg_transfer_expect(p.ds, "mismatch-b", dst.kv, t, 3, 12, nullptr, &y, nullptr), SG_OK);
        EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_ERR_LAYOUT_MISMATCH);
        EXPECT_LT(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), 0);
        sg_transfer_release(x);
        sg_transfer_release(y);
    }
    run_ok("mismatch-b");
}

// Hosts that want no library threads drive progress themselves.
TEST(Session, HostDrivenProgress) {
    Pair p(false);
    Pool src(p.prefill.h, 2, 2, 32, 8, 16), dst(p.decode.h, 2, 2, 32, 8, 16);
    src.fill(3);
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    auto t = iota_table(16);
    sg_transfer_t x = nullptr, y = nullptr;
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
    ASSERT_EQ(sg_transfer_expect(p.ds, "host", dst.kv, t.data(), 16, 128, nullptr, &y, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_post(p.ps, "host", src.kv, t.data(), 16, 128, &o, &x, nullptr), SG_OK);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while ((sg_transfer_test(x) == SG_IN_PROGRESS || sg_transfer_test(y) == SG_IN_PROGRESS) &&
           std::chrono::steady_clock::now() < deadline) {
        ASSERT_EQ(sg_context_progress(p.prefill.h), SG_OK);
        ASSERT_EQ(sg_context_progress(p.decode.h), SG_OK);
    }
    EXPECT_EQ(sg_transfer_test(x), SG_OK);
    EXPECT_EQ(sg_transfer_test(y), SG_OK);
    for (uint32_t l = 0; l < 2; ++l) EXPECT_EQ(src.k[l], dst.k[l]);
    sg_transfer_release(x);
    sg_transfer_release(y);
}

// verbs and EFA need a device this machine lacks (and Soft-RoCE cannot load here); their ranking and
// MR regime are covered by the fake capability tables in unit/rank_test.cpp.
class RdmaProvider : public ::testing::TestWithParam<const char *> {};

TEST_P(RdmaProvider, MovesAPoolWhenADeviceIsPresent) {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = GetParam();
    SG_TEST_USE_KEY(o);
    sg_context_t a = nullptr;
    sg_error_info_t err;
    sg_error_info_init(&err);
    const sg_status_t st = sg_context_create(&o, &a, &err);
    if (st == SG_ERR_NO_PROVIDER || st == SG_ERR_TRANSPORT)
        GTEST_SKIP() << GetParam() << " has no device on this machine: " << err.message;
    ASSERT_EQ(st, SG_OK) << err.message;
    sg_context_t b = nullptr;
    ASSERT_EQ(sg_context_create(&o, &b, &err), SG_OK) << err.message;
    sg_session_t sa = nullptr, sb = nullptr;
    ASSERT_NO_FATAL_FAILURE(join_by_metadata(a, b, &sa, &sb));
    {
        Pool src(a, 2, 2, 64, 16, 8), dst(b, 2, 2, 64, 16, 8);
        src.fill(9);
        ASSERT_EQ(sg_session_export_kv(sa, src.kv), SG_OK);
        ASSERT_EQ(sg_session_export_kv(sb, dst.kv), SG_OK);
        auto t = iota_table(8);
        sg_transfer_options_t to;
        sg_transfer_options_init(&to);
        to.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
        sg_transfer_t x = nullptr, y = nullptr;
        ASSERT_EQ(sg_transfer_expect(sb, "rdma", dst.kv, t.data(), 8, 128, nullptr, &y, nullptr), SG_OK);
        ASSERT_EQ(sg_transfer_post(sa, "rdma", src.kv, t.data(), 8, 128, &to, &x, nullptr), SG_OK);
        EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_OK);
        EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_OK);
        EXPECT_EQ(src.k, dst.k);
        sg_transfer_release(x);
        sg_transfer_release(y);
    }
    sg_session_destroy(sa);
    sg_session_destroy(sb);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

INSTANTIATE_TEST_SUITE_P(Fabrics, RdmaProvider, ::testing::Values("verbs", "efa"));

TEST(Session, CountersAndPrometheusText) {
    Pair p;
    Pool src(p.prefill.h, 2, 2, 32, 8, 16), dst(p.decode.h, 2, 2, 32, 8, 16);
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    const std::vector<uint32_t> t = {3, 9, 1, 12};
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
    sg_transfer_t x = nullptr, y = nullptr, z = nullptr;
    ASSERT_EQ(sg_transfer_expect(p.ds, "m", dst.kv, t.data(), 4, 32, nullptr, &y, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_post(p.ps, "m", src.kv, t.data(), 4, 32, &o, &x, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_OK);
    ASSERT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_OK);
    ASSERT_EQ(sg_transfer_post(p.ps, "never", src.kv, t.data(), 4, 32, nullptr, &z, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_cancel(z), SG_OK);
    sg_transfer_stats_t ts;
    sg_transfer_stats_init(&ts);
    ASSERT_EQ(sg_transfer_stats(x, &ts), SG_OK);

    sg_context_stats_t cs;
    sg_context_stats_init(&cs);
    ASSERT_EQ(sg_context_stats(p.prefill.h, &cs), SG_OK);
    EXPECT_EQ(cs.transfers_completed, 1u);
    EXPECT_EQ(cs.transfers_failed, 1u);
    EXPECT_EQ(cs.transfers_canceled, 1u);
    EXPECT_EQ(cs.rma_ops, ts.rma_ops);
    EXPECT_EQ(cs.bytes_direct + cs.bytes_staged, ts.bytes);
    EXPECT_EQ(cs.sessions_open, 1u);
    EXPECT_GT(cs.messages_sent, 0u);
    EXPECT_GT(cs.messages_received, 0u);
    EXPECT_EQ(cs.peers_lost, 0u);

    size_t len = 0;
    ASSERT_EQ(sg_context_metrics_text(p.prefill.h, nullptr, 0, &len), SG_OK);
    std::string text(len + 1, '\0');
    ASSERT_EQ(sg_context_metrics_text(p.prefill.h, text.data(), text.size(), &len), SG_OK);
    text.resize(len);
    EXPECT_NE(text.find("# TYPE smartgen_rma_ops_total counter\n"), std::string::npos) << text;
    EXPECT_NE(text.find("\nsmartgen_rma_ops_total " + std::to_string(ts.rma_ops) + "\n"), std::string::npos) << text;
    EXPECT_NE(text.find("smartgen_transfers_total{result=\"completed\"} 1\n"), std::string::npos) << text;
    EXPECT_NE(text.find("# TYPE smartgen_sessions_open gauge\n"), std::string::npos) << text;
    sg_transfer_release(x);
    sg_transfer_release(y);
    sg_transfer_release(z);
}

bool readable(int fd, int timeout_ms) {
    pollfd p{fd, POLLIN, 0};
    return ::poll(&p, 1, timeout_ms) == 1;
}

void drain(int fd) {
    uint64_t v;
    while (::read(fd, &v, sizeof v) == sizeof v) {
    }
}

// Notifications travel in order; the context's event fd tells an epoll-style host when to look.
TEST(Session, NotificationsAndEventFd) {
    Pair p;
    int efd = -1;
    ASSERT_EQ(sg_context_event_fd(p.decode.h, &efd), SG_OK);
    ASSERT_GE(efd, 0);
    drain(efd);
    char buf[SG_NOTIFY_MAX];
    size_t len = 0;
    EXPECT_EQ(sg_session_next_notification(p.ds, buf, sizeof buf, &len), SG_ERR_AGAIN);
    for (int i = 0; i < 100; ++i) {
        const std::string msg = "first-token:" + std::to_string(i);
        ASSERT_EQ(sg_session_notify(p.ps, msg.data(), msg.size()), SG_OK);
    }
    std::vector<char> big(SG_NOTIFY_MAX + 1, 'x');
    EXPECT_EQ(sg_session_notify(p.ps, big.data(), big.size()), SG_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(sg_session_notify(p.ps, big.data(), 0), SG_ERR_INVALID_ARGUMENT);
    ASSERT_EQ(sg_session_notify(p.ps, big.data(), SG_NOTIFY_MAX), SG_OK);
    ASSERT_TRUE(readable(efd, 5000));
    for (int i = 0; i < 100; ++i) {
        sg_status_t st;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while ((st = sg_session_next_notification(p.ds, buf, sizeof buf, &len)) == SG_ERR_AGAIN &&
               std::chrono::steady_clock::now() < deadline)
            readable(efd, 100), drain(efd);
        ASSERT_EQ(st, SG_OK);
        EXPECT_EQ(std::string(buf, len), "first-token:" + std::to_string(i));
    }
    sg_status_t st;
    while ((st = sg_session_next_notification(p.ds, buf, 10, &len)) == SG_ERR_AGAIN) readable(efd, 100);
    EXPECT_EQ(st, SG_ERR_BUFFER_TOO_SMALL);
    EXPECT_EQ(len, size_t(SG_NOTIFY_MAX));
    ASSERT_EQ(sg_session_next_notification(p.ds, buf, sizeof buf, &len), SG_OK);
    EXPECT_EQ(len, size_t(SG_NOTIFY_MAX));

    // A completed transfer also makes the fd readable.
    drain(efd);
    Pool src(p.prefill.h, 1, 1, 16, 4, 4), dst(p.decode.h, 1, 1, 16, 4, 4);
    ASSERT_EQ(sg_session_export_kv(p.ps, src.kv), SG_OK);
    ASSERT_EQ(sg_session_export_kv(p.ds, dst.kv), SG_OK);
    const uint32_t t[1] = {2};
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
    sg_transfer_t x = nullptr, y = nullptr;
    ASSERT_EQ(sg_transfer_expect(p.ds, "ev", dst.kv, t, 1, 4, nullptr, &y, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_post(p.ps, "ev", src.kv, t, 1, 4, &o, &x, nullptr), SG_OK);
    ASSERT_TRUE(readable(efd, 5000));
    EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_OK);
    EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_OK);
    sg_transfer_release(x);
    sg_transfer_release(y);
}

// A full request queue answers SG_ERR_AGAIN instead of blocking; a small in-flight bound still moves
// everything (it only paces the writes).
TEST(Session, FullQueueAnswersAgainAndSmallBoundsStillMoveData) {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = "tcp";
    o.max_transfers_per_session = 2;
    o.max_bytes_in_flight = 8192;
    o.max_session_bytes_in_flight = 4096;
    SG_TEST_USE_KEY(o);
    sg_context_t a = nullptr, b = nullptr;
    ASSERT_EQ(sg_context_create(&o, &a, nullptr), SG_OK);
    ASSERT_EQ(sg_context_create(&o, &b, nullptr), SG_OK);
    sg_session_t sa = nullptr, sb = nullptr;
    ASSERT_NO_FATAL_FAILURE(join_by_metadata(a, b, &sa, &sb));
    {
        Pool src(a, 2, 2, 32, 8, 32), dst(b, 2, 2, 32, 8, 32);
        src.fill(21);
        ASSERT_EQ(sg_session_export_kv(sa, src.kv), SG_OK);
        ASSERT_EQ(sg_session_export_kv(sb, dst.kv), SG_OK);
        const std::vector<uint32_t> t1 = {1, 5, 9, 13, 17, 21, 25, 29}, t2 = {0, 4, 8, 12, 16, 20, 24, 28};
        sg_transfer_t x1 = nullptr, x2 = nullptr, x3 = nullptr, y1 = nullptr, y2 = nullptr;
        ASSERT_EQ(sg_transfer_post(sa, "q1", src.kv, t1.data(), 8, 64, nullptr, &x1, nullptr), SG_OK);
        ASSERT_EQ(sg_transfer_post(sa, "q2", src.kv, t2.data(), 8, 64, nullptr, &x2, nullptr), SG_OK);
        EXPECT_EQ(sg_transfer_post(sa, "q3", src.kv, t2.data(), 8, 64, nullptr, &x3, nullptr), SG_ERR_AGAIN);
        EXPECT_EQ(x3, nullptr);
        ASSERT_EQ(sg_transfer_expect(sb, "q1", dst.kv, t1.data(), 8, 64, nullptr, &y1, nullptr), SG_OK);
        ASSERT_EQ(sg_transfer_expect(sb, "q2", dst.kv, t2.data(), 8, 64, nullptr, &y2, nullptr), SG_OK);
        for (uint32_t l = 0; l < 2; ++l) {
            ASSERT_EQ(sg_transfer_layer_written(x1, l, nullptr), SG_OK);
            ASSERT_EQ(sg_transfer_layer_written(x2, l, nullptr), SG_OK);
        }
        EXPECT_EQ(sg_transfer_wait(y1, sgtest::wait_ns(5 * kSecond)), SG_OK);
        EXPECT_EQ(sg_transfer_wait(y2, sgtest::wait_ns(5 * kSecond)), SG_OK);
        EXPECT_EQ(sg_transfer_wait(x1, sgtest::wait_ns(5 * kSecond)), SG_OK);
        EXPECT_EQ(sg_transfer_wait(x2, sgtest::wait_ns(5 * kSecond)), SG_OK);
        const size_t be = 8 * 2 * 32;  // elements of one block
        for (uint32_t l = 0; l < 2; ++l)
            for (const auto *tab : {&t1, &t2})
                for (uint32_t blk : *tab) {
                    EXPECT_EQ(std::memcmp(&src.k[l][blk * be], &dst.k[l][blk * be], be * 2), 0) << blk;
                    EXPECT_EQ(std::memcmp(&src.v[l][blk * be], &dst.v[l][blk * be], be * 2), 0) << blk;
                }
        // Finished transfers no longer count against the queue.
        EXPECT_EQ(sg_transfer_post(sa, "q3", src.kv, t2.data(), 8, 64, nullptr, &x3, nullptr), SG_OK);
        for (sg_transfer_t h : {x1, x2, x3, y1, y2}) sg_transfer_release(h);
    }
    sg_session_destroy(sa);
    sg_session_destroy(sb);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

// A decode engine restarts: its old session is reported lost, and a new session to the same
// prefill context reuses the same registered pool handle.
TEST(Session, ReconnectAfterPeerRestartKeepsHandles) {
    Ctx prefill;
    sg_listener_t l = nullptr;
    ASSERT_EQ(sg_listener_create(prefill.h, "127.0.0.1", 0, &l, nullptr), SG_OK);
    uint16_t port = 0;
    sg_listener_port(l, &port);
    Pool src(prefill.h, 2, 2, 32, 8, 16);
    src.fill(77);
    const std::vector<uint32_t> t = {4, 2, 9};
    for (int round = 0; round < 2; ++round) {
        auto decode = std::make_unique<Ctx>();
        sg_session_t ps = nullptr, ds = nullptr;
        std::thread c([&] { EXPECT_EQ(sg_session_connect(decode->h, "127.0.0.1", port, nullptr, sgtest::wait_ns(5 * kSecond), &ds, nullptr), SG_OK); });
        ASSERT_EQ(sg_session_accept(l, nullptr, sgtest::wait_ns(5 * kSecond), &ps, nullptr), SG_OK);
        c.join();
        {
            Pool dst(decode->h, 2, 2, 32, 8, 16);
            ASSERT_EQ(sg_session_export_kv(ps, src.kv), SG_OK);  // same handle, new session
            ASSERT_EQ(sg_session_export_kv(ds, dst.kv), SG_OK);
            sg_transfer_options_t o;
            sg_transfer_options_init(&o);
            o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
            sg_transfer_t x = nullptr, y = nullptr;
            ASSERT_EQ(sg_transfer_expect(ds, "again", dst.kv, t.data(), 3, 24, nullptr, &y, nullptr), SG_OK);
            ASSERT_EQ(sg_transfer_post(ps, "again", src.kv, t.data(), 3, 24, &o, &x, nullptr), SG_OK);
            EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_OK) << "round " << round;
            EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_OK) << "round " << round;
            const size_t be = 8 * 2 * 32;
            for (uint32_t blk : t) EXPECT_EQ(std::memcmp(&src.k[1][blk * be], &dst.k[1][blk * be], be * 2), 0);
            sg_transfer_release(x);
            sg_transfer_release(y);
            sg_session_destroy(ds);
        }
        decode.reset();  // the decode engine goes away
        sg_status_t st = SG_OK;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (sg_session_error(ps, &st, nullptr, 0) == SG_OK && st == SG_OK && std::chrono::steady_clock::now() < deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        EXPECT_EQ(st, SG_ERR_PEER_LOST);
        sg_session_destroy(ps);
    }
    sg_listener_destroy(l);
}

TEST(Session, TunablesHaveBounds) {
    Ctx c;
    uint64_t lo = 0, hi = 0, v = 0;
    ASSERT_EQ(sg_param_bounds(SG_PARAM_MAX_OPS_IN_FLIGHT, &lo, &hi), SG_OK);
    EXPECT_EQ(sg_context_set_param(c.h, SG_PARAM_MAX_OPS_IN_FLIGHT, hi + 1), SG_ERR_OUT_OF_RANGE);
    EXPECT_EQ(sg_context_set_param(c.h, SG_PARAM_MAX_OPS_IN_FLIGHT, lo), SG_OK);
    ASSERT_EQ(sg_context_get_param(c.h, SG_PARAM_MAX_OPS_IN_FLIGHT, &v), SG_OK);
    EXPECT_EQ(v, lo);
    EXPECT_EQ(sg_context_get_param(c.h, sg_param_t(77), &v), SG_ERR_INVALID_ARGUMENT);
    char name[64];
    ASSERT_EQ(sg_context_provider(c.h, name, sizeof name), SG_OK);
    EXPECT_STREQ(name, "tcp;ofi_rxm");
    EXPECT_EQ(sg_context_provider(c.h, name, 3), SG_ERR_BUFFER_TOO_SMALL);
}

// The side with the shorter peer timeout judges the other's keep-alives: a context with a long
// timeout keeps a short-timeout peer's session by pinging at the peer's pace (its Ping says it),
// not every eighth of its own 60 s. Before, the 60 s side pinged every 7.5 s and an idle session
// was lost on the 2 s side after 2 s.
TEST(Session, KeepAlivesFollowTheShorterTimeout) {
    sg_context_t brief = make_test_context("tcp", 2000), patient = make_test_context("tcp", 60000);
    sg_session_t bs = nullptr, ps = nullptr;
    join_by_metadata(brief, patient, &bs, &ps);
    ASSERT_TRUE(bs && ps);
    sg_context_stats_t before, after;
    sg_context_stats_init(&before);
    sg_context_stats_init(&after);
    ASSERT_EQ(sg_context_stats(patient, &before), SG_OK);
    std::this_thread::sleep_for(std::chrono::milliseconds(3000));
    ASSERT_EQ(sg_context_stats(patient, &after), SG_OK);
    sg_status_t err = SG_OK;
    ASSERT_EQ(sg_session_error(bs, &err, nullptr, 0), SG_OK);
    EXPECT_EQ(err, SG_OK) << "the 2 s side lost an idle session with a 60 s peer";
    ASSERT_EQ(sg_session_error(ps, &err, nullptr, 0), SG_OK);
    EXPECT_EQ(err, SG_OK);
    // One keep-alive per 250 ms: 12 in 3 s; a loaded host may skip some, never most.
    EXPECT_GE(after.messages_sent - before.messages_sent, 6u);
    sg_session_destroy(bs);
    sg_session_destroy(ps);
    EXPECT_EQ(sg_context_destroy(brief), SG_OK);
    EXPECT_EQ(sg_context_destroy(patient), SG_OK);
}

TEST(Session, ConnectFailuresAreReported) {
    Ctx c;
    sg_session_t s = nullptr;
    sg_error_info_t err;
    sg_error_info_init(&err);
    EXPECT_EQ(sg_session_connect(c.h, "localhost", 1, nullptr, kSecond / 2, &s, &err), SG_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(err.message).find("literal"), std::string::npos);
    // Port 1 on loopback: nothing listens there.
    EXPECT_EQ(sg_session_connect(c.h, "127.0.0.1", 1, nullptr, kSecond / 2, &s, &err), SG_ERR_CONNECT);
    sg_listener_t l = nullptr;
    ASSERT_EQ(sg_listener_create(c.h, "127.0.0.1", 0, &l, nullptr), SG_OK);
    EXPECT_EQ(sg_session_accept(l, nullptr, 50 * kMs, &s, nullptr), SG_ERR_TIMEOUT);
    sg_listener_destroy(l);
}

}  // namespace

namespace {

// Destroying a session fails its transfers; unmatched posts leave their map as they fail, which
// once broke the walk over it.
TEST(Session, DestroyWithSeveralUnmatchedPostsFailsThemAll) {
    Pair pair;
    Pool src(pair.prefill.h, 2, 2, 16, 16, 8);
    ASSERT_EQ(sg_session_export_kv(pair.ps, src.kv), SG_OK);
    const auto table = iota_table(8);
    std::vector<sg_transfer_t> posts;
    for (const char *rid : {"a", "b", "c"}) {
        sg_transfer_t x = nullptr;
        ASSERT_EQ(sg_transfer_post(pair.ps, rid, src.kv, table.data(), 8, 128, nullptr, &x, nullptr), SG_OK);
        posts.push_back(x);
    }
    ASSERT_EQ(sg_session_destroy(pair.ps), SG_OK);
    pair.ps = nullptr;
    for (sg_transfer_t x : posts) {
        EXPECT_EQ(sg_transfer_test(x), SG_ERR_CANCELED);
        EXPECT_EQ(sg_transfer_release(x), SG_OK);
    }
}

}  // namespace
