// Profiles and selectors through the public C API: parse errors name the field, a Quest selector
// over a paged pool finds the block whose keys match the query. Also the argument checks of the
// transfer calls that refuse a request before anything moves (block tables, token counts, flags).
#include <smartgen/smartgen.h>

#include "../test_key.h"
#include "support/host_pool.hpp"

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

const char *kProfile = R"({"version": 1, "model": "test", "num_layers": 2, "num_kv_heads": 2, "block_tokens": 16,
  "defaults": {"policy": "quest", "budget": {"fraction": 0.0625}, "sinks": 16, "recent": 16}})";

TEST(SelectorApi, ParseErrorsNameTheField) {
    sg_profile_t p = nullptr;
    sg_error_info_t err;
    sg_error_info_init(&err);
    const std::string bad = R"({"version": 1, "model": "m", "num_layers": 2, "num_kv_heads": 2, "block_tokens": 16,
      "defaults": {"policy": "quest", "budget": {"fraction": 1.5}}})";
    EXPECT_EQ(sg_profile_parse(bad.data(), bad.size(), &p, &err), SG_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(err.message).find("defaults.budget.fraction"), std::string::npos) << err.message;
    ASSERT_EQ(sg_profile_parse(kProfile, std::strlen(kProfile), &p, &err), SG_OK) << err.message;
    size_t len = 0;
    EXPECT_EQ(sg_profile_to_json(p, nullptr, 0, &len), SG_OK);  // a size query
    std::string text(len + 1, '\0');
    ASSERT_EQ(sg_profile_to_json(p, text.data(), text.size(), &len), SG_OK);
    sg_profile_t again = nullptr;
    EXPECT_EQ(sg_profile_parse(text.c_str(), len, &again, nullptr), SG_OK);
    EXPECT_EQ(sg_profile_destroy(again), SG_OK);
    EXPECT_EQ(sg_profile_destroy(p), SG_OK);
    EXPECT_EQ(sg_profile_destroy(p), SG_ERR_INVALID_HANDLE);
}

