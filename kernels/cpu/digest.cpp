// Page digests and Quest scores (kernels.hpp).
#include "cpu/cpu.hpp"

namespace sg::kernels {

namespace {

using namespace cpu;

void min_max_into(const float *__restrict src, float *__restrict mn, float *__restrict mx, size_t n) {
    size_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
#pragma GCC unroll 16
        for (size_t j = 0; j < kLanes; ++j) {
            mn[i + j] = std::min(mn[i + j], src[i + j]);
            mx[i + j] = std::max(mx[i + j], src[i + j]);
        }
    for (; i < n; ++i) {
        mn[i] = std::min(mn[i], src[i]);
        mx[i] = std::max(mx[i], src[i]);
    }
}

// fp16 and bf16 are sign-magnitude: flipping the magnitude bits of negative values gives int16 keys
// that order like the values (the flip is its own inverse). So the min and max of a block are found
// on raw bits, 8 lanes to a 128-bit register and no conversion, and only the results are converted:
// twice the speed of converting every element (NaN keys give an unspecified digest either way).
inline int16_t order_key(uint16_t bits) {
    const int16_t s = int16_t(bits);
    return int16_t(s ^ ((s >> 15) & 0x7fff));
}

void key_min_max_into(const uint16_t *__restrict src, int16_t *__restrict lo, int16_t *__restrict hi, size_t n) {
    size_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
#pragma GCC unroll 16
        for (size_t j = 0; j < kLanes; ++j) {
            const int16_t k = order_key(src[i + j]);
            lo[i + j] = std::min(lo[i + j], k);
            hi[i + j] = std::max(hi[i + j], k);
        }
    for (; i < n; ++i) {
        const int16_t k = order_key(src[i]);
        lo[i] = std::min(lo[i], k);
        hi[i] = std::max(hi[i], k);
    }
}

template <DType D>
void page_digest_as(const View &keys, uint32_t tokens_per_block, float *out) {
    const size_t d = keys.dim;
    const uint64_t blocks = num_blocks(keys.tokens, tokens_per_block);
    alignas(64) int16_t lo[kMaxHeadDim], hi[kMaxHeadDim];
    for (uint64_t b = 0; b < blocks; ++b) {
        const uint64_t first = b * tokens_per_block;
        const uint64_t end = std::min<uint64_t>(keys.tokens, first + tokens_per_block);
        for (uint32_t h = 0; h < keys.heads; ++h) {
            float *mn = out + (b * keys.heads + h) * 2 * d;
            float *mx = mn + d;
            if constexpr (D == DType::fp32) {
                convert<D>(row<D>(keys, first, h), mn, d);
                std::copy(mn, mn + d, mx);
                for (uint64_t t = first + 1; t < end; ++t) min_max_into(row<D>(keys, t, h), mn, mx, d);
            } else {
                const uint16_t *r = row<D>(keys, first, h);
                for (size_t i = 0; i < d; ++i) lo[i] = hi[i] = order_key(r[i]);
                for (uint64_t t = first + 1; t < end; ++t) key_min_max_into(row<D>(keys, t, h), lo, hi, d);
                for (size_t i = 0; i < d; ++i) {
                    mn[i] = load<D>(uint16_t(order_key(uint16_t(lo[i]))));
                    mx[i] = load<D>(uint16_t(order_key(uint16_t(hi[i]))));
                }
            }
        }
    }
}

// max(q·lo, q·hi) per element picks the corner of the block's bounding box that maximises q·k.
float upper_bound(const float *__restrict q, const float *__restrict lo, const float *__restrict hi, size_t n) {
    float acc[kLanes] = {};
    size_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
#pragma GCC unroll 16
        for (size_t j = 0; j < kLanes; ++j) acc[j] += std::max(q[i + j] * lo[i + j], q[i + j] * hi[i + j]);
    float s = 0.f;
    for (; i < n; ++i) s += std::max(q[i] * lo[i], q[i] * hi[i]);
    return s + reduce(acc);
}

// Converted query rows kept on the stack: 32 KiB, at least 8 heads of the largest head_dim.
constexpr size_t kQueryFloats = 8192;

template <DType D>
void quest_scores_as(const float *digest, uint64_t blocks, uint32_t kv_heads, const View &query, Combine combine,
                     float *out) {
    const size_t d = query.dim;
    const uint32_t group = query.heads / kv_heads;
    const uint32_t per_pass = uint32_t(std::min<size_t>(group, kQueryFloats / d));
    alignas(64) float q[kQueryFloats];
    // All query heads of a KV head (or as many as fit) are scored against each block's digest while
    // it is in L1: the digest is read once per pass, not once per query head.
    for (uint32_t g = 0; g < kv_heads; ++g)
        for (uint32_t j0 = 0; j0 < group; j0 += per_pass) {
            const uint32_t count = std::min(per_pass, group - j0);
            for (uint32_t j = 0; j < count; ++j) convert<D>(row<D>(query, 0, g * group + j0 + j), q + j * d, d);
            for (uint64_t b = 0; b < blocks; ++b) {
                const float *lo = digest + (b * kv_heads + g) * 2 * d;
                float &o = out[b * kv_heads + g];
                float acc = o;
                for (uint32_t j = 0; j < count; ++j) {
                    const float s = upper_bound(q + j * d, lo, lo + d, d);
                    acc = j0 + j == 0 ? s : cpu::combine(combine, acc, s);
                }
                o = acc;
            }
        }
}

}  // namespace

void page_digest(const View &keys, uint32_t tokens_per_block, float *out) {
    assert(tokens_per_block >= 1 && keys.dim >= 1 && keys.dim <= kMaxHeadDim);
    dispatch(keys.dtype, [&](auto d) { page_digest_as<decltype(d)::value>(keys, tokens_per_block, out); });
}

void quest_scores(const float *digest, uint64_t blocks, uint32_t kv_heads, const View &query, Combine combine,
                  float *out) {
    assert(kv_heads >= 1 && query.heads >= kv_heads && query.heads % kv_heads == 0);
    assert(query.tokens >= 1 && query.dim >= 1 && query.dim <= kMaxHeadDim);
    dispatch(query.dtype,
             [&](auto d) { quest_scores_as<decltype(d)::value>(digest, blocks, kv_heads, query, combine, out); });
}

}  // namespace sg::kernels
