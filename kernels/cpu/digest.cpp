// Page digests and Quest scores (kernels.hpp).
//
// Each kernel has a portable path and, on x86-64, AVX2 (+F16C, FMA) and AVX-512 (F/BW/VL) ones, the
// widest the CPU has chosen at run time (variants.hpp), since the library is built for the baseline
// ISA. The vector digests are bit-identical to the portable one (all take min and max on order keys of
// the raw bits, then convert exactly); the vector Quest sums in another order and with FMA, within the
// tests' tolerance. Both are bound by one thread's memory bandwidth on long sequences, so what pays
// here is traffic (streaming stores, L2 prefetch) more than arithmetic.
#include "cpu/cpu.hpp"
#include "cpu/variants.hpp"

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

#define SG_AVX2 __attribute__((target("avx2,f16c,fma"), always_inline)) inline
#define SG_AVX2_FN __attribute__((target("avx2,f16c,fma")))
// Lambdas do not inherit their function's target: one that calls SG_AVX2 helpers must say it too. They
// are not forced inline, as the shared score loop that calls them has the baseline target.
#define SG_AVX2_LAMBDA __attribute__((target("avx2,f16c,fma")))
#define SG_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c,fma"), always_inline)) inline
#define SG_AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c,fma")))
#define SG_AVX512_LAMBDA __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c,fma")))

// order_key on 16 lanes.
SG_AVX2 __m256i order_keys(__m256i x) {
    return _mm256_xor_si256(x, _mm256_and_si256(_mm256_srai_epi16(x, 15), _mm256_set1_epi16(0x7fff)));
}

template <DType D>
SG_AVX2 __m256i load_keys(const uint16_t *p) {
    return order_keys(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
}

// 8 floats to out; a streaming store skips the read-for-ownership of a line that the cache would
// evict long before anyone reads it (out then 32-byte aligned).
template <bool Stream>
SG_AVX2 void store8(float *out, __m256 v) {
    if constexpr (Stream)
        _mm256_stream_ps(out, v);
    else
        _mm256_storeu_ps(out, v);
}

// 16 order keys back to their values, as floats.
template <DType D, bool Stream>
SG_AVX2 void store_keys(__m256i k, float *out) {
    const __m256i bits = order_keys(k);
    const __m128i a = _mm256_castsi256_si128(bits), b = _mm256_extracti128_si256(bits, 1);
    if constexpr (D == DType::fp16) {
        store8<Stream>(out, _mm256_cvtph_ps(a));
        store8<Stream>(out + 8, _mm256_cvtph_ps(b));
    } else {
        store8<Stream>(out, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)));
        store8<Stream>(out + 8, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
    }
}

// Columns [c, c + 16 N) of one (block, head): the running min and max stay in 2N registers while the
// block's rows stream past, and are converted and stored once.
template <DType D, int N, bool Stream>
SG_AVX2 void digest_columns(const View &keys, uint64_t first, uint64_t end, uint32_t h, size_t c, float *mn, float *mx,
                            size_t ahead) {
    __m256i lo[N], hi[N];
    const uint16_t *r = row<D>(keys, first, h) + c;
#pragma GCC unroll 8
    for (int k = 0; k < N; ++k) {
        if (k % 2 == 0) _mm_prefetch(reinterpret_cast<const char *>(r + 16 * k) + ahead, _MM_HINT_T1);
        lo[k] = hi[k] = load_keys<D>(r + 16 * k);
    }
    for (uint64_t t = first + 1; t < end; ++t) {
        r = row<D>(keys, t, h) + c;
#pragma GCC unroll 8
        for (int k = 0; k < N; ++k) {
            if (k % 2 == 0) _mm_prefetch(reinterpret_cast<const char *>(r + 16 * k) + ahead, _MM_HINT_T1);
            const __m256i x = load_keys<D>(r + 16 * k);
            lo[k] = _mm256_min_epi16(lo[k], x);
            hi[k] = _mm256_max_epi16(hi[k], x);
        }
    }
#pragma GCC unroll 8
    for (int k = 0; k < N; ++k) {
        store_keys<D, Stream>(lo[k], mn + c + 16 * k);
        store_keys<D, Stream>(hi[k], mx + c + 16 * k);
    }
}