// 64 blocks of random fp32 keys; block 40's keys point along the query. At budget 1/16 (4 blocks,
// sinks and recent included) Quest keeps the sink, the recent block and the needle, in 100 trials.
TEST(SelectorApi, QuestFindsTheNeedleBlockInAPagedPool) {
    sg_profile_t p = nullptr;
    ASSERT_EQ(sg_profile_parse(kProfile, std::strlen(kProfile), &p, nullptr), SG_OK);
    const uint32_t heads = 2, dim = 32, tpb = 16, blocks = 64;
    const uint64_t tokens = uint64_t(blocks) * tpb;
    std::vector<float> k(size_t(blocks) * tpb * heads * dim), v(k.size());
    void *kb[2] = {k.data(), k.data()}, *vb[2] = {v.data(), v.data()};
    sg_kv_layout_t lay;
    sg_kv_layout_init(&lay);
    lay.num_layers = 2;
    lay.num_kv_heads = heads;
    lay.head_dim = dim;
    lay.tokens_per_block = tpb;
    lay.num_blocks = blocks;
    lay.dtype = SG_DTYPE_FP32;
    lay.layer_k_base = kb;
    lay.layer_v_base = vb;
    lay.layer_base_count = 2;
    sg_selector_t sel = nullptr;
    ASSERT_EQ(sg_selector_create(p, &lay, tokens, &sel, nullptr), SG_OK) << sg_last_error_message();
    size_t floats = 0;
    ASSERT_EQ(sg_selector_digest_floats(sel, &floats), SG_OK);
    EXPECT_EQ(floats, size_t(blocks) * heads * 2 * dim);
    std::vector<float> digests(floats), query(size_t(4) * dim);  // 4 query heads, 2 per KV head
    std::vector<uint32_t> table(blocks), chosen(blocks);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    const uint32_t needle = 40;
    for (int trial = 0; trial < 100; ++trial) {
        for (auto &x : k) x = normal(rng);
        for (auto &x : query) x = normal(rng);
        for (uint32_t i = 0; i < blocks; ++i) table[i] = (i * 37 + uint32_t(trial)) % blocks;  // scattered
        for (uint32_t t = 0; t < tpb; ++t)
            for (uint32_t h = 0; h < heads; ++h)
                for (uint32_t i = 0; i < dim; ++i)
                    k[((size_t(table[needle]) * tpb + t) * heads + h) * dim + i] = 4.0f * query[(h * 2) * dim + i];
        ASSERT_EQ(sg_selector_digest(sel, &lay, 0, table.data(), blocks, digests.data(), digests.size()), SG_OK)
            << sg_last_error_message();
        sg_selector_input_t in;
        sg_selector_input_init(&in);
        in.queries = query.data();
        in.num_queries = 1;
        in.num_q_heads = 4;
        in.digests = digests.data();
        size_t n = 0;
        ASSERT_EQ(sg_selector_select(sel, 0, &in, chosen.data(), chosen.size(), &n), SG_OK) << sg_last_error_message();
        const std::vector<uint32_t> got(chosen.begin(), chosen.begin() + long(n));
        EXPECT_NE(std::find(got.begin(), got.end(), needle), got.end()) << "trial " << trial;
        EXPECT_NE(std::find(got.begin(), got.end(), 0u), got.end());
        EXPECT_NE(std::find(got.begin(), got.end(), blocks - 1), got.end());
        EXPECT_LE(n, 2u * 4u);  // at most the budget per head, over two heads
    }
    uint64_t budget = 0;
    ASSERT_EQ(sg_selector_budget_blocks(sel, 0, &budget), SG_OK);
    EXPECT_EQ(budget, 4u);
    sg_selector_input_t none;
    sg_selector_input_init(&none);
    size_t n = 0;
    EXPECT_EQ(sg_selector_select(sel, 0, &none, chosen.data(), chosen.size(), &n), SG_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(sg_selector_destroy(sel), SG_OK);
    EXPECT_EQ(sg_profile_destroy(p), SG_OK);
}

// Hostile profile text is bad input (SG_ERR_INVALID_ARGUMENT naming what), never an internal error,
// and never an unbounded read.
TEST(SelectorApi, HostileProfilesAreInvalidArguments) {
    sg_profile_t p = nullptr;
    sg_error_info_t err;
    const std::string overflow = R"({"version": 1, "model": "m", "num_layers": 2, "num_kv_heads": 2,
      "block_tokens": 16, "defaults": {"policy": "quest", "budget": {"tokens": 1e400}}})";
    sg_error_info_init(&err);
    EXPECT_EQ(sg_profile_parse(overflow.data(), overflow.size(), &p, &err), SG_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(err.message).find("defaults.budget.tokens"), std::string::npos) << err.message;
    // The whole of len counts: a NUL and garbage after the value are refused.
    const std::string padded = std::string(kProfile) + std::string("\0garbage", 8);
    EXPECT_EQ(sg_profile_parse(padded.data(), padded.size(), &p, nullptr), SG_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(sg_profile_parse(kProfile, std::strlen(kProfile) + 1, &p, nullptr), SG_ERR_INVALID_ARGUMENT);
    const std::string huge = R"({"version": 1, "model": "m", "num_layers": 1000000000, "num_kv_heads": 1000000000,
      "block_tokens": 16, "defaults": {"policy": "dense"}})";
    EXPECT_EQ(sg_profile_parse(huge.data(), huge.size(), &p, nullptr), SG_ERR_INVALID_ARGUMENT);
    sg_error_info_init(&err);
    EXPECT_EQ(sg_profile_load("/dev/zero", &p, &err), SG_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(err.message).find("regular file"), std::string::npos) << err.message;
    EXPECT_EQ(sg_profile_load("/nonexistent/profile.json", &p, nullptr), SG_ERR_NOT_FOUND);
    EXPECT_EQ(p, nullptr);
}

// A shape-only layout (no base pointers) for selectors.
sg_kv_layout_t selector_layout(uint32_t layers, uint32_t heads, uint32_t dim) {
    sg_kv_layout_t lay;
    sg_kv_layout_init(&lay);
    lay.num_layers = layers;
    lay.num_kv_heads = heads;
    lay.head_dim = dim;
    lay.tokens_per_block = 16;
    lay.dtype = SG_DTYPE_FP32;
    return lay;
}

