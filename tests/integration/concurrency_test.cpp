// One prefill context serving four decode contexts at once: 8 threads post 4 sessions' worth of
// transfers concurrently while 8 decode threads expect them; every byte is checked. Built and run
// under ThreadSanitizer by the tsan preset.
#include <smartgen/smartgen.h>

#include "../test_key.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr uint64_t kSecond = 1000000000ull;
constexpr uint32_t kLayers = 2, kHeads = 2, kDim = 32, kTpb = 8, kBlocks = 256;
constexpr int kSessions = 4, kThreads = 8, kPerThread = 12;

struct Pool {
    std::vector<std::vector<uint16_t>> k, v;
    std::vector<void *> kp, vp;
    sg_kv_layout_t layout;
    sg_kv_handle_t h = nullptr;
    explicit Pool(sg_context_t ctx) {
        for (uint32_t l = 0; l < kLayers; ++l) {
            k.emplace_back(size_t(kBlocks) * kTpb * kHeads * kDim);
            v.emplace_back(size_t(kBlocks) * kTpb * kHeads * kDim);
        }
        for (uint32_t l = 0; l < kLayers; ++l) {
            kp.push_back(k[l].data());
            vp.push_back(v[l].data());
        }
        sg_kv_layout_init(&layout);
        layout.num_layers = kLayers;
        layout.num_kv_heads = kHeads;
        layout.head_dim = kDim;
        layout.tokens_per_block = kTpb;
        layout.num_blocks = kBlocks;
        layout.layer_k_base = kp.data();
        layout.layer_v_base = vp.data();
        layout.layer_base_count = kLayers;
        EXPECT_EQ(sg_kv_register(ctx, &layout, &h, nullptr), SG_OK);
    }
};

sg_context_t make(void) {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = "tcp";
    SG_TEST_USE_KEY(o);
    sg_context_t c = nullptr;
    EXPECT_EQ(sg_context_create(&o, &c, nullptr), SG_OK) << sg_last_error_message();
    return c;
}

// Each (thread, i) owns 4 distinct blocks of the pools, so concurrent transfers never share bytes.
std::vector<uint32_t> blocks_of(int thread, int i) {
    const uint32_t base = uint32_t((thread * kPerThread + i) % 64) * 4;
    return {base + 2, base, base + 3, base + 1};
}

uint16_t value(uint32_t layer, size_t elem) { return uint16_t(layer * 7919 + elem * 131); }

TEST(Concurrency, EightThreadsPostToFourSessions) {
    sg_context_t prefill = make();
    std::vector<sg_context_t> decode(kSessions);
    for (auto &d : decode) d = make();
    sg_listener_t lis = nullptr;
    ASSERT_EQ(sg_listener_create(prefill, "127.0.0.1", 0, &lis, nullptr), SG_OK);
    uint16_t port = 0;
    sg_listener_port(lis, &port);
    std::vector<sg_session_t> ps(kSessions), ds(kSessions);
    for (int s = 0; s < kSessions; ++s) {
        std::thread c([&, s] { EXPECT_EQ(sg_session_connect(decode[s], "127.0.0.1", port, nullptr, 5 * kSecond, &ds[s], nullptr), SG_OK); });
        ASSERT_EQ(sg_session_accept(lis, nullptr, 5 * kSecond, &ps[s], nullptr), SG_OK);
        c.join();
    }
    Pool src(prefill);
    std::vector<std::unique_ptr<Pool>> dst;
    for (int s = 0; s < kSessions; ++s) {
        dst.push_back(std::make_unique<Pool>(decode[s]));
        ASSERT_EQ(sg_session_export_kv(ps[s], src.h), SG_OK);
        ASSERT_EQ(sg_session_export_kv(ds[s], dst[s]->h), SG_OK);
    }
    const size_t block_elems = size_t(kTpb) * kHeads * kDim;
    // Source bytes are written before any thread starts, so posts only read them.
    for (int th = 0; th < kThreads; ++th)
        for (int i = 0; i < kPerThread; ++i)
            for (uint32_t l = 0; l < kLayers; ++l)
                for (uint32_t b : blocks_of(th, i))
                    for (size_t e = 0; e < block_elems; ++e) {
                        // Tables are the same on both sides, so the value depends on position only.
                        src.k[l][b * block_elems + e] = value(l, b * block_elems + e);
                        src.v[l][b * block_elems + e] = uint16_t(~value(l, b * block_elems + e));
                    }
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int th = 0; th < kThreads; ++th) {
        const int s = th % kSessions;
        threads.emplace_back([&, th, s] {  // decode side of this thread's requests
            for (int i = 0; i < kPerThread; ++i) {
                const auto t = blocks_of(th, i);
                const std::string rid = "t" + std::to_string(th) + "-" + std::to_string(i);
                sg_transfer_t y = nullptr;
                if (sg_transfer_expect(ds[s], rid.c_str(), dst[s]->h, t.data(), 4, 4 * kTpb, nullptr, &y, nullptr) != SG_OK ||
                    sg_transfer_wait(y, 10 * kSecond) != SG_OK)
                    failures++;
                sg_transfer_release(y);
            }
        });
        threads.emplace_back([&, th, s] {  // prefill side
            sg_transfer_options_t o;
            sg_transfer_options_init(&o);
            o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
            for (int i = 0; i < kPerThread; ++i) {
                const auto t = blocks_of(th, i);
                const std::string rid = "t" + std::to_string(th) + "-" + std::to_string(i);
                sg_transfer_t x = nullptr;
                if (sg_transfer_post(ps[s], rid.c_str(), src.h, t.data(), 4, 4 * kTpb, &o, &x, nullptr) != SG_OK ||
                    sg_transfer_wait(x, 10 * kSecond) != SG_OK)
                    failures++;
                sg_transfer_stats_t st;
                sg_transfer_stats_init(&st);
                sg_transfer_stats(x, &st);
                sg_transfer_release(x);
            }
        });
    }
    for (auto &t : threads) t.join();
    EXPECT_EQ(failures.load(), 0);
    for (int th = 0; th < kThreads; ++th) {
        const int s = th % kSessions;
        for (int i = 0; i < kPerThread; ++i)
            for (uint32_t l = 0; l < kLayers; ++l)
                for (uint32_t b : blocks_of(th, i))
                    ASSERT_EQ(std::memcmp(&dst[s]->k[l][b * block_elems], &src.k[l][b * block_elems], block_elems * 2), 0)
                        << "thread " << th << " request " << i << " layer " << l << " block " << b;
    }
    sg_context_stats_t cs;
    sg_context_stats_init(&cs);
    ASSERT_EQ(sg_context_stats(prefill, &cs), SG_OK);
    EXPECT_EQ(cs.transfers_completed, uint64_t(kThreads * kPerThread));
    EXPECT_EQ(cs.sessions_open, uint64_t(kSessions));
    for (int s = 0; s < kSessions; ++s) {
        sg_session_destroy(ps[s]);
        sg_session_destroy(ds[s]);
        sg_context_destroy(decode[s]);
    }
    sg_listener_destroy(lis);
    sg_context_destroy(prefill);
}

}  // namespace
