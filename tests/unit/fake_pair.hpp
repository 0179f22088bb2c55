// Two contexts on the fake fabric with a session between them, driven by the test on one thread:
// progress_once on the two in an order the seed chooses, the test clock advancing one tick per
// round. Only the core's entry points are used (Context, metadata, open_session, wait_ready,
// export_kv, expect, post, layer_written, fetch, wait, cancel, release, wait_quiesced,
// close_session, progress_once, stats) and Transfer's status, finished(), is_quiesced(), residency.
#pragma once

#include "support/host_pool.hpp"
#include "core/core.hpp"
#include "transport/fake.hpp"

#include "../test_key.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <vector>

namespace sg::testing {

namespace fake = sg::transport::fake;

// Any nonzero start: the core subtracts times, and 0 means "no test clock".
inline constexpr uint64_t kClockStartNs = 1000ull * 1000000000ull;
// One round of progress is 20 us of test time: the core's 200 us back-off after EAGAIN passes in
// ten rounds, its 10 ms timer sweep in 500, and a 2 s peer timeout is never reached by accident.
inline constexpr uint64_t kTickNs = 20000;
inline constexpr uint64_t kMs = 1000000;

struct TestClock {
    uint64_t now = kClockStartNs;
    TestClock() { set_test_clock_ns(now); }
    ~TestClock() { set_test_clock_ns(0); }
    TestClock(const TestClock &) = delete;
    void advance(uint64_t ns) {
        now += ns;
        set_test_clock_ns(now);
    }
};

// A host-memory fp16 pool, one KV head, K and V separate, filled from a seed.
struct HostPool : sgtest::HostPool {
    uint32_t layers, blocks, head_dim, tpb;
    HostPool(uint32_t layers_, uint32_t blocks_, uint32_t head_dim_ = 64, uint32_t tpb_ = 4)
        : sgtest::HostPool({layers_, 1, head_dim_, tpb_, blocks_}),
          layers(layers_),
          blocks(blocks_),
          head_dim(head_dim_),
          tpb(tpb_) {}
    size_t block_elems() const { return size_t(tpb) * head_dim; }
    // Finite fp16 values (exponent bits never all ones), so selection's digests stay numbers.
    void fill(uint64_t seed) {
        fake::Rng r(seed);
        for (auto *planes : {&k, &v})
            for (auto &p : *planes)
                for (auto &x : p) x = uint16_t(r.next() & 0xbbff);
    }
    // The (layer, block) a landing address falls in; false outside the pool.
    bool locate(uint64_t addr, uint32_t &layer, uint32_t &block) const {
        for (uint32_t l = 0; l < layers; ++l)
            for (auto *plane : {&k[l], &v[l]}) {
                const uint64_t base = reinterpret_cast<uint64_t>(plane->data());
                if (addr >= base && addr < base + plane->size() * 2) {
                    layer = l;
                    block = uint32_t((addr - base) / (block_elems() * 2));
                    return true;
                }
            }
        return false;
    }
};

// Whether the decode pool holds the request's tokens exactly as the prefill pool does (blocks of
// the layers given, or all), through both block tables.
inline bool same_tokens(const HostPool &src, const std::vector<uint32_t> &st, const HostPool &dst,
                        const std::vector<uint32_t> &dt, uint64_t tokens, uint32_t layer, size_t index) {
    const uint64_t first = uint64_t(index) * src.tpb;
    const uint64_t n = std::min<uint64_t>(src.tpb, tokens - first);
    const size_t bytes = size_t(n) * src.head_dim * 2;
    const size_t so = size_t(st[index]) * src.block_elems(), dso = size_t(dt[index]) * dst.block_elems();
    return std::memcmp(src.k[layer].data() + so, dst.k[layer].data() + dso, bytes) == 0 &&
           std::memcmp(src.v[layer].data() + so, dst.v[layer].data() + dso, bytes) == 0;
}

inline std::vector<uint32_t> iota_table(size_t n, uint32_t first = 0) {
    std::vector<uint32_t> t(n);
    std::iota(t.begin(), t.end(), first);
    return t;
}

inline sg_transfer_options_t transfer_options(uint32_t paths = 0) {
    sg_transfer_options_t o{};
    o.struct_size = sizeof o;
    o.paths = paths;
    return o;
}

struct PairConfig {
    fake::Knobs knobs;
    uint32_t max_ops_in_flight = 0;  // 0: the context's defaults
    uint64_t max_bytes_in_flight = 0;
    uint64_t max_session_bytes_in_flight = 0;
    uint32_t peer_timeout_ms = 0;
    uint32_t lanes = 0;         // 0: one (SG_LANES aside)
    uint32_t decode_lanes = 0;  // the decode side's, when it differs (0: lanes)
};

inline sg_context_options_t context_options(const PairConfig &cfg) {
    sg_context_options_t o{};
    o.struct_size = sizeof o;
    o.provider = "fake";
    o.manual_progress = 1;
    o.log_level = SG_LOG_OFF;
    o.max_ops_in_flight = cfg.max_ops_in_flight;
    o.max_bytes_in_flight = cfg.max_bytes_in_flight;
    o.max_session_bytes_in_flight = cfg.max_session_bytes_in_flight;
    o.peer_timeout_ms = cfg.peer_timeout_ms;
    o.lanes = cfg.lanes;
    SG_TEST_USE_KEY(o);
    return o;
}

// Whether the transfer is quiesced, asked the way a host asks (sg_transfer_wait_quiesced, 0 ns).
inline bool quiesced(core::Context &c, core::Transfer &t) {
    try {
        t.wait_quiesced(0);
        return true;
    } catch (const Error &e) {
        if (e.status() != SG_ERR_TIMEOUT) throw;
        return false;
    }
}

struct FakePair {
    TestClock clock;
    fake::Fabric fabric;
    fake::Rng order;  // which context progresses when
    std::unique_ptr<core::Context> prefill, decode;
    std::shared_ptr<core::Session> at_prefill, at_decode;
    uint32_t prefill_ep = 0, decode_ep = 0;
    uint64_t rounds = 0;