// sg_selector_create took num_tokens = UINT64_MAX (its block count wrapped to 0). A selector's
// logical block indices are uint32_t and one layer's digests are counted in size_t: beyond either
// the size is refused with SG_ERR_OUT_OF_RANGE, and nothing is written to out.
TEST(SelectorApi, TokenCountsNoSelectorHoldsAreRefused) {
    sg_profile_t p = nullptr;
    ASSERT_EQ(sg_profile_parse(kProfile, std::strlen(kProfile), &p, nullptr), SG_OK);
    const sg_kv_layout_t lay = selector_layout(2, 2, 32);
    const uint64_t most = uint64_t(UINT32_MAX) * 16;  // 2^32 - 1 blocks of 16 tokens
    for (uint64_t n : {UINT64_MAX, UINT64_MAX - 1, UINT64_MAX - 15, most + 1, uint64_t(1) << 63}) {
        SCOPED_TRACE(n);
        sg_selector_t sel = nullptr;
        sg_error_info_t err;
        sg_error_info_init(&err);
        EXPECT_EQ(sg_selector_create(p, &lay, n, &sel, &err), SG_ERR_OUT_OF_RANGE) << err.message;
        EXPECT_NE(std::string(err.message).find("num_tokens"), std::string::npos) << err.message;
        EXPECT_EQ(sel, nullptr);
        sg_selector_destroy(sel);
    }
    sg_selector_t sel = nullptr;
    ASSERT_EQ(sg_selector_create(p, &lay, most, &sel, nullptr), SG_OK) << sg_last_error_message();
    size_t floats = 0;
    ASSERT_EQ(sg_selector_digest_floats(sel, &floats), SG_OK);
    EXPECT_EQ(floats, size_t(UINT32_MAX) * 2 * 2 * 32);
    EXPECT_EQ(sg_selector_destroy(sel), SG_OK);
    EXPECT_EQ(sg_profile_destroy(p), SG_OK);

    // The widest shape a layout allows: the digests of 2^32 - 1 blocks would not fit in size_t.
    const std::string wide = R"({"version": 1, "model": "m", "num_layers": 1, "num_kv_heads": 65536,
      "block_tokens": 16, "defaults": {"policy": "dense"}})";
    ASSERT_EQ(sg_profile_parse(wide.data(), wide.size(), &p, nullptr), SG_OK) << sg_last_error_message();
    const sg_kv_layout_t widest = selector_layout(1, 65536, 65536);
    sel = nullptr;
    EXPECT_EQ(sg_selector_create(p, &widest, most, &sel, nullptr), SG_ERR_OUT_OF_RANGE) << sg_last_error_message();
    EXPECT_EQ(sel, nullptr);
    sg_selector_destroy(sel);
    EXPECT_EQ(sg_profile_destroy(p), SG_OK);
}