// How far ahead of its reads the digest prefetches at least (it reads long streams): one thread's
// demand loads and the hardware prefetchers alone left the digest at half of memcpy's bandwidth and
// Quest at a third of it. Both prefetch into L2 only (T1; the lines are read once, so L1 gains
// nothing from them): ~10% faster than T0.
constexpr size_t kPrefetchBytes = 16384;

// Quest reads its digest rows front to back and prefetches into L2 (T1) this far ahead: 6.0-6.9 ms
// for 64 MiB of digest against 7.1-10 ms at T0 16 KiB ahead (AVX-512; 16-128 KiB ahead differ by
// less than the noise).
constexpr size_t kScorePrefetchBytes = 64 << 10;

// Digests at least this large are written with streaming stores (if 64-byte aligned): beyond L2 the
// output is written back to memory before quest_scores reads it anyway, and the read-for-ownership
// of every output line was a fifth of the digest's memory traffic (0.63 -> 0.85 of memcpy at 256 MiB
// of keys). Smaller ones, such as one block of a paged pool, stay in cache for the scores.
constexpr uint64_t kStreamOutBytes = 4ull << 20;

bool stream_out(const View &keys, uint32_t tokens_per_block, const float *out) {
    const uint64_t bytes = digest_floats(num_blocks(keys.tokens, tokens_per_block), keys.heads, keys.dim) * 4;
    return bytes >= kStreamOutBytes && reinterpret_cast<uintptr_t>(out) % 64 == 0;
}

// The digest walks a block head by head and column chunk by column chunk, each chunk down the block's
// rows with its min and max in registers, and prefetches (into L2) the line it reads at the same
// place in a later block: the whole blocks that span kPrefetchBytes. One pass over a block then has a
// line in flight in each of its rows, several streams at once, which one thread's memory reads
// sustain better than one: 1.15-1.28 of memcpy against 0.92-1.0 for the token rows read front to back
// with the block's min and max in L1 (what this replaced; AVX2, 256 MiB of keys). Blocks beyond
// kPrefetchMaxBytes would be evicted before they are read: then the prefetch is kPrefetchBytes ahead,
// later rows of the same block.
constexpr size_t kPrefetchMaxBytes = 256 << 10;

size_t prefetch_ahead(const View &keys, uint32_t tokens_per_block) {
    const size_t block = size_t(tokens_per_block) * keys.token_stride * 2;
    if (block == 0 || block > kPrefetchMaxBytes) return kPrefetchBytes;
    return (kPrefetchBytes + block - 1) / block * block;
}

// fp16/bf16 keys with dim a multiple of 16.
template <DType D, bool Stream>
SG_AVX2_FN void page_digest_avx2(const View &keys, uint32_t tokens_per_block, float *out) {
    const size_t d = keys.dim;
    const uint64_t blocks = num_blocks(keys.tokens, tokens_per_block);
    const size_t ahead = prefetch_ahead(keys, tokens_per_block);
    for (uint64_t b = 0; b < blocks; ++b) {
        const uint64_t first = b * tokens_per_block;
        const uint64_t end = std::min<uint64_t>(keys.tokens, first + tokens_per_block);
        for (uint32_t h = 0; h < keys.heads; ++h) {
            float *mn = out + (b * keys.heads + h) * 2 * d;
            float *mx = mn + d;
            size_t c = 0;
            for (; c + 64 <= d; c += 64) digest_columns<D, 4, Stream>(keys, first, end, h, c, mn, mx, ahead);
            for (; c < d; c += 16) digest_columns<D, 1, Stream>(keys, first, end, h, c, mn, mx, ahead);
        }
    }
    if constexpr (Stream) _mm_sfence();  // streaming stores are weakly ordered: publish them before returning
}

