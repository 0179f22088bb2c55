// The CUDA kernels' per-element work (kernels/cuda/elements.hpp), run on the host over every element
// of the grid a kernel would launch, against the CPU twins: the packed staging layout against a
// plain memcpy of each block's planes, and the digest elements against kernels::page_digest, bit for
// bit. Runs everywhere (no GPU, no CUDA toolkit needed); the device runs the same functions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "cuda/elements.hpp"
#include "kernels.hpp"

namespace {

using sg::kernels::DType;
namespace elem = sg::kernels::cuda;

struct Regions {
    std::vector<uint8_t> k, v;
};

// The CPU twin of the staged path's pack: each listed block's K plane then its V plane, memcpy'd.
std::vector<uint8_t> pack_with_memcpy(const elem::PackGeometry &g, const Regions &r, const std::vector<uint32_t> &blocks) {
    std::vector<uint8_t> out;
    for (uint32_t b : blocks) {
        const uint8_t *k = r.k.data() + uint64_t(b) * g.block_stride;
        const uint8_t *v = g.fused ? k + g.plane_bytes : r.v.data() + uint64_t(b) * g.block_stride;
        out.insert(out.end(), k, k + g.plane_bytes);
        out.insert(out.end(), v, v + g.plane_bytes);
    }
    return out;
}

TEST(CudaElements, PackedSourceIsTheMemcpyPackOfEveryByte) {
    std::mt19937_64 rng(7);
    for (int round = 0; round < 40; ++round) {
        elem::PackGeometry g;
        g.fused = round % 2;
        g.plane_bytes = 16u * (1 + rng() % 64) + (round % 3 == 0 ? 2 : 0);  // some planes not a multiple of 16
        const uint64_t block_bytes = g.plane_bytes * (g.fused ? 2 : 1);
        g.block_stride = block_bytes + (rng() % 3) * 32;  // packed, or padded between blocks
        const uint32_t pool_blocks = 8 + uint32_t(rng() % 40);
        Regions r;
        r.k.resize(uint64_t(pool_blocks) * g.block_stride);
        if (!g.fused) r.v.resize(r.k.size());
        for (auto &b : r.k) b = uint8_t(rng());
        for (auto &b : r.v) b = uint8_t(rng());
        std::vector<uint32_t> blocks(1 + rng() % pool_blocks);
        for (auto &b : blocks) b = uint32_t(rng() % pool_blocks);  // scattered, repeats allowed for a gather

        const std::vector<uint8_t> want = pack_with_memcpy(g, r, blocks);
        std::vector<uint8_t> gathered(want.size());
        std::vector<uint8_t> k_back(r.k.size()), v_back(r.v.size());
        // What the gather and scatter kernels do, one unit per "thread", over the whole grid.
        const uint32_t unit = elem::pack_unit(g, 16);
        ASSERT_EQ(want.size() % unit, 0u);
        for (uint64_t at = 0; at < want.size(); at += unit) {
            const elem::PackSource s = elem::packed_source(g, blocks.data(), at);
            const uint8_t *region = s.plane == 0 || g.fused ? r.k.data() : r.v.data();
            std::memcpy(&gathered[at], region + s.region_offset, unit);
            uint8_t *back = s.plane == 0 || g.fused ? k_back.data() : v_back.data();
            std::memcpy(back + s.region_offset, &want[at], unit);
        }
        ASSERT_EQ(gathered, want) << "round " << round << ", plane " << g.plane_bytes << ", fused " << g.fused;
        // Scatter puts every packed byte back where it came from (the last of repeated blocks wins,
        // and holds the same bytes).
        for (uint32_t b : blocks) {
            const uint64_t at = uint64_t(b) * g.block_stride;
            ASSERT_EQ(0, std::memcmp(&k_back[at], &r.k[at], g.fused ? 2 * g.plane_bytes : g.plane_bytes));
            if (!g.fused) {
                ASSERT_EQ(0, std::memcmp(&v_back[at], &r.v[at], g.plane_bytes));
            }
        }
    }
}

TEST(CudaElements, PackUnitIsTheWidestAlignedDivisor) {
    EXPECT_EQ(elem::pack_unit({4096, 8192, 2, 0}, 256), 16u);
    EXPECT_EQ(elem::pack_unit({4104, 8208, 2, 0}, 256), 8u);
    EXPECT_EQ(elem::pack_unit({4096, 8192, 2, 0}, 4), 4u);
    EXPECT_EQ(elem::pack_unit({18, 36, 2, 0}, 256), 2u);
    EXPECT_EQ(elem::pack_unit({4095, 8190, 2, 0}, 256), 1u);
}

// Keys in every dtype and both block orders, a partial last block: each digest element equals
// page_digest's row element, bit for bit.
TEST(CudaElements, DigestElementsAreThePageDigest) {
    std::mt19937 rng(11);
    std::normal_distribution<float> key(0.0f, 3.0f);
    for (DType dtype : {DType::fp32, DType::fp16, DType::bf16}) {
        for (bool head_major : {false, true}) {
            const uint32_t heads = 3, dim = 40, tpb = 16;
            const uint64_t tokens = 16 * 5 + 7;  // five full blocks and a partial one
            const uint64_t blocks = sg::kernels::num_blocks(tokens, tpb);
            const size_t eb = sg::kernels::dtype_bytes(dtype);
            const uint64_t block_elems = uint64_t(tpb) * heads * dim;
            std::vector<uint8_t> pool(blocks * block_elems * eb);
            for (uint64_t i = 0; i < blocks * block_elems; ++i) {
                const float f = key(rng);
                if (dtype == DType::fp32) std::memcpy(&pool[i * 4], &f, 4);
                const uint16_t h = dtype == DType::fp16 ? sg::kernels::float_to_fp16(f) : sg::kernels::float_to_bf16(f);
                if (dtype != DType::fp32) std::memcpy(&pool[i * 2], &h, 2);
            }
            std::vector<float> want(sg::kernels::digest_floats(blocks, heads, dim));
            std::vector<float> got(want.size(), -1.0f);
            for (uint64_t b = 0; b < blocks; ++b) {
                const void *block = &pool[b * block_elems * eb];
                const uint64_t valid = std::min<uint64_t>(tpb, tokens - b * tpb);
                const sg::kernels::View v = head_major ? sg::kernels::head_major(block, dtype, tpb, heads, dim, tpb)
                                                       : sg::kernels::token_major(block, dtype, tpb, heads, dim);
                // The CPU twin, one block at a time as the runtime calls it.
                sg::kernels::page_digest(sg::kernels::slice(v, 0, valid), tpb, &want[b * heads * 2 * dim]);
                for (uint32_t h = 0; h < heads; ++h)
                    for (uint32_t d = 0; d < dim; ++d) {
                        float *row = &got[(b * heads + h) * 2 * dim];
                        elem::digest_element(v, valid, h, d, &row[d], &row[dim + d]);
                    }
            }
            for (size_t i = 0; i < want.size(); ++i)
                ASSERT_EQ(std::memcmp(&want[i], &got[i], 4), 0)
                    << "dtype " << int(dtype) << (head_major ? " head-major" : " token-major") << " float " << i
                    << ": " << want[i] << " vs " << got[i];
        }
    }
}

}  // namespace