// ---- caller buffers: one rule (the header's conventions) ----
// NULL with capacity 0 asks for the size (SG_OK, only the size written); NULL with a capacity is
// SG_ERR_INVALID_ARGUMENT; a buffer too small is SG_ERR_BUFFER_TOO_SMALL with the size written and
// the buffer untouched. Each calls `fill(buf, cap, &size)` for one function of the rule; `unit` is
// the element size in bytes and `extra` the elements the buffer needs beyond the size (the NUL).
template <class T, class F>
void follows_the_buffer_rule(const char *what, F &&fill, size_t extra = 0) {
    SCOPED_TRACE(what);
    size_t size = 12345;
    ASSERT_EQ(fill(static_cast<T *>(nullptr), 0, &size), SG_OK) << sg_last_error_message();
    ASSERT_NE(size, 12345u);
    ASSERT_GT(size, 0u);
    const size_t want = size;
    size_t other = 777;
    EXPECT_EQ(fill(static_cast<T *>(nullptr), 8, &other), SG_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(other, 777u) << "nothing is written when the call is refused";
    std::vector<T> buf(want + extra + 1);
    std::vector<T> before = buf;
    std::memset(static_cast<void *>(before.data()), 0x5a, before.size() * sizeof(T));
    buf = before;
    other = 0;
    EXPECT_EQ(fill(buf.data(), want + extra - 1, &other), SG_ERR_BUFFER_TOO_SMALL);
    EXPECT_EQ(other, want) << "the size is written with SG_ERR_BUFFER_TOO_SMALL";
    EXPECT_EQ(std::memcmp(buf.data(), before.data(), buf.size() * sizeof(T)), 0) << "the buffer is untouched";
    other = 0;
    EXPECT_EQ(fill(buf.data(), want + extra, &other), SG_OK) << sg_last_error_message();
    EXPECT_EQ(other, want);
}

TEST(SelectorApi, OutputBuffersFollowOneRule) {
    sg_profile_t p = nullptr;
    ASSERT_EQ(sg_profile_parse(kProfile, std::strlen(kProfile), &p, nullptr), SG_OK);
    follows_the_buffer_rule<char>(
        "sg_profile_to_json", [&](char *b, size_t c, size_t *n) { return sg_profile_to_json(p, b, c, n); }, 1);
    sg_kv_layout_t lay;
    sg_kv_layout_init(&lay);
    lay.num_layers = 2;
    lay.num_kv_heads = 2;
    lay.head_dim = 32;
    lay.tokens_per_block = 16;
    lay.dtype = SG_DTYPE_FP32;
    sg_selector_t sel = nullptr;
    ASSERT_EQ(sg_selector_create(p, &lay, 64 * 16, &sel, nullptr), SG_OK) << sg_last_error_message();
    std::vector<float> digests(64 * 2 * 2 * 32), query(4 * 32, 1.0f);
    sg_selector_input_t in;
    sg_selector_input_init(&in);
    in.queries = query.data();
    in.num_queries = 1;
    in.num_q_heads = 4;
    in.digests = digests.data();
    follows_the_buffer_rule<uint32_t>("sg_selector_select", [&](uint32_t *b, size_t c, size_t *n) {
        return sg_selector_select(sel, 0, &in, b, c, n);
    });
    EXPECT_EQ(sg_selector_destroy(sel), SG_OK);
    EXPECT_EQ(sg_profile_destroy(p), SG_OK);
}

// ---- out of memory ----

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SG_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define SG_TEST_SANITIZED 1
#endif
#endif

// Address space the process maps now (VmSize), in bytes; 0 when unknown.
uint64_t address_space_bytes() {
    std::FILE *f = std::fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (std::fgets(line, sizeof line, f))
        if (std::sscanf(line, "VmSize: %llu kB", &kb) == 1) break;
    std::fclose(f);
    return uint64_t(kb) * 1024;
}

// Runs in the death test's child: calls that allocate what their (well-formed) arguments ask for,
// under an address-space limit a little above what the process already maps. Each must answer
// SG_ERR_NO_MEMORY or refuse cleanly; a crash or abort fails the test. Exits 0 when all did.
[[noreturn]] void calls_under_address_space_limit() {
    int failed = 0;
    const auto expect = [&](const char *what, sg_status_t got, std::initializer_list<sg_status_t> ok) {
        if (std::find(ok.begin(), ok.end(), got) == ok.end()) {
            std::fprintf(stderr, "%s: %s (%s)\n", what, sg_status_str(got), sg_last_error_message());
            failed++;
        }
    };
    // Everything that does not depend on the limit is made first.
    sg_profile_t dense = nullptr, wide = nullptr;
    const std::string dense_json = R"({"version": 1, "model": "m", "num_layers": 1, "num_kv_heads": 1,
      "block_tokens": 16, "defaults": {"policy": "dense"}})";
    const std::string wide_json = R"({"version": 1, "model": "m", "num_layers": 4096, "num_kv_heads": 256,
      "block_tokens": 16, "defaults": {"policy": "quest", "budget": {"fraction": 0.5}}})";
    expect("parse dense", sg_profile_parse(dense_json.data(), dense_json.size(), &dense, nullptr), {SG_OK});
    std::string many_layers = R"({"version": 1, "model": "m", "num_layers": 4096, "num_kv_heads": 256,
      "block_tokens": 16, "defaults": {"policy": "dense"}, "layers": [)";
    for (int l = 0; l < 4096; ++l) {
        many_layers += (l ? ", " : "") + std::string(R"({"layer": )") + std::to_string(l) + R"(, "heads": [)";
        for (int h = 0; h < 256; ++h) many_layers += (h ? ", " : "") + std::string(R"({"head": )") + std::to_string(h) + "}";
        many_layers += "]}";
    }
    many_layers += "]}";  // about 15 MB of text, a few hundred MB as a DOM
    sg_kv_layout_t lay;
    sg_kv_layout_init(&lay);
    lay.num_layers = 1;
    lay.num_kv_heads = 1;
    lay.head_dim = 64;
    lay.tokens_per_block = 16;
    lay.dtype = SG_DTYPE_FP32;
    sg_selector_t big = nullptr;
    expect("create the largest selector", sg_selector_create(dense, &lay, uint64_t(UINT32_MAX) * 16, &big, nullptr),
           {SG_OK});

    rlimit lim{};
    lim.rlim_cur = lim.rlim_max = rlim_t(address_space_bytes() + (64ull << 20));
    if (setrlimit(RLIMIT_AS, &lim) != 0) {
        std::perror("setrlimit");
        _exit(3);
    }
    // A dense layer of 2^32 - 1 blocks selects every one: gigabytes.
    uint32_t one = 0;
    size_t count = 0;
    sg_selector_input_t in;
    sg_selector_input_init(&in);
    expect("select 2^32 - 1 blocks", sg_selector_select(big, 0, &in, &one, 1, &count), {SG_ERR_NO_MEMORY});
    expect("parse a 15 MB profile", sg_profile_parse(many_layers.data(), many_layers.size(), &wide, nullptr),
           {SG_ERR_NO_MEMORY});
    expect("parse 2^20 streams", sg_profile_parse(wide_json.data(), wide_json.size(), &wide, nullptr),
           {SG_OK, SG_ERR_NO_MEMORY});
    if (wide) {
        sg_kv_layout_t wl = lay;
        wl.num_layers = 4096;
        wl.num_kv_heads = 256;
        sg_selector_t ws = nullptr;
        expect("selector over 2^20 streams", sg_selector_create(wide, &wl, uint64_t(1) << 31, &ws, nullptr),
               {SG_OK, SG_ERR_NO_MEMORY});
        sg_selector_destroy(ws);
    }
    std::fflush(stderr);
    _exit(failed ? 1 : 0);
}