// The horizontal sums of acc[0 .. J) into s[0 .. J), J <= 4, reduced together: three hadds and an add
// for the four, where one at a time took four shuffle-add steps each (~10% of Quest in cache).
template <int J>
SG_AVX2 void hsums(const __m256 *acc, float *s) {
    const __m256 z = _mm256_setzero_ps();
    const __m256 ab = _mm256_hadd_ps(acc[0], J > 1 ? acc[1 % J] : z);
    const __m256 cd = _mm256_hadd_ps(J > 2 ? acc[2 % J] : z, J > 3 ? acc[3 % J] : z);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    alignas(16) float r[4];
    _mm_store_ps(r, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) s[j] = r[j];
}

// upper_bound for J query heads (rows d apart) against one block's digest, dim a multiple of 8: each
// digest vector is loaded once for the J heads. max(q·lo, q·hi) = q·(q < 0 ? lo : hi) since lo <= hi
// and rounding is monotone, so a blend on q's sign bit and one FMA replace two products and a max.
template <int J>
SG_AVX2 void upper_bounds(const float *q, size_t d, const float *lo, const float *hi, float *s) {
    __m256 acc[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) acc[j] = _mm256_setzero_ps();
    // Two accumulators a head when dim allows (even and odd steps): halves the FMA latency chain.
    __m256 acc2[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) acc2[j] = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 16 <= d; i += 16) {
        _mm_prefetch(reinterpret_cast<const char *>(lo + i) + kScorePrefetchBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char *>(hi + i) + kScorePrefetchBytes, _MM_HINT_T1);
        const __m256 l = _mm256_loadu_ps(lo + i), h = _mm256_loadu_ps(hi + i);
        const __m256 l2 = _mm256_loadu_ps(lo + i + 8), h2 = _mm256_loadu_ps(hi + i + 8);
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j) {
            const __m256 qv = _mm256_loadu_ps(q + j * d + i), qv2 = _mm256_loadu_ps(q + j * d + i + 8);
            acc[j] = _mm256_fmadd_ps(qv, _mm256_blendv_ps(h, l, qv), acc[j]);
            acc2[j] = _mm256_fmadd_ps(qv2, _mm256_blendv_ps(h2, l2, qv2), acc2[j]);
        }
    }
    if (i < d) {
        const __m256 l = _mm256_loadu_ps(lo + i), h = _mm256_loadu_ps(hi + i);
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j) {
            const __m256 qv = _mm256_loadu_ps(q + j * d + i);
            acc[j] = _mm256_fmadd_ps(qv, _mm256_blendv_ps(h, l, qv), acc[j]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) acc[j] = _mm256_add_ps(acc[j], acc2[j]);
    hsums<J>(acc, s);
}

// The query heads of KV head g (rows at q, d apart, `count` of them, the first being head j0 of the
// group) against block b, folded into out[b * kv_heads + g]; 4 heads per pass over the digest rows.
// Shared by the variants, which pass their bounds(n, q, lo, s) (a call per block and KV head: ~1%).
template <class Bounds>
void score_group(const Bounds &bounds, const float *digest, uint32_t kv_heads, size_t d, Combine combine,
                 const float *q, uint32_t j0, uint32_t count, uint32_t g, uint64_t b, float *out) {
    const float *lo = digest + (b * kv_heads + g) * 2 * d;
    float &o = out[b * kv_heads + g];
    float acc = o;
    for (uint32_t j = 0; j < count; j += 4) {
        float s[4];
        const uint32_t n = std::min(4u, count - j);
        bounds(n, q + j * d, lo, s);
        for (uint32_t k = 0; k < n; ++k) acc = j0 + j + k == 0 ? s[k] : cpu::combine(combine, acc, s[k]);
    }
    o = acc;
}

