// Window attention (SnapKV), block pooling, and heavy-hitter block sums (kernels.hpp).
#include "cpu/cpu.hpp"

#include <cmath>

namespace sg::kernels {

namespace {

using namespace cpu;

// Keys are converted to fp32 a tile at a time; 64 rows of up to 1024 floats stay in L2 while every
// query of the window is dotted against them.
constexpr uint64_t kTile = 64;

float max_of(const float *__restrict a, size_t n) {
    float acc[kLanes];
#pragma GCC unroll 16
    for (size_t j = 0; j < kLanes; ++j) acc[j] = a[0];
    size_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
#pragma GCC unroll 16
        for (size_t j = 0; j < kLanes; ++j) acc[j] = std::max(acc[j], a[i + j]);
    float m = a[0];
    for (; i < n; ++i) m = std::max(m, a[i]);
#pragma GCC unroll 16
    for (size_t j = 0; j < kLanes; ++j) m = std::max(m, acc[j]);
    return m;
}

void axpy(float a, const float *__restrict x, float *__restrict y, size_t n) {
    size_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
#pragma GCC unroll 16
        for (size_t j = 0; j < kLanes; ++j) y[i + j] += a * x[i + j];
    for (; i < n; ++i) y[i] += a * x[i];
}

struct WindowScratch {
    float *logits;    // [W][tokens]
    float *head_sum;  // [tokens]
    float *queries;   // [W][dim], scaled by 1/sqrt(dim)
    float *tile;      // [kTile][dim]
};

WindowScratch carve(const View &keys, const View &queries, float *base) {
    WindowScratch s;
    s.logits = base;
    s.head_sum = s.logits + queries.tokens * keys.tokens;
    s.queries = s.head_sum + keys.tokens;
    s.tile = s.queries + queries.tokens * keys.dim;
    return s;
}

template <DType D>
void convert_rows(const View &v, uint64_t first, uint64_t count, uint32_t head, float *out) {
    for (uint64_t t = 0; t < count; ++t) convert<D>(row<D>(v, first + t, head), out + t * v.dim, v.dim);
}

template <DType D>
void logits_for_head(const View &keys, uint32_t kv_head, uint64_t window, uint64_t first_query_pos,
                     const WindowScratch &s) {
    const uint64_t n = keys.tokens;
    const size_t d = keys.dim;
    const uint64_t seen = std::min<uint64_t>(n, first_query_pos + window);  // keys no query can see are skipped
    for (uint64_t t0 = 0; t0 < seen; t0 += kTile) {
        const uint64_t count = std::min<uint64_t>(kTile, seen - t0);
        convert_rows<D>(keys, t0, count, kv_head, s.tile);
        for (uint64_t w = 0; w < window; ++w) {
            const uint64_t visible = std::min<uint64_t>(n, first_query_pos + w + 1);
            if (t0 >= visible) continue;
            const uint64_t end = std::min<uint64_t>(count, visible - t0);
            const float *q = s.queries + w * d;
            float *l = s.logits + w * n + t0;
            for (uint64_t t = 0; t < end; ++t) l[t] = dot(q, s.tile + t * d, d);
        }
    }
}

template <DType D>
void window_attention_as(const View &keys, const View &queries, uint64_t first_query_pos, Combine combine,
                         const WindowScratch &s, float *out) {
    const uint64_t n = keys.tokens, window = queries.tokens;
    const size_t d = keys.dim;
    const uint32_t group = queries.heads / keys.heads;
    const float scale = 1.0f / std::sqrt(float(d));
    for (uint32_t h = 0; h < queries.heads; ++h) {
        const uint32_t g = h / group;
        // Queries may be in another dtype than keys: convert them here, once, rather than per key.
        dispatch(queries.dtype, [&](auto qd) { convert_rows<decltype(qd)::value>(queries, 0, window, h, s.queries); });
        for (uint64_t i = 0; i < window * d; ++i) s.queries[i] *= scale;
        logits_for_head<D>(keys, g, window, first_query_pos, s);
        std::fill(s.head_sum, s.head_sum + n, 0.f);
        for (uint64_t w = 0; w < window; ++w) {
            const uint64_t visible = std::min<uint64_t>(n, first_query_pos + w + 1);
            float *l = s.logits + w * n;
            const float m = max_of(l, visible);
            for (uint64_t t = 0; t < visible; ++t) l[t] = std::exp(l[t] - m);
            axpy(1.0f / sum(l, visible), l, s.head_sum, visible);
        }
        combine_into(combine, h % group == 0, s.head_sum, out + g * n, n);
    }
}

// Max over tokens [t - r, t + r] clipped to [0, n).
float pooled_at(const float *x, uint64_t n, uint64_t t, uint64_t r) {
    const uint64_t lo = t >= r ? t - r : 0, hi = std::min(n - 1, t + r);
    float m = x[lo];
    for (uint64_t u = lo + 1; u <= hi; ++u) m = std::max(m, x[u]);
    return m;
}

// Σ over t in [first, end) of pooled_at(t): tokens whose whole neighbourhood is inside [0, n) go in
// chunks (no clipping to test), the rest one by one.
float pooled_sum(const float *x, uint64_t n, uint64_t first, uint64_t end, uint64_t r) {
    float s = 0.f;
    uint64_t t = first;
    for (; t < end && t < r; ++t) s += pooled_at(x, n, t, r);
    const uint64_t inner_end = n > r ? std::min(end, n - r) : t;
    float acc[kLanes] = {};
    for (; t + kLanes <= inner_end; t += kLanes) {
        float v[kLanes];
        const float *base = x + t - r;
#pragma GCC unroll 16
        for (size_t j = 0; j < kLanes; ++j) v[j] = base[j];
        for (uint64_t o = 1; o <= 2 * r; ++o)
#pragma GCC unroll 16
            for (size_t j = 0; j < kLanes; ++j) v[j] = std::max(v[j], base[o + j]);
#pragma GCC unroll 16
        for (size_t j = 0; j < kLanes; ++j) acc[j] += v[j];
    }
    for (; t < end; ++t) s += pooled_at(x, n, t, r);
#pragma GCC unroll 16
    for (size_t j = 0; j < kLanes; ++j) s += acc[j];
    return s;
}

template <bool Max>
float group_block_sum(const float *acc, uint32_t group, uint64_t head_stride, uint64_t first, uint64_t end) {
    float lanes[kLanes] = {};
    float s = 0.f;
    uint64_t t = first;
    for (; t + kLanes <= end; t += kLanes) {
        float v[kLanes];
#pragma GCC unroll 16
        for (size_t j = 0; j < kLanes; ++j) v[j] = acc[t + j];
        for (uint32_t k = 1; k < group; ++k) {
            const float *y = acc + k * head_stride + t;
#pragma GCC unroll 16
            for (size_t j = 0; j < kLanes; ++j) v[j] = Max ? std::max(v[j], y[j]) : v[j] + y[j];
        }
#pragma GCC unroll 16
        for (size_t j = 0; j < kLanes; ++j) lanes[j] += v[j];
    }
    for (; t < end; ++t) {
        float v = acc[t];
        for (uint32_t k = 1; k < group; ++k)
            v = Max ? std::max(v, acc[k * head_stride + t]) : v + acc[k * head_stride + t];
        s += v;
    }
#pragma GCC unroll 16
    for (size_t j = 0; j < kLanes; ++j) s += lanes[j];
    return s;
}

}  // namespace

size_t window_scratch_floats(const View &keys, const View &queries) {
    return size_t(queries.tokens * keys.tokens + keys.tokens + queries.tokens * keys.dim + kTile * keys.dim);
}

void window_attention(const View &keys, const View &queries, uint64_t first_query_pos, Combine combine,
                      std::span<float> scratch, float *out) {
    assert(keys.heads >= 1 && queries.heads >= keys.heads && queries.heads % keys.heads == 0);
    assert(queries.dim == keys.dim && keys.dim >= 1 && keys.dim <= kMaxHeadDim);
    assert(scratch.size() >= window_scratch_floats(keys, queries));
    if (keys.tokens == 0) return;
    if (queries.tokens == 0) {
        std::fill(out, out + uint64_t(keys.heads) * keys.tokens, 0.f);
        return;
    }
    const WindowScratch s = carve(keys, queries, scratch.data());
    dispatch(keys.dtype,
             [&](auto d) { window_attention_as<decltype(d)::value>(keys, queries, first_query_pos, combine, s, out); });
}

void block_scores(const float *token_scores, uint32_t heads, uint64_t tokens, uint32_t tokens_per_block, uint32_t pool,
                  float *out) {
    assert(tokens_per_block >= 1 && pool >= 1 && pool % 2 == 1);
    const uint64_t blocks = num_blocks(tokens, tokens_per_block);
    const uint64_t r = pool / 2;
    for (uint32_t h = 0; h < heads; ++h) {
        const float *x = token_scores + h * tokens;
        for (uint64_t b = 0; b < blocks; ++b) {
            const uint64_t first = b * tokens_per_block;
            const uint64_t end = std::min<uint64_t>(tokens, first + tokens_per_block);
            out[b * heads + h] = r == 0 ? sum(x + first, end - first) : pooled_sum(x, tokens, first, end, r);
        }
    }
}

size_t snapkv_scratch_floats(const View &keys, const View &queries) {
    return window_scratch_floats(keys, queries) + size_t(keys.heads) * keys.tokens;
}

void snapkv_scores(const View &keys, const View &queries, uint64_t first_query_pos, Combine combine,
                   uint32_t tokens_per_block, uint32_t pool, std::span<float> scratch, float *out) {
    assert(scratch.size() >= snapkv_scratch_floats(keys, queries));
    float *token_scores = scratch.data();
    const size_t per_token = size_t(keys.heads) * keys.tokens;
    window_attention(keys, queries, first_query_pos, combine, scratch.subspan(per_token), token_scores);
    block_scores(token_scores, keys.heads, keys.tokens, tokens_per_block, pool, out);
}

void h2o_scores(const float *acc, uint32_t heads, uint64_t tokens, uint64_t head_stride, uint32_t kv_heads,
                Combine combine, uint32_t tokens_per_block, float *out) {
    assert(kv_heads >= 1 && heads >= kv_heads && heads % kv_heads == 0 && head_stride >= tokens);
    assert(tokens_per_block >= 1);
    const uint32_t group = heads / kv_heads;
    const uint64_t blocks = num_blocks(tokens, tokens_per_block);
    for (uint32_t g = 0; g < kv_heads; ++g) {
        const float *base = acc + uint64_t(g) * group * head_stride;
        for (uint64_t b = 0; b < blocks; ++b) {
            const uint64_t first = b * tokens_per_block;
            const uint64_t end = std::min<uint64_t>(tokens, first + tokens_per_block);
            out[b * kv_heads + g] = combine == Combine::max
                                        ? group_block_sum<true>(base, group, head_stride, first, end)
                                        : group_block_sum<false>(base, group, head_stride, first, end);
        }
    }
}

}  // namespace sg::kernels