namespace {

// The E4M3 value of every code, built from the format's definition with ldexp, independently of
// e4m3_to_float.
float e4m3_reference(uint8_t q) {
    const int exponent = (q >> 3) & 0xf, mantissa = q & 7;
    const float magnitude = exponent == 0 ? std::ldexp(float(mantissa), -9) : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
    return (q & 0x80) ? -magnitude : magnitude;
}

TEST(Quantization, E4m3DecodesEveryCodeAsTheFormatDefinesIt) {
    for (int q = 0; q < 256; ++q) {
        const float got = sg::kernels::e4m3_to_float(uint8_t(q));
        if ((q & 0x7f) == 0x7f) {
            EXPECT_TRUE(std::isnan(got)) << q;
            continue;
        }
        EXPECT_EQ(got, e4m3_reference(uint8_t(q))) << q;
        EXPECT_EQ(sg::kernels::float_to_e4m3(got), (q == 0x80 ? 0x80 : q)) << "round trip of code " << q;
    }
}

// float_to_e4m3 against a brute-force search for the nearest finite code (ties to the even code),
// finite values saturating at 448 and infinity going to NaN (E4M3FN has no infinity), over random
// floats across the whole range and every midpoint.
TEST(Quantization, E4m3EncodesToTheNearestCodeTiesToEven) {
    std::vector<std::pair<float, uint8_t>> codes;
    for (int q = 0; q < 0x7f; ++q) codes.push_back({e4m3_reference(uint8_t(q)), uint8_t(q)});
    auto nearest = [&](float f) {
        const float a = std::fabs(f);
        if (std::isinf(a)) return uint8_t(0x7f);
        if (a >= 448.0f) return uint8_t(0x7e);
        uint8_t best = 0;
        float best_err = INFINITY;
        for (auto [v, q] : codes) {
            const float err = std::fabs(v - a);
            if (err < best_err || (err == best_err && (q & 1) == 0)) best = q, best_err = err;
        }
        return best;
    };
    std::mt19937 rng(5);
    std::vector<float> values;
    for (size_t i = 0; i + 1 < codes.size(); ++i) values.push_back((codes[i].first + codes[i + 1].first) / 2);  // midpoints
    std::uniform_real_distribution<float> exponent(-12.0f, 10.0f);
    for (int i = 0; i < 20000; ++i) values.push_back(std::exp2(exponent(rng)));
    values.push_back(0.0f);
    values.push_back(500.0f);
    values.push_back(INFINITY);
    for (float f : values) {
        ASSERT_EQ(sg::kernels::float_to_e4m3(f), nearest(f)) << f;
        ASSERT_EQ(sg::kernels::float_to_e4m3(-f), uint8_t(0x80 | nearest(f))) << -f;
    }
    EXPECT_EQ(sg::kernels::float_to_e4m3(NAN) & 0x7f, 0x7f);
}

// The kernels' per-element quantization over every element of a block equals the CPU twin's codes
// and scales, bit for bit; dequantized values are within half a step of the originals.
TEST(Quantization, ElementsAreTheCpuTwinAndWithinHalfAStep) {
    std::mt19937 rng(9);
    std::normal_distribution<float> key(0.0f, 4.0f);
    for (auto code : {sg::kernels::QuantCode::int8, sg::kernels::QuantCode::fp8_e4m3}) {
        for (DType dtype : {DType::fp32, DType::fp16, DType::bf16}) {
            for (bool head_major : {false, true}) {
                const uint32_t heads = 4, dim = 64, tpb = 16;
                const uint64_t valid = 11;  // a partial block
                const size_t eb = sg::kernels::dtype_bytes(dtype);
                std::vector<uint8_t> plane(uint64_t(tpb) * heads * dim * eb);
                std::vector<float> original(uint64_t(tpb) * heads * dim);
                const auto view = head_major ? sg::kernels::head_major(plane.data(), dtype, valid, heads, dim, tpb)
                                             : sg::kernels::token_major(plane.data(), dtype, valid, heads, dim);
                for (uint64_t t = 0; t < tpb; ++t)
                    for (uint32_t h = 0; h < heads; ++h)
                        for (uint32_t d = 0; d < dim; ++d) {
                            const uint64_t i = t * view.token_stride + h * view.head_stride + d;
                            const float f = h == 3 ? 0.0f : key(rng) * (1.0f + float(h));  // head 3 all zero
                            if (dtype == DType::fp32) std::memcpy(&plane[i * 4], &f, 4);
                            const uint16_t b = dtype == DType::fp16 ? sg::kernels::float_to_fp16(f) : sg::kernels::float_to_bf16(f);
                            if (dtype != DType::fp32) std::memcpy(&plane[i * 2], &b, 2);
                        }
                std::vector<uint8_t> twin(original.size(), 0xAB), elements(original.size(), 0xAB);
                std::vector<float> scales(heads, -1.0f);
                sg::kernels::quantize_block(view, code, twin.data(), scales.data());
                for (uint32_t h = 0; h < heads; ++h) {
                    const float absmax = elem::head_absmax(view, valid, h);
                    ASSERT_EQ(sg::kernels::quant_scale(absmax, code), scales[h]) << "head " << h;
                    const float inv = sg::kernels::quant_inv_scale(scales[h]);
                    for (uint64_t t = 0; t < valid; ++t)
                        for (uint32_t d = 0; d < dim; ++d)
                            elements[t * view.token_stride + h * view.head_stride + d] =
                                elem::quantize_element(view, t, h, d, inv, code);
                }
                ASSERT_EQ(elements, twin) << "code " << int(code) << " dtype " << int(dtype) << " head-major " << head_major;
                EXPECT_EQ(scales[3], 0.0f) << "an all-zero head";

                // Back to fp32: each value within half a code step of what was quantized.
                std::vector<float> back(original.size(), 0.0f);
                const auto out = head_major ? sg::kernels::head_major(back.data(), DType::fp32, valid, heads, dim, tpb)
                                            : sg::kernels::token_major(back.data(), DType::fp32, valid, heads, dim);
                sg::kernels::dequantize_block(twin.data(), scales.data(), code, out);
                for (uint32_t h = 0; h < heads; ++h)
                    for (uint64_t t = 0; t < valid; ++t)
                        for (uint32_t d = 0; d < dim; ++d) {
                            const uint64_t i = t * view.token_stride + h * view.head_stride + d;
                            const float x = elem::key_element(view, t, h, d);
                            // int8: half a step of the scale; E4M3: 3 mantissa bits, so 1/16 of the value,
                            // or half the smallest subnormal step (2^-10 of the scale) near zero.
                            const float bound = code == sg::kernels::QuantCode::int8
                                                    ? scales[h] * 0.5f * 1.0001f
                                                    : std::fmax(std::fabs(x) / 16.0f, scales[h] * 0.0009765625f) * 1.0001f;
                            ASSERT_LE(std::fabs(back[i] - x), bound) << "code " << int(code) << " head " << h << " t " << t;
                        }
            }
        }
    }
}

}  // namespace