// Converts the query heads into q and runs score_group over every (block, KV head): all heads
// converted up front when they fit, so the digest is read once, front to back; else a KV head at a
// time. prepare(floats) sees each fill of q.
template <DType D, class Bounds, class Prepare>
void quest_passes(const Bounds &bounds, const Prepare &prepare, const float *digest, uint64_t blocks, uint32_t kv_heads,
                  const View &query, Combine combine, float *q, float *out) {
    const size_t d = query.dim;
    const uint32_t group = query.heads / kv_heads;
    if (size_t(query.heads) * d <= kQueryFloats) {
        for (uint32_t h = 0; h < query.heads; ++h) convert<D>(row<D>(query, 0, h), q + h * d, d);
        prepare(size_t(query.heads) * d);
        for (uint64_t b = 0; b < blocks; ++b)
            for (uint32_t g = 0; g < kv_heads; ++g)
                score_group(bounds, digest, kv_heads, d, combine, q + size_t(g) * group * d, 0, group, g, b, out);
        return;
    }
    const uint32_t per_pass = uint32_t(std::min<size_t>(group, kQueryFloats / d));
    for (uint32_t g = 0; g < kv_heads; ++g)
        for (uint32_t j0 = 0; j0 < group; j0 += per_pass) {
            const uint32_t count = std::min(per_pass, group - j0);
            for (uint32_t j = 0; j < count; ++j) convert<D>(row<D>(query, 0, g * group + j0 + j), q + j * d, d);
            prepare(size_t(count) * d);
            for (uint64_t b = 0; b < blocks; ++b)
                score_group(bounds, digest, kv_heads, d, combine, q, j0, count, g, b, out);
        }
}

template <DType D>
SG_AVX2_FN void quest_scores_avx2(const float *digest, uint64_t blocks, uint32_t kv_heads, const View &query,
                                  Combine combine, float *out) {
    const size_t d = query.dim;
    alignas(64) float q[kQueryFloats];
    const auto bounds = [d](uint32_t n, const float *q, const float *lo, float *s) SG_AVX2_LAMBDA {
        switch (n) {
            case 4:
                return upper_bounds<4>(q, d, lo, lo + d, s);
            case 3:
                return upper_bounds<3>(q, d, lo, lo + d, s);
            case 2:
                return upper_bounds<2>(q, d, lo, lo + d, s);
            default:
                return upper_bounds<1>(q, d, lo, lo + d, s);
        }
    };
    quest_passes<D>(
        bounds, [](size_t) {}, digest, blocks, kv_heads, query, combine, q, out);
}

// ---- AVX-512 (F/BW/VL): the same kernels on 32 keys or 16 floats a register ----

// GCC 12 warns inside its own avx512fintrin.h (the _mm512_undefined operand of the conversions and
// extracts "may be used uninitialized"): a false positive of the header, not of this code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

SG_AVX512 __m512i order_keys512(__m512i x) {
    return _mm512_xor_si512(x, _mm512_and_si512(_mm512_srai_epi16(x, 15), _mm512_set1_epi16(0x7fff)));
}

template <DType D, bool Stream>
SG_AVX512 void store16(float *out, __m256i bits) {
    __m512 v;
    if constexpr (D == DType::fp16)
        v = _mm512_cvtph_ps(bits);
    else
        v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    if constexpr (Stream)
        _mm512_stream_ps(out, v);
    else
        _mm512_storeu_ps(out, v);
}

// 32 order keys back to their values, as floats.
template <DType D, bool Stream>
SG_AVX512 void store_keys512(__m512i k, float *out) {
    const __m512i bits = order_keys512(k);
    store16<D, Stream>(out, _mm512_castsi512_si256(bits));
    store16<D, Stream>(out + 16, _mm512_extracti64x4_epi64(bits, 1));
}

template <DType D, int N, bool Stream>
SG_AVX512 void digest_columns512(const View &keys, uint64_t first, uint64_t end, uint32_t h, size_t c, float *mn,
                                 float *mx, size_t ahead) {
    __m512i lo[N], hi[N];
    const uint16_t *r = row<D>(keys, first, h) + c;
#pragma GCC unroll 8
    for (int k = 0; k < N; ++k) {
        _mm_prefetch(reinterpret_cast<const char *>(r + 32 * k) + ahead, _MM_HINT_T1);
        lo[k] = hi[k] = order_keys512(_mm512_loadu_si512(r + 32 * k));
    }
    for (uint64_t t = first + 1; t < end; ++t) {
        r = row<D>(keys, t, h) + c;
#pragma GCC unroll 8
        for (int k = 0; k < N; ++k) {
            _mm_prefetch(reinterpret_cast<const char *>(r + 32 * k) + ahead, _MM_HINT_T1);
            const __m512i x = order_keys512(_mm512_loadu_si512(r + 32 * k));
            lo[k] = _mm512_min_epi16(lo[k], x);
            hi[k] = _mm512_max_epi16(hi[k], x);
        }
    }
#pragma GCC unroll 8
    for (int k = 0; k < N; ++k) {
        store_keys512<D, Stream>(lo[k], mn + c + 32 * k);
        store_keys512<D, Stream>(hi[k], mx + c + 32 * k);
    }
}

