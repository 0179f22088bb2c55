// Page digests and Quest scores (kernels.hpp).
//
// Each kernel has a portable path and, on x86-64, an AVX2 one (F16C for fp16 digests, FMA-free so
// both compute the same products) chosen at run time by a CPU check, since the library is built for
// the baseline ISA. The AVX2 digest is bit-identical to the portable one (both are min and max on raw
// bits, then exact conversions); the AVX2 Quest sums in another order, within the tests' tolerance.
#include "cpu/cpu.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SG_KERNELS_X86 1
#endif

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

#ifdef SG_KERNELS_X86

// Whether this CPU runs the AVX2 paths; asked once (the answer cannot change).
bool have_avx2() {
    static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    return yes;
}

#define SG_AVX2 __attribute__((target("avx2,f16c"), always_inline)) inline
// Lambdas do not inherit their function's target: one that calls SG_AVX2 helpers must say it too.
#define SG_AVX2_LAMBDA __attribute__((target("avx2,f16c"), always_inline))

// order_key on 16 lanes.
SG_AVX2 __m256i order_keys(__m256i x) {
    return _mm256_xor_si256(x, _mm256_and_si256(_mm256_srai_epi16(x, 15), _mm256_set1_epi16(0x7fff)));
}

template <DType D>
SG_AVX2 __m256i load_keys(const uint16_t *p) {
    return order_keys(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
}

// 16 order keys back to their values, as floats.
template <DType D>
SG_AVX2 void store_keys(__m256i k, float *out) {
    const __m256i bits = order_keys(k);
    const __m128i a = _mm256_castsi256_si128(bits), b = _mm256_extracti128_si256(bits, 1);
    if constexpr (D == DType::fp16) {
        _mm256_storeu_ps(out, _mm256_cvtph_ps(a));
        _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(b));
    } else {
        _mm256_storeu_ps(out, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)));
        _mm256_storeu_ps(out + 8, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
    }
}

// Columns [c, c + 16 N) of one (block, head): the running min and max stay in 2N registers while the
// block's rows stream past, and are converted and stored once.
template <DType D, int N>
SG_AVX2 void digest_columns(const View &keys, uint64_t first, uint64_t end, uint32_t h, size_t c, float *mn,
                            float *mx) {
    __m256i lo[N], hi[N];
    const uint16_t *r = row<D>(keys, first, h) + c;
#pragma GCC unroll 8
    for (int k = 0; k < N; ++k) lo[k] = hi[k] = load_keys<D>(r + 16 * k);
    for (uint64_t t = first + 1; t < end; ++t) {
        r = row<D>(keys, t, h) + c;
#pragma GCC unroll 8
        for (int k = 0; k < N; ++k) {
            const __m256i x = load_keys<D>(r + 16 * k);
            lo[k] = _mm256_min_epi16(lo[k], x);
            hi[k] = _mm256_max_epi16(hi[k], x);
        }
    }
#pragma GCC unroll 8
    for (int k = 0; k < N; ++k) {
        store_keys<D>(lo[k], mn + c + 16 * k);
        store_keys<D>(hi[k], mx + c + 16 * k);
    }
}

// How far ahead of their reads the streaming digest and Quest prefetch (both read long sequential
// streams): one thread's demand loads and the hardware prefetchers alone left the digest at half of
// memcpy's bandwidth and Quest at a third of it.
constexpr size_t kPrefetchBytes = 16384;

// Elements of one token (all heads) that the row-streaming digest keeps in L1.
constexpr size_t kStreamElems = 8192;