// Under `ulimit -v` the host must get SG_ERR_NO_MEMORY from a call that cannot allocate what it
// needs, not an abort.
TEST(SelectorApi, OutOfAddressSpaceIsNoMemory) {
#ifdef SG_TEST_SANITIZED
    GTEST_SKIP() << "sanitizers reserve terabytes of shadow address space: an RLIMIT_AS limit breaks them";
#else
    if (address_space_bytes() == 0) GTEST_SKIP() << "no /proc/self/status to size the limit from";
    GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child re-runs only this test: no inherited threads
    EXPECT_EXIT(calls_under_address_space_limit(), testing::ExitedWithCode(0), "");
#endif
}

// ---- transfer argument checks (two contexts in this process, joined by metadata) ----

// One layer, one KV head, head_dim 8, 4 tokens per block, `blocks` blocks (4 * blocks tokens),
// registered with the context.
struct Pool : sgtest::HostPool {
    sg_kv_handle_t kv = nullptr;
    Pool(sg_context_t ctx, uint64_t blocks) : HostPool({1, 1, 8, 4, blocks}) {
        EXPECT_EQ(sg_kv_register(ctx, &layout, &kv, nullptr), SG_OK) << sg_last_error_message();
    }
    ~Pool() { sg_kv_deregister(kv); }
};

sg_context_t make_context() {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = "tcp";
    SG_TEST_USE_KEY(o);
    sg_context_t ctx = nullptr;
    EXPECT_EQ(sg_context_create(&o, &ctx, nullptr), SG_OK) << sg_last_error_message();
    return ctx;
}