template <DType D, bool Stream>
SG_AVX512_FN void page_digest_avx512(const View &keys, uint32_t tokens_per_block, float *out) {
    const size_t d = keys.dim;
    const uint64_t blocks = num_blocks(keys.tokens, tokens_per_block);
    const size_t ahead = prefetch_ahead(keys, tokens_per_block);
    for (uint64_t b = 0; b < blocks; ++b) {
        const uint64_t first = b * tokens_per_block;
        const uint64_t end = std::min<uint64_t>(keys.tokens, first + tokens_per_block);
        for (uint32_t h = 0; h < keys.heads; ++h) {
            float *mn = out + (b * keys.heads + h) * 2 * d;
            float *mx = mn + d;
            size_t c = 0;
            for (; c + 128 <= d; c += 128) digest_columns512<D, 4, Stream>(keys, first, end, h, c, mn, mx, ahead);
            for (; c + 32 <= d; c += 32) digest_columns512<D, 1, Stream>(keys, first, end, h, c, mn, mx, ahead);
            if (c < d) digest_columns<D, 1, Stream>(keys, first, end, h, c, mn, mx, ahead);
        }
    }
    if constexpr (Stream) _mm_sfence();
}

// upper_bounds on 16 floats a step, dim a multiple of 16; neg holds each head's sign masks (d / 16 per
// head, computed once per call rather than once per block).
template <int J>
SG_AVX512 void upper_bounds512(const float *q, const __mmask16 *neg, size_t d, const float *lo, const float *hi,
                               float *s) {
    __m512 acc[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) acc[j] = _mm512_setzero_ps();
    for (size_t i = 0; i < d; i += 16) {
        _mm_prefetch(reinterpret_cast<const char *>(lo + i) + kScorePrefetchBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char *>(hi + i) + kScorePrefetchBytes, _MM_HINT_T1);
        const __m512 l = _mm512_loadu_ps(lo + i), h = _mm512_loadu_ps(hi + i);
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j)
            acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + i), _mm512_mask_blend_ps(neg[(j * d + i) / 16], h, l),
                                     acc[j]);
    }
    __m256 half[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j)
        half[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
    hsums<J>(half, s);
}

template <DType D>
SG_AVX512_FN void quest_scores_avx512(const float *digest, uint64_t blocks, uint32_t kv_heads, const View &query,
                                      Combine combine, float *out) {
    const size_t d = query.dim;
    alignas(64) float q[kQueryFloats];
    __mmask16 neg[kQueryFloats / 16];
    // Each row's sign masks sit at its offset in q / 16, recomputed whenever quest_passes refills q.
    const auto bounds = [&](uint32_t n, const float *qr, const float *lo, float *s) SG_AVX512_LAMBDA {
        const __mmask16 *m = neg + (qr - q) / 16;
        switch (n) {
            case 4:
                return upper_bounds512<4>(qr, m, d, lo, lo + d, s);
            case 3:
                return upper_bounds512<3>(qr, m, d, lo, lo + d, s);
            case 2:
                return upper_bounds512<2>(qr, m, d, lo, lo + d, s);
            default:
                return upper_bounds512<1>(qr, m, d, lo, lo + d, s);
        }
    };
    const auto prepare = [&](size_t floats) SG_AVX512_LAMBDA {
        for (size_t i = 0; i < floats; i += 16)
            neg[i / 16] = _mm512_cmplt_epi32_mask(_mm512_load_si512(q + i), _mm512_setzero_si512());
    };
    quest_passes<D>(bounds, prepare, digest, blocks, kv_heads, query, combine, q, out);
}