// Packed token-major keys: each token's heads are one contiguous row, read front to back, with the
// running min and max of the block in L1. Reading a head's slice of every token in turn (the column
// walk below) jumps by a whole token row between loads, which the hardware prefetchers follow less
// well: this is ~1.3x faster on long sequences.
template <DType D>
__attribute__((target("avx2,f16c"))) void digest_block_rows(const View &keys, uint64_t first, uint64_t end,
                                                            float *out) {
    const size_t d = keys.dim, w = size_t(keys.heads) * d;
    alignas(32) int16_t lo[kStreamElems], hi[kStreamElems];
    const uint16_t *r = row<D>(keys, first, 0);
    for (size_t i = 0; i < w; i += 16) {
        const __m256i x = load_keys<D>(r + i);
        _mm256_store_si256(reinterpret_cast<__m256i *>(lo + i), x);
        _mm256_store_si256(reinterpret_cast<__m256i *>(hi + i), x);
    }
    for (uint64_t t = first + 1; t < end; ++t) {
        r = row<D>(keys, t, 0);
        for (size_t i = 0; i < w; i += 16) {
            if (i % 32 == 0) _mm_prefetch(reinterpret_cast<const char *>(r + i) + kPrefetchBytes, _MM_HINT_T0);
            const __m256i x = load_keys<D>(r + i);
            __m256i *l = reinterpret_cast<__m256i *>(lo + i), *h = reinterpret_cast<__m256i *>(hi + i);
            _mm256_store_si256(l, _mm256_min_epi16(_mm256_load_si256(l), x));
            _mm256_store_si256(h, _mm256_max_epi16(_mm256_load_si256(h), x));
        }
    }
    for (uint32_t h = 0; h < keys.heads; ++h) {
        float *mn = out + size_t(h) * 2 * d, *mx = mn + d;
        for (size_t i = 0; i < d; i += 16) {
            store_keys<D>(_mm256_load_si256(reinterpret_cast<const __m256i *>(lo + h * d + i)), mn + i);
            store_keys<D>(_mm256_load_si256(reinterpret_cast<const __m256i *>(hi + h * d + i)), mx + i);
        }
    }
}

// fp16/bf16 keys with dim a multiple of 16.
template <DType D>
__attribute__((target("avx2,f16c"))) void page_digest_avx2(const View &keys, uint32_t tokens_per_block, float *out) {
    const size_t d = keys.dim;
    const uint64_t blocks = num_blocks(keys.tokens, tokens_per_block);
    const bool rows = keys.head_stride == d && keys.token_stride == keys.heads * d && keys.heads * d <= kStreamElems;
    for (uint64_t b = 0; b < blocks; ++b) {
        const uint64_t first = b * tokens_per_block;
        const uint64_t end = std::min<uint64_t>(keys.tokens, first + tokens_per_block);
        if (rows) {
            digest_block_rows<D>(keys, first, end, out + b * keys.heads * 2 * d);
            continue;
        }
        for (uint32_t h = 0; h < keys.heads; ++h) {
            float *mn = out + (b * keys.heads + h) * 2 * d;
            float *mx = mn + d;
            size_t c = 0;
            for (; c + 64 <= d; c += 64) digest_columns<D, 4>(keys, first, end, h, c, mn, mx);
            for (; c < d; c += 16) digest_columns<D, 1>(keys, first, end, h, c, mn, mx);
        }
    }
}

SG_AVX2 float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

// upper_bound for J query heads (rows d apart) against one block's digest, dim a multiple of 8: each
// digest vector is loaded once for the J heads.
template <int J>
SG_AVX2 void upper_bounds(const float *q, size_t d, const float *lo, const float *hi, float *s) {
    __m256 acc[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) acc[j] = _mm256_setzero_ps();
    for (size_t i = 0; i < d; i += 8) {
        if (i % 16 == 0) {
            _mm_prefetch(reinterpret_cast<const char *>(lo + i) + kPrefetchBytes, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char *>(hi + i) + kPrefetchBytes, _MM_HINT_T0);
        }
        const __m256 l = _mm256_loadu_ps(lo + i), h = _mm256_loadu_ps(hi + i);
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j) {
            const __m256 qv = _mm256_loadu_ps(q + j * d + i);
            acc[j] = _mm256_add_ps(acc[j], _mm256_max_ps(_mm256_mul_ps(qv, l), _mm256_mul_ps(qv, h)));
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) s[j] = hsum(acc[j]);
}