// A prefill and a decode context with a session each way and an 8-block pool exported on each.
struct Link {
    sg_context_t prefill = make_context(), decode = make_context();
    sg_session_t ps = nullptr, ds = nullptr;
    std::unique_ptr<Pool> src, dst;
    Link() {
        std::vector<uint8_t> mp(4096), md(4096);
        size_t lp = 0, ld = 0;
        EXPECT_EQ(sg_context_get_metadata(prefill, mp.data(), mp.size(), &lp), SG_OK);
        EXPECT_EQ(sg_context_get_metadata(decode, md.data(), md.size(), &ld), SG_OK);
        EXPECT_EQ(sg_session_from_metadata(prefill, md.data(), ld, nullptr, &ps, nullptr), SG_OK);
        EXPECT_EQ(sg_session_from_metadata(decode, mp.data(), lp, nullptr, &ds, nullptr), SG_OK);
        src = std::make_unique<Pool>(prefill, 8);
        dst = std::make_unique<Pool>(decode, 8);
        EXPECT_EQ(sg_session_export_kv(ps, src->kv), SG_OK) << sg_last_error_message();
        EXPECT_EQ(sg_session_export_kv(ds, dst->kv), SG_OK) << sg_last_error_message();
    }
    ~Link() {
        sg_session_destroy(ps);
        sg_session_destroy(ds);
        src.reset();
        dst.reset();
        EXPECT_EQ(sg_context_destroy(prefill), SG_OK);
        EXPECT_EQ(sg_context_destroy(decode), SG_OK);
    }
    // Expect and post of one request; each must answer `want`, write no handle when it fails, and
    // name `needle` in its message.
    void both(const char *rid, const uint32_t *table, size_t n, uint64_t tokens, const sg_transfer_options_t *o,
              sg_status_t want, const char *needle) {
        sg_transfer_t x = nullptr;
        sg_error_info_t err;
        sg_error_info_init(&err);
        EXPECT_EQ(sg_transfer_expect(ds, rid, dst->kv, table, n, tokens, o, &x, &err), want)
            << rid << ": expect: " << err.message;
        EXPECT_NE(std::string(err.message).find(needle), std::string::npos) << rid << ": expect: " << err.message;
        if (want != SG_OK) EXPECT_EQ(x, nullptr);
        sg_transfer_release(x);
        x = nullptr;
        sg_error_info_init(&err);
        EXPECT_EQ(sg_transfer_post(ps, rid, src->kv, table, n, tokens, o, &x, &err), want)
            << rid << ": post: " << err.message;
        EXPECT_NE(std::string(err.message).find(needle), std::string::npos) << rid << ": post: " << err.message;
        if (want != SG_OK) EXPECT_EQ(x, nullptr);
        sg_transfer_release(x);
    }
};

// num_tokens near 2^64 made the block count wrap to 0: expect and post answered SG_OK and the
// process died later reading past the table.
TEST(TransferApi, HugeTokenCountsAreRefused) {
    Link link;
    const uint32_t table[2] = {0, 1};
    for (uint64_t n : {UINT64_MAX, UINT64_MAX - 1, UINT64_MAX - 3, uint64_t(1) << 63, uint64_t(8) * 4 + 1}) {
        SCOPED_TRACE(n);
        link.both("huge", table, 2, n, nullptr, SG_ERR_OUT_OF_RANGE, "num_blocks");
    }
}

// A table longer than the request, or naming one block twice, is refused on both sides before
// anything moves; the exact table of the same request is taken.
TEST(TransferApi, TablesWithExtraOrRepeatedBlocksAreRefused) {
    Link link;
    const uint32_t extra[3] = {0, 1, 2};
    link.both("extra", extra, 3, 8, nullptr, SG_ERR_INVALID_ARGUMENT, "need 2");
    const uint32_t repeated[2] = {3, 3};
    link.both("repeated", repeated, 2, 8, nullptr, SG_ERR_INVALID_ARGUMENT, "block 3");
    link.both("exact", extra, 2, 8, nullptr, SG_OK, "");
}

// Flag bits this library does not know were ignored on expect (paths and flags) and post (flags):
// a caller relying on a newer bit got silently different behaviour.
TEST(TransferApi, UnknownFlagBitsAreRefused) {
    Link link;
    const uint32_t table[2] = {0, 1};
    sg_transfer_options_t o;
    for (uint32_t bit = 1; bit; bit <<= 1) {
        if (bit == SG_TRANSFER_ALL_LAYERS_WRITTEN) continue;
        SCOPED_TRACE(bit);
        sg_transfer_options_init(&o);
        o.flags = bit;
        link.both("flags", table, 2, 8, &o, SG_ERR_INVALID_ARGUMENT, "flags");
    }
    sg_transfer_options_init(&o);
    o.paths = SG_PATH_ON_DEMAND | 0x10u;
    link.both("paths", table, 2, 8, &o, SG_ERR_INVALID_ARGUMENT, "paths");
    sg_transfer_options_init(&o);
    o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
    link.both("known", table, 2, 8, &o, SG_OK, "");
}