    FakePair(uint64_t seed, const PairConfig &cfg = {}) : fabric(seed, cfg.knobs), order(seed ^ 0x6f72646572ull) {
        // Context ids are random, and the lower id speaks first on a session: the seed picks which
        // side that is, so one seed is one schedule.
        const bool prefill_speaks_first = order.below(2);
        wire::Hello hp, hd;
        for (;;) {
            prefill = std::make_unique<core::Context>(context_options(cfg));
            PairConfig decode_cfg = cfg;
            if (cfg.decode_lanes) decode_cfg.lanes = cfg.decode_lanes;
            decode = std::make_unique<core::Context>(context_options(decode_cfg));
            hp = core::parse_metadata(*decode, prefill->metadata());
            hd = core::parse_metadata(*prefill, decode->metadata());
            if ((hp.ctx_id < hd.ctx_id) == prefill_speaks_first) break;
        }
        prefill_ep = fake::Fabric::endpoint_id(hp.endpoints.at(0).address);
        decode_ep = fake::Fabric::endpoint_id(hd.endpoints.at(0).address);
        sg_session_options_t so{};
        so.struct_size = sizeof so;
        at_prefill = prefill->open_session(hd, so, false);  // from metadata: proven over the fabric
        at_decode = decode->open_session(hp, so, false);
        EXPECT_TRUE(run_until([&] { return ready(*prefill, *at_prefill) && ready(*decode, *at_decode); }))
            << "the sessions never authenticated";
    }

    ~FakePair() { fabric.on_poll(nullptr); }

    static bool ready(core::Context &c, core::Session &s) {
        try {
            return s.wait_ready(0) == SG_OK;
        } catch (const Error &e) {
            if (e.status() != SG_ERR_TIMEOUT) throw;
            return false;
        }
    }