template <DType D>
__attribute__((target("avx2,f16c"))) void quest_scores_avx2(const float *digest, uint64_t blocks, uint32_t kv_heads,
                                                            const View &query, Combine combine, float *out) {
    const size_t d = query.dim;
    const uint32_t group = query.heads / kv_heads;
    const uint32_t per_pass = uint32_t(std::min<size_t>(group, kQueryFloats / d));
    alignas(64) float q[kQueryFloats];
    // Query heads j0 .. j0 + count of KV head g (rows at q, d apart) against block b.
    auto score = [&](const float *q, uint32_t j0, uint32_t count, uint32_t g, uint64_t b) SG_AVX2_LAMBDA {
        const float *lo = digest + (b * kv_heads + g) * 2 * d;
        float &o = out[b * kv_heads + g];
        float acc = o;
        for (uint32_t j = 0; j < count; j += 4) {
            float s[4];
            const uint32_t n = std::min(4u, count - j);
            switch (n) {
                case 4:
                    upper_bounds<4>(q + j * d, d, lo, lo + d, s);
                    break;
                case 3:
                    upper_bounds<3>(q + j * d, d, lo, lo + d, s);
                    break;
                case 2:
                    upper_bounds<2>(q + j * d, d, lo, lo + d, s);
                    break;
                default:
                    upper_bounds<1>(q + j * d, d, lo, lo + d, s);
                    break;
            }
            for (uint32_t k = 0; k < n; ++k) acc = j0 + j + k == 0 ? s[k] : cpu::combine(combine, acc, s[k]);
        }
        o = acc;
    };
    if (size_t(query.heads) * d <= kQueryFloats) {
        // Every query head converted up front, so the digest is read once, front to back.
        for (uint32_t h = 0; h < query.heads; ++h) convert<D>(row<D>(query, 0, h), q + h * d, d);
        for (uint64_t b = 0; b < blocks; ++b)
            for (uint32_t g = 0; g < kv_heads; ++g) score(q + size_t(g) * group * d, 0, group, g, b);
        return;
    }
    for (uint32_t g = 0; g < kv_heads; ++g)
        for (uint32_t j0 = 0; j0 < group; j0 += per_pass) {
            const uint32_t count = std::min(per_pass, group - j0);
            for (uint32_t j = 0; j < count; ++j) convert<D>(row<D>(query, 0, g * group + j0 + j), q + j * d, d);
            for (uint64_t b = 0; b < blocks; ++b) score(q, j0, count, g, b);
        }
}

#undef SG_AVX2
#undef SG_AVX2_LAMBDA

#endif  // SG_KERNELS_X86

}  // namespace

void page_digest(const View &keys, uint32_t tokens_per_block, float *out) {
    assert(tokens_per_block >= 1 && keys.dim >= 1 && keys.dim <= kMaxHeadDim);
#ifdef SG_KERNELS_X86
    if (keys.dtype != DType::fp32 && keys.dim % 16 == 0 && have_avx2()) {
        if (keys.dtype == DType::fp16)
            page_digest_avx2<DType::fp16>(keys, tokens_per_block, out);
        else
            page_digest_avx2<DType::bf16>(keys, tokens_per_block, out);
        return;
    }
#endif
    dispatch(keys.dtype, [&](auto d) { page_digest_as<decltype(d)::value>(keys, tokens_per_block, out); });
}

void quest_scores(const float *digest, uint64_t blocks, uint32_t kv_heads, const View &query, Combine combine,
                  float *out) {
    assert(kv_heads >= 1 && query.heads >= kv_heads && query.heads % kv_heads == 0);
    assert(query.tokens >= 1 && query.dim >= 1 && query.dim <= kMaxHeadDim);
#ifdef SG_KERNELS_X86
    if (query.dim % 8 == 0 && have_avx2()) {
        dispatch(query.dtype,
                 [&](auto d) { quest_scores_avx2<decltype(d)::value>(digest, blocks, kv_heads, query, combine, out); });
        return;
    }
#endif
    dispatch(query.dtype,
             [&](auto d) { quest_scores_as<decltype(d)::value>(digest, blocks, kv_heads, query, combine, out); });
}

}  // namespace sg::kernels