#pragma GCC diagnostic pop

#undef SG_AVX2
#undef SG_AVX2_FN
#undef SG_AVX2_LAMBDA
#undef SG_AVX512
#undef SG_AVX512_FN
#undef SG_AVX512_LAMBDA

#endif  // SG_KERNELS_X86

}  // namespace

const char *cpu::isa_name(Isa isa) {
    switch (isa) {
        case Isa::portable:
            return "portable";
        case Isa::avx2:
            return "avx2";
        case Isa::avx512:
            return "avx512";
    }
    return "?";
}

bool cpu::isa_supported(Isa isa) {
#ifdef SG_KERNELS_X86
    // Asked once each (the answers cannot change).
    static const bool avx2 =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
    static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                               __builtin_cpu_supports("avx512vl");
    return isa == Isa::portable || (isa == Isa::avx2 && avx2) || (isa == Isa::avx512 && avx512);
#else
    return isa == Isa::portable;
#endif
}

cpu::Isa cpu::best_isa() {
    static const Isa best = isa_supported(Isa::avx512) ? Isa::avx512
                            : isa_supported(Isa::avx2) ? Isa::avx2
                                                       : Isa::portable;
    return best;
}

void cpu::page_digest_on(Isa isa, const View &keys, uint32_t tokens_per_block, float *out) {
    assert(tokens_per_block >= 1 && keys.dim >= 1 && keys.dim <= kMaxHeadDim && isa_supported(isa));
#ifdef SG_KERNELS_X86
    if (isa != Isa::portable && keys.dtype != DType::fp32 && keys.dim % 16 == 0) {
        const bool stream = stream_out(keys, tokens_per_block, out);
        const auto run = [&](auto d) {
            constexpr DType D = decltype(d)::value;
            if (isa == Isa::avx512)
                (stream ? page_digest_avx512<D, true> : page_digest_avx512<D, false>)(keys, tokens_per_block, out);
            else
                (stream ? page_digest_avx2<D, true> : page_digest_avx2<D, false>)(keys, tokens_per_block, out);
        };
        if (keys.dtype == DType::fp16)
            run(std::integral_constant<DType, DType::fp16>{});
        else
            run(std::integral_constant<DType, DType::bf16>{});
        return;
    }
#endif
    dispatch(keys.dtype, [&](auto d) { page_digest_as<decltype(d)::value>(keys, tokens_per_block, out); });
}

void cpu::quest_scores_on(Isa isa, const float *digest, uint64_t blocks, uint32_t kv_heads, const View &query,
                          Combine combine, float *out) {
    assert(kv_heads >= 1 && query.heads >= kv_heads && query.heads % kv_heads == 0);
    assert(query.tokens >= 1 && query.dim >= 1 && query.dim <= kMaxHeadDim && isa_supported(isa));
#ifdef SG_KERNELS_X86
    if (isa == Isa::avx512 && query.dim % 16 == 0) {
        dispatch(query.dtype, [&](auto d) {
            quest_scores_avx512<decltype(d)::value>(digest, blocks, kv_heads, query, combine, out);
        });
        return;
    }
    if (isa != Isa::portable && query.dim % 8 == 0) {
        dispatch(query.dtype,
                 [&](auto d) { quest_scores_avx2<decltype(d)::value>(digest, blocks, kv_heads, query, combine, out); });
        return;
    }
#endif
    dispatch(query.dtype,
             [&](auto d) { quest_scores_as<decltype(d)::value>(digest, blocks, kv_heads, query, combine, out); });
}

void page_digest(const View &keys, uint32_t tokens_per_block, float *out) {
    page_digest_on(best_isa(), keys, tokens_per_block, out);
}

void quest_scores(const float *digest, uint64_t blocks, uint32_t kv_heads, const View &query, Combine combine,
                  float *out) {
    quest_scores_on(best_isa(), digest, blocks, kv_heads, query, combine, out);
}

}  // namespace sg::kernels