    // One round: the clock moves a tick and the contexts progress in the seed's order (both, either
    // way round, or one of them).
    void step() {
        clock.advance(kTickNs);
        rounds++;
        switch (order.below(4)) {
            case 0: prefill->progress_once(); decode->progress_once(); break;
            case 1: decode->progress_once(); prefill->progress_once(); break;
            case 2: prefill->progress_once(); break;
            default: decode->progress_once(); break;
        }
    }

    template <class Done>
    bool run_until(Done done, uint64_t max_rounds = 100000) {
        for (uint64_t i = 0; i < max_rounds; ++i) {
            if (done()) return true;
            step();
        }
        return done();
    }

    // A core call that blocks until the peer answers (release of an unfinished transfer,
    // close_session): while it polls, the other context progresses and the clock ticks, on this
    // thread, so the schedule stays the seed's.
    void blocking(core::Context &caller, const std::function<void()> &call) {
        core::Context &other = &caller == prefill.get() ? *decode : *prefill;
        fabric.on_poll([&] {
            clock.advance(kTickNs);
            other.progress_once();
        });
        call();
        fabric.on_poll(nullptr);
    }

    // Closes both sessions as a host does after releasing its transfers: Bye, answered by the peer.
    void close() {
        if (at_prefill) blocking(*prefill, [&] { at_prefill->close(); });
        if (at_decode) blocking(*decode, [&] { at_decode->close(); });
        // The sessions go (removing their peers cancels what the fabric still holds for them),
        // then what they leave behind drains.
        at_prefill.reset();
        at_decode.reset();
        run_until([&] { return fabric.pending() == 0; }, 1000);
    }
};

// One request between the pair: pools exported, tables, and its two transfers once made.
struct Request {
    FakePair &p;
    HostPool src, dst;
    std::shared_ptr<core::KvPool> src_kv, dst_kv;
    std::vector<uint32_t> st, dt;
    uint64_t tokens;
    std::shared_ptr<core::Transfer> post, expect;

    Request(FakePair &pair, uint32_t layers, uint32_t blocks, uint64_t tokens_, uint32_t head_dim = 64)
        : p(pair), src(layers, blocks, head_dim), dst(layers, blocks, head_dim), tokens(tokens_) {
        src.fill(0x5eed);
        src_kv = std::make_shared<core::KvPool>(p.prefill.get(), src.layout);
        dst_kv = std::make_shared<core::KvPool>(p.decode.get(), dst.layout);
        p.at_prefill->export_kv(*src_kv);
        p.at_decode->export_kv(*dst_kv);
        const size_t n = (tokens + src.tpb - 1) / src.tpb;
        st = iota_table(n);
        dt.resize(n);
        for (size_t i = 0; i < n; ++i) dt[i] = uint32_t(n - 1 - i);  // reversed: no coalescing by accident
    }
    void do_expect(const sg_transfer_options_t &o = transfer_options()) {
        expect = p.decode->expect(p.at_decode, "req", dst_kv, dt, tokens, o);
    }
    void do_post(sg_transfer_options_t o = transfer_options(), const select::Profile *profile = nullptr) {
        o.flags |= SG_TRANSFER_ALL_LAYERS_WRITTEN;
        post = p.prefill->post(p.at_prefill, "req", src_kv, st, tokens, o, profile);
    }
    bool exact() const {
        for (uint32_t l = 0; l < src.layers; ++l)
            for (size_t i = 0; i < st.size(); ++i)
                if (!same_tokens(src, st, dst, dt, tokens, l, i)) return false;
        return true;
    }
    bool both_quiesced() {
        return (!post || quiesced(*p.prefill, *post)) && (!expect || quiesced(*p.decode, *expect));
    }
    bool run_to_quiesce() { return p.run_until([&] { return both_quiesced(); }); }
    // As a host ends: release both (quiesced: returns at once), close, and nothing may be left.
    void finish() {
        if (post) post->release();
        if (expect) expect->release();
        post.reset();
        expect.reset();
        p.close();
        EXPECT_EQ(p.prefill->stats().registrations, 0u);
        EXPECT_EQ(p.decode->stats().registrations, 0u);
        EXPECT_EQ(p.fabric.pending(), 0u);
    }
};

}  // namespace sg::testing