namespace {

// Quest scores per (block, KV head) from the per-element code against kernels::quest_scores: equal
// within float rounding of the sum (the twin sums in vector lanes), for both combines and dtypes of
// the query, with grouped query heads.
TEST(CudaElements, QuestScoreElementsAreTheCpuScores) {
    std::mt19937 rng(13);
    std::normal_distribution<float> value(0.0f, 1.5f);
    const uint32_t kv_heads = 4, q_heads = 16, dim = 128;
    const uint64_t blocks = 37;
    std::vector<float> digest(sg::kernels::digest_floats(blocks, kv_heads, dim));
    for (uint64_t b = 0; b < blocks * kv_heads; ++b)
        for (uint32_t d = 0; d < dim; ++d) {
            const float x = value(rng), y = value(rng);
            digest[b * 2 * dim + d] = std::fmin(x, y);
            digest[b * 2 * dim + dim + d] = std::fmax(x, y);
        }
    for (DType dtype : {DType::fp32, DType::fp16, DType::bf16}) {
        std::vector<uint8_t> query(uint64_t(q_heads) * dim * sg::kernels::dtype_bytes(dtype));
        for (uint32_t i = 0; i < q_heads * dim; ++i) {
            const float f = value(rng);
            if (dtype == DType::fp32) std::memcpy(&query[i * 4], &f, 4);
            const uint16_t h = dtype == DType::fp16 ? sg::kernels::float_to_fp16(f) : sg::kernels::float_to_bf16(f);
            if (dtype != DType::fp32) std::memcpy(&query[i * 2], &h, 2);
        }
        const auto q = sg::kernels::token_major(query.data(), dtype, 1, q_heads, dim);
        for (auto combine : {sg::kernels::Combine::max, sg::kernels::Combine::sum}) {
            std::vector<float> want(blocks * kv_heads);
            sg::kernels::quest_scores(digest.data(), blocks, kv_heads, q, combine, want.data());
            for (uint64_t b = 0; b < blocks; ++b)
                for (uint32_t g = 0; g < kv_heads; ++g) {
                    const float got = elem::quest_score_element(digest.data(), kv_heads, q, combine, b, g);
                    // Σ of dim terms of magnitude up to ~|q||digest|: float rounding of a differently
                    // ordered sum stays well inside 1e-4 of the sum of magnitudes (4 query heads for sum).
                    float magnitude = 0.0f;
                    for (uint32_t j = 0; j < q_heads / kv_heads; ++j)
                        for (uint32_t d = 0; d < dim; ++d)
                            magnitude += std::fabs(elem::key_element(q, 0, g * (q_heads / kv_heads) + j, d)) *
                                         std::fmax(std::fabs(digest[(b * kv_heads + g) * 2 * dim + d]),
                                                   std::fabs(digest[(b * kv_heads + g) * 2 * dim + dim + d]));
                    ASSERT_NEAR(got, want[b * kv_heads + g], 1e-4f * magnitude) << "block " << b << " head " << g;
                }
        }
    }
}

// Top-k on the device sorts ranks (elements.hpp) descending; that order must be the CPU twin's for
// every kind of score: ties, signed zeros, infinities, NaN.
TEST(CudaElements, TopkRankOrderIsTheCpuTopK) {
    std::mt19937 rng(3);
    const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1.0f, -1.0f};
    for (int trial = 0; trial < 200; ++trial) {
        const size_t n = 1 + rng() % 300;
        std::vector<float> scores(n);
        for (auto &s : scores)
            s = rng() % 4 == 0 ? specials[rng() % std::size(specials)] : float(int(rng() % 21) - 10) / 4.0f;
        const size_t k = 1 + rng() % n;
        const std::vector<uint32_t> cpu = sg::kernels::top_k(scores, k);
        std::vector<uint64_t> ranks(n);
        for (uint32_t i = 0; i < n; ++i) ranks[i] = elem::topk_rank(scores[i], i);
        std::sort(ranks.begin(), ranks.end(), std::greater<>());
        for (size_t j = 0; j < k; ++j)
            ASSERT_EQ(elem::topk_index(ranks[j]), cpu[j]) << "trial " << trial << ", rank " << j << " of " << k;
    }
}

}  // namespace