// The transfer and session calls that fill a caller buffer, and the optional error-detail strings.
TEST(TransferApi, OutputBuffersFollowOneRule) {
    Link link;
    ASSERT_EQ(sg_session_wait_ready(link.ds, 10 * 1000000000ull), SG_OK) << sg_last_error_message();
    ASSERT_EQ(sg_session_wait_ready(link.ps, 10 * 1000000000ull), SG_OK) << sg_last_error_message();
    const uint32_t table[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    sg_transfer_t d = nullptr, x = nullptr;
    ASSERT_EQ(sg_transfer_expect(link.ds, "buffers", link.dst->kv, table, 8, 32, &o, &d, nullptr), SG_OK)
        << sg_last_error_message();
    o.paths = SG_PATH_PROACTIVE | SG_PATH_SPECULATIVE;
    o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
    ASSERT_EQ(sg_transfer_post(link.ps, "buffers", link.src->kv, table, 8, 32, &o, &x, nullptr), SG_OK)
        << sg_last_error_message();
    ASSERT_EQ(sg_transfer_wait_layer_state(d, 0, SG_LAYER_ESSENTIAL, 10 * 1000000000ull), SG_OK)
        << sg_last_error_message();
    follows_the_buffer_rule<float>("sg_transfer_digests", [&](float *b, size_t c, size_t *n) {
        return sg_transfer_digests(d, 0, b, c, n);
    });
    // The bitmap's size is in bits: 8 blocks need 1 byte. Checked by hand (the size is not bytes).
    size_t bits = 0;
    EXPECT_EQ(sg_transfer_residency(d, 0, nullptr, 0, &bits), SG_OK);
    EXPECT_EQ(bits, 8u);
    EXPECT_EQ(sg_transfer_residency(d, 0, nullptr, 1, &bits), SG_ERR_INVALID_ARGUMENT);
    uint8_t bitmap[1] = {0};
    bits = 0;
    EXPECT_EQ(sg_transfer_residency(d, 0, bitmap, 0, &bits), SG_ERR_BUFFER_TOO_SMALL);
    EXPECT_EQ(bits, 8u);
    EXPECT_EQ(sg_transfer_residency(d, 0, bitmap, 1, &bits), SG_OK);
    EXPECT_EQ(sg_transfer_wait(d, 10 * 1000000000ull), SG_OK) << sg_last_error_message();

    // A notification is only looked at by a size query, and taken by the call that fills.
    const char msg[] = "first-token:42";
    ASSERT_EQ(sg_session_notify(link.ps, msg, sizeof msg - 1), SG_OK);
    size_t len = 0;
    sg_status_t st;
    for (int i = 0; i < 500 && (st = sg_session_next_notification(link.ds, nullptr, 0, &len)) == SG_ERR_AGAIN; ++i)
        usleep(10000);
    ASSERT_EQ(st, SG_OK);
    follows_the_buffer_rule<char>("sg_session_next_notification", [&](char *b, size_t c, size_t *n) {
        return sg_session_next_notification(link.ds, b, c, n);
    });
    EXPECT_EQ(sg_session_next_notification(link.ds, nullptr, 0, &len), SG_ERR_AGAIN) << "taken once filled";

    // Error-detail strings are optional and cut to fit; a NULL buffer with a capacity is refused.
    sg_status_t health = SG_ERR_INTERNAL;
    char detail[8];
    EXPECT_EQ(sg_session_error(link.ds, &health, nullptr, 0), SG_OK);
    EXPECT_EQ(health, SG_OK);
    EXPECT_EQ(sg_session_error(link.ds, &health, nullptr, 8), SG_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(sg_session_error(link.ds, &health, detail, sizeof detail), SG_OK);
    EXPECT_EQ(sg_transfer_status(d, &health, nullptr, 0), SG_OK);
    EXPECT_EQ(sg_transfer_status(d, &health, nullptr, 8), SG_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(sg_transfer_status(d, &health, detail, sizeof detail), SG_OK);
    // Provider names have no size out-parameter: a buffer is required.
    char name[64];
    EXPECT_EQ(sg_session_provider(link.ds, nullptr, 0), SG_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(sg_session_provider(link.ds, name, 2), SG_ERR_BUFFER_TOO_SMALL);
    EXPECT_EQ(sg_session_provider(link.ds, name, sizeof name), SG_OK);
    EXPECT_EQ(sg_transfer_release(x), SG_OK);
    EXPECT_EQ(sg_transfer_release(d), SG_OK);
}

}  // namespace
