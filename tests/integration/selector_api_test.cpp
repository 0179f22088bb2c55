// Profiles and selectors through the public C API: parse errors name the field, a Quest selector
// over a paged pool finds the block whose keys match the query.
#include <smartgen/smartgen.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
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
    EXPECT_EQ(sg_profile_to_json(p, nullptr, 0, &len), SG_ERR_BUFFER_TOO_SMALL);
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

}  // namespace
