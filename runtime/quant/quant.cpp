// In-flight quantization of staged segments (runtime/quant); the format is in quant.hpp.
#include "quant/quant.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace sg::quant {

namespace {

// Where each head row of a segment belongs: the group (block, plane, head) of the row at `offset`.
struct Rows {
    uint64_t stride, plane, row, first_block;
    uint32_t heads, tokens_per_block, planes_per_block;
    bool token_major, fused;

    // false when the row is not wholly inside a plane (padding between blocks, a cut row).
    bool group(uint64_t offset, uint64_t &g) const {
        const uint64_t block = offset / stride;
        uint64_t q = offset % stride;
        uint64_t p = 0;
        if (fused) {
            p = q / plane;
            if (p >= 2) return false;
            q -= p * plane;
        }
        if (q % row != 0 || q + row > plane) return false;
        const uint64_t r = q / row;
        const uint64_t head = token_major ? r % heads : r / tokens_per_block;
        g = ((block - first_block) * planes_per_block + p) * heads + head;
        return true;
    }
};

Rows rows_of(const kv::Layout &d, uint64_t offset) {
    Rows r{};
    r.stride = d.block_stride;
    r.plane = d.plane_bytes;
    r.row = d.row_bytes();
    r.first_block = offset / d.block_stride;
    r.heads = d.num_kv_heads;
    r.tokens_per_block = d.tokens_per_block;
    r.fused = d.packing != SG_KV_SEPARATE;
    r.planes_per_block = r.fused ? 2 : 1;
    r.token_major = d.order == SG_BLOCK_TOKEN_MAJOR;
    return r;
}

// Element access per dtype, as templates so each row loop is one tight, vectorisable loop (a switch
// per element made the codec run at 0.1-0.3 GB/s).
struct F32 {
    static float load(const uint8_t *p, uint32_t i) {
        float f;
        std::memcpy(&f, p + 4 * size_t(i), 4);
        return f;
    }
    static void store(uint8_t *p, uint32_t i, float f) { std::memcpy(p + 4 * size_t(i), &f, 4); }
#if defined(__SSE2__)
    static __m128 load4(const uint8_t *p) { return _mm_loadu_ps(reinterpret_cast<const float *>(p)); }
    static void store4(uint8_t *p, __m128 f) { _mm_storeu_ps(reinterpret_cast<float *>(p), f); }
#endif
};
struct F16 {
    static float load(const uint8_t *p, uint32_t i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * size_t(i), 2);
        return kernels::fp16_to_float(h);
    }
    static void store(uint8_t *p, uint32_t i, float f) {
        const uint16_t h = kernels::float_to_fp16(f);
        std::memcpy(p + 2 * size_t(i), &h, 2);
    }
#if defined(__SSE2__)
    // kernels::fp16_to_float and float_to_fp16, four lanes at a time, bit for bit the same.
    static __m128 load4(const uint8_t *p) {
        const __m128i h = _mm_unpacklo_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)), _mm_setzero_si128());
        const __m128 magic = _mm_castsi128_ps(_mm_set1_epi32((254 - 15) << 23));
        const __m128 was_infnan = _mm_castsi128_ps(_mm_set1_epi32((127 + 16) << 23));
        const __m128 f = _mm_mul_ps(_mm_castsi128_ps(_mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x7fff)), 13)), magic);
        __m128i u = _mm_castps_si128(f);
        u = _mm_or_si128(u, _mm_and_si128(_mm_castps_si128(_mm_cmpge_ps(f, was_infnan)), _mm_set1_epi32(255 << 23)));
        u = _mm_or_si128(u, _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16));
        return _mm_castsi128_ps(u);
    }
    static void store4(uint8_t *p, __m128 f) {
        const __m128i bits = _mm_castps_si128(f);
        const __m128i sign = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(0x8000));
        const __m128i x = _mm_and_si128(bits, _mm_set1_epi32(0x7fffffff));
        // x < 2^31, so signed compares order it as unsigned ones would.
        const __m128i infnan = _mm_cmpgt_epi32(x, _mm_set1_epi32(0x7f7fffff));
        const __m128i nan = _mm_cmpgt_epi32(x, _mm_set1_epi32(0x7f800000));
        const __m128i overflow = _mm_cmpgt_epi32(x, _mm_set1_epi32(0x477fefff));
        const __m128i subnormal = _mm_cmplt_epi32(x, _mm_set1_epi32(0x38800000));
        const __m128 half = _mm_set1_ps(0.5f);
        const __m128i sub = _mm_sub_epi32(_mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(x), half)), _mm_castps_si128(half));
        const __m128i odd = _mm_and_si128(_mm_srli_epi32(x, 13), _mm_set1_epi32(1));
        const __m128i normal = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(x, _mm_set1_epi32(int(0xc8000fffu))), odd), 13);
        __m128i r = _mm_or_si128(_mm_and_si128(subnormal, sub), _mm_andnot_si128(subnormal, normal));
        const __m128i big = _mm_or_si128(_mm_set1_epi32(0x7c00), _mm_and_si128(nan, _mm_set1_epi32(0x0200)));
        const __m128i special = _mm_or_si128(infnan, overflow);
        r = _mm_or_si128(_mm_and_si128(special, big), _mm_andnot_si128(special, r));
        r = _mm_or_si128(r, sign);
        // Sign-extend the low halves so the saturating pack keeps them as they are.
        r = _mm_srai_epi32(_mm_slli_epi32(r, 16), 16);
        _mm_storel_epi64(reinterpret_cast<__m128i *>(p), _mm_packs_epi32(r, r));
    }
#endif
};
struct BF16 {
    static float load(const uint8_t *p, uint32_t i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * size_t(i), 2);
        return kernels::bf16_to_float(h);
    }
    static void store(uint8_t *p, uint32_t i, float f) {
        const uint16_t h = kernels::float_to_bf16(f);
        std::memcpy(p + 2 * size_t(i), &h, 2);
    }
#if defined(__SSE2__)
    // kernels::bf16_to_float and float_to_bf16, four lanes at a time, bit for bit the same.
    static __m128 load4(const uint8_t *p) {
        const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p));
        return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
    }
    static void store4(uint8_t *p, __m128 f) {
        const __m128i x = _mm_castps_si128(f);
        const __m128i odd = _mm_and_si128(_mm_srli_epi32(x, 16), _mm_set1_epi32(1));
        const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(x, _mm_set1_epi32(0x7fff)), odd), 16);
        const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(x, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
        const __m128i quiet = _mm_or_si128(_mm_srli_epi32(x, 16), _mm_set1_epi32(0x40));
        __m128i r = _mm_or_si128(_mm_and_si128(nan, quiet), _mm_andnot_si128(nan, rounded));
        r = _mm_srai_epi32(_mm_slli_epi32(r, 16), 16);
        _mm_storel_epi64(reinterpret_cast<__m128i *>(p), _mm_packs_epi32(r, r));
    }
#endif
};

template <class F> void dispatch(sg_dtype_t dtype, F &&f) {
    if (dtype == SG_DTYPE_FP32) f(F32{});
    else if (dtype == SG_DTYPE_FP16) f(F16{});
    else f(BF16{});
}

// Pass 1: the segment's elements as floats (out) and each group's largest finite magnitude: an
// infinity or NaN never sets the scale (it travels as the code's NaN), as in the CPU twin. Magnitudes compare as their bit patterns (sign
// cleared), an integer maximum the compiler vectorises where a float one would need fast-math.
template <class T>
void widen(const Rows &rows, uint64_t offset, uint64_t length, uint64_t row, uint32_t dim, const uint8_t *raw,
           float *out, float *absmax) {
    for (uint64_t at = 0; at < length; at += row) {
        uint64_t g = 0;
        rows.group(offset + at, g);  // shape_of checked every row
        uint32_t m = std::bit_cast<uint32_t>(absmax[g]);
        const uint8_t *p = raw + at;
        uint32_t d = 0;
#if defined(__SSE2__)
        {
            __m128 vm = _mm_setzero_ps();
            const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
            for (; d + 4 <= dim; d += 4) {
                const __m128 f = T::load4(p + sizeof(uint16_t) * (std::is_same_v<T, F32> ? 2 : 1) * d);
                _mm_storeu_ps(out + d, f);
                const __m128 fa = _mm_and_ps(f, abs_mask);
                const __m128 finite = _mm_castsi128_ps(_mm_cmplt_epi32(_mm_castps_si128(fa), _mm_set1_epi32(0x7f800000)));
                vm = _mm_max_ps(vm, _mm_and_ps(fa, finite));  // Inf, NaN -> 0
            }
            alignas(16) float lanes[4];
            _mm_store_ps(lanes, vm);
            for (float l : lanes) m = std::max(m, std::bit_cast<uint32_t>(l));
        }
#endif
        for (; d < dim; ++d) {
            const float f = T::load(p, d);
            out[d] = f;
            uint32_t a = std::bit_cast<uint32_t>(f) & 0x7fffffffu;
            a = a >= 0x7f800000u ? 0u : a;  // Inf, NaN
            m = a > m ? a : m;
        }
        absmax[g] = std::bit_cast<float>(m);
        out += dim;
    }
}

// Pass 2, int8: quantize_value's arithmetic (clamp to +-127, nearest with ties to even; a non-finite
// element to -128). On x86-64 four at a time with SSE2 (cvtps2dq rounds to nearest even, the default
// mode).
void int8_row(const float *x, uint32_t dim, float inv, uint8_t *codes) {
    uint32_t d = 0;
#if defined(__SSE2__)
    const __m128 vinv = _mm_set1_ps(inv), hi = _mm_set1_ps(127.0f), lo = _mm_set1_ps(-127.0f);
    for (; d + 16 <= dim; d += 16) {
        __m128i q[4];
        for (int k = 0; k < 4; ++k) {
            const __m128 f = _mm_loadu_ps(x + d + 4 * k);
            const __m128i ax = _mm_and_si128(_mm_castps_si128(f), _mm_set1_epi32(0x7fffffff));
            const __m128i bad = _mm_cmpgt_epi32(ax, _mm_set1_epi32(0x7f7fffff));  // Inf, NaN
            __m128 v = _mm_mul_ps(f, vinv);
            v = _mm_andnot_ps(_mm_castsi128_ps(bad), v);
            v = _mm_max_ps(_mm_min_ps(v, hi), lo);
            q[k] = _mm_or_si128(_mm_and_si128(bad, _mm_set1_epi32(-128)), _mm_andnot_si128(bad, _mm_cvtps_epi32(v)));
        }
        const __m128i w = _mm_packs_epi16(_mm_packs_epi32(q[0], q[1]), _mm_packs_epi32(q[2], q[3]));
        _mm_storeu_si128(reinterpret_cast<__m128i *>(codes + d), w);
    }
#endif
    for (; d < dim; ++d) codes[d] = kernels::quantize_value(x[d], inv, kernels::QuantCode::int8);
}

// Pass 2, FP8 E4M3: kernels::float_to_e4m3 of x * inv (nearest, ties to even; below 2^-6 in steps of
// 2^-9; finite values saturating at 448; Inf and NaN to 0x7f), four lanes at a time with SSE2, bit for
// bit the scalar code.
void fp8_row(const float *x, uint32_t dim, float inv, uint8_t *codes) {
    uint32_t d = 0;
#if defined(__SSE2__)
    const __m128 vinv = _mm_set1_ps(inv);
    const __m128i abs_mask = _mm_set1_epi32(0x7fffffff);
    for (; d + 16 <= dim; d += 16) {
        __m128i q[4];
        for (int k = 0; k < 4; ++k) {
            const __m128i bits = _mm_castps_si128(_mm_mul_ps(_mm_loadu_ps(x + d + 4 * k), vinv));
            const __m128i sign = _mm_and_si128(_mm_srli_epi32(bits, 24), _mm_set1_epi32(0x80));
            const __m128i ax = _mm_and_si128(bits, abs_mask);
            // Below 2^-6: multiples of 2^-9, the FPU rounding to nearest even.
            const __m128i small = _mm_cvtps_epi32(_mm_mul_ps(_mm_castsi128_ps(ax), _mm_set1_ps(512.0f)));
            __m128i n = _mm_or_si128(_mm_slli_epi32(_mm_sub_epi32(_mm_srli_epi32(ax, 23), _mm_set1_epi32(120)), 3),
                                     _mm_and_si128(_mm_srli_epi32(ax, 20), _mm_set1_epi32(7)));
            const __m128i rest = _mm_and_si128(ax, _mm_set1_epi32(0xfffff));
            const __m128i above = _mm_cmpgt_epi32(rest, _mm_set1_epi32(0x80000));
            const __m128i tie_odd = _mm_and_si128(_mm_cmpeq_epi32(rest, _mm_set1_epi32(0x80000)),
                                                  _mm_cmpeq_epi32(_mm_and_si128(n, _mm_set1_epi32(1)), _mm_set1_epi32(1)));
            n = _mm_sub_epi32(n, _mm_or_si128(above, tie_odd));  // a true mask is -1: adds one
            const __m128i over = _mm_cmpgt_epi32(n, _mm_set1_epi32(0x7e));
            n = _mm_or_si128(_mm_and_si128(over, _mm_set1_epi32(0x7e)), _mm_andnot_si128(over, n));
            const __m128i is_small = _mm_cmplt_epi32(ax, _mm_set1_epi32(0x3c800000));
            __m128i r = _mm_or_si128(_mm_and_si128(is_small, small), _mm_andnot_si128(is_small, n));
            const __m128i saturate = _mm_cmpgt_epi32(ax, _mm_set1_epi32(0x43dfffff));
            r = _mm_or_si128(_mm_and_si128(saturate, _mm_set1_epi32(0x7e)), _mm_andnot_si128(saturate, r));
            const __m128i nan = _mm_cmpgt_epi32(ax, _mm_set1_epi32(0x7f7fffff));  // Inf, NaN
            r = _mm_or_si128(_mm_and_si128(nan, _mm_set1_epi32(0x7f)), _mm_andnot_si128(nan, r));
            q[k] = _mm_or_si128(r, sign);
        }
        const __m128i w = _mm_packus_epi16(_mm_packs_epi32(q[0], q[1]), _mm_packs_epi32(q[2], q[3]));
        _mm_storeu_si128(reinterpret_cast<__m128i *>(codes + d), w);
    }
#endif
    for (; d < dim; ++d) codes[d] = kernels::quantize_value(x[d], inv, kernels::QuantCode::fp8_e4m3);
}

#if defined(__x86_64__)
#define SG_WQ_AVX2 __attribute__((target("avx2,f16c")))

// The same passes eight lanes at a time where the CPU has AVX2 and F16C (the hardware fp16
// conversion is exact; it quiets a signalling NaN's payload, which no code depends on). Bit for bit
// the SSE2 and scalar code otherwise: the codec test runs each path against the CPU twin.
SG_WQ_AVX2 void widen_f16_avx2(const Rows &rows, uint64_t offset, uint64_t length, uint64_t row, uint32_t dim,
                               const uint8_t *raw, float *out, float *absmax) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (uint64_t at = 0; at < length; at += row) {
        uint64_t g = 0;
        rows.group(offset + at, g);
        const uint8_t *p = raw + at;
        __m256 vm = _mm256_setzero_ps();
        uint32_t d = 0;
        for (; d + 8 <= dim; d += 8) {
            const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + 2 * d)));
            _mm256_storeu_ps(out + d, f);
            const __m256 fa = _mm256_and_ps(f, abs_mask);
            const __m256 finite =
                _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800000), _mm256_castps_si256(fa)));
            vm = _mm256_max_ps(vm, _mm256_and_ps(fa, finite));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, vm);
        uint32_t m = std::bit_cast<uint32_t>(absmax[g]);
        for (float l : lanes) m = std::max(m, std::bit_cast<uint32_t>(l));
        for (; d < dim; ++d) {
            const float f = F16::load(p, d);
            out[d] = f;
            uint32_t a = std::bit_cast<uint32_t>(f) & 0x7fffffffu;
            a = a >= 0x7f800000u ? 0u : a;
            m = a > m ? a : m;
        }
        absmax[g] = std::bit_cast<float>(m);
        out += dim;
    }
}

// Four 8-lane results of int32 codes -> 32 bytes in order.
SG_WQ_AVX2 inline void store_codes_avx2(uint8_t *codes, __m256i r0, __m256i r1, __m256i r2, __m256i r3, bool is_signed) {
    const __m256i p01 = _mm256_packs_epi32(r0, r1), p23 = _mm256_packs_epi32(r2, r3);
    const __m256i b = is_signed ? _mm256_packs_epi16(p01, p23) : _mm256_packus_epi16(p01, p23);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(codes),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

SG_WQ_AVX2 void int8_row_avx2(const float *x, uint32_t dim, float inv, uint8_t *codes) {
    uint32_t d = 0;
    const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (; d + 32 <= dim; d += 32) {
        __m256i q[4];
        for (int k = 0; k < 4; ++k) {
            const __m256 f = _mm256_loadu_ps(x + d + 8 * k);
            const __m256i ax = _mm256_and_si256(_mm256_castps_si256(f), _mm256_set1_epi32(0x7fffffff));
            const __m256i bad = _mm256_cmpgt_epi32(ax, _mm256_set1_epi32(0x7f7fffff));  // Inf, NaN
            __m256 v = _mm256_andnot_ps(_mm256_castsi256_ps(bad), _mm256_mul_ps(f, vinv));
            const __m256i c = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(v, hi), lo));
            q[k] = _mm256_blendv_epi8(c, _mm256_set1_epi32(-128), bad);
        }
        store_codes_avx2(codes + d, q[0], q[1], q[2], q[3], true);
    }
    if (d < dim) int8_row(x + d, dim - d, inv, codes + d);
}

SG_WQ_AVX2 void fp8_row_avx2(const float *x, uint32_t dim, float inv, uint8_t *codes) {
    uint32_t d = 0;
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    for (; d + 32 <= dim; d += 32) {
        __m256i q[4];
        for (int k = 0; k < 4; ++k) {
            const __m256i bits = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x + d + 8 * k), vinv));
            const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
            const __m256i ax = _mm256_and_si256(bits, abs_mask);
            const __m256i small = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(ax), _mm256_set1_ps(512.0f)));
            __m256i n = _mm256_or_si256(
                _mm256_slli_epi32(_mm256_sub_epi32(_mm256_srli_epi32(ax, 23), _mm256_set1_epi32(120)), 3),
                _mm256_and_si256(_mm256_srli_epi32(ax, 20), _mm256_set1_epi32(7)));
            const __m256i rest = _mm256_and_si256(ax, _mm256_set1_epi32(0xfffff));
            const __m256i above = _mm256_cmpgt_epi32(rest, _mm256_set1_epi32(0x80000));
            const __m256i tie_odd =
                _mm256_and_si256(_mm256_cmpeq_epi32(rest, _mm256_set1_epi32(0x80000)),
                                 _mm256_cmpeq_epi32(_mm256_and_si256(n, _mm256_set1_epi32(1)), _mm256_set1_epi32(1)));
            n = _mm256_sub_epi32(n, _mm256_or_si256(above, tie_odd));
            n = _mm256_min_epi32(n, _mm256_set1_epi32(0x7e));
            const __m256i is_small = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), ax);
            __m256i r = _mm256_blendv_epi8(n, small, is_small);
            r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7e), _mm256_cmpgt_epi32(ax, _mm256_set1_epi32(0x43dfffff)));
            r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7f), _mm256_cmpgt_epi32(ax, _mm256_set1_epi32(0x7f7fffff)));
            q[k] = _mm256_or_si256(r, sign);
        }
        store_codes_avx2(codes + d, q[0], q[1], q[2], q[3], false);
    }
    if (d < dim) fp8_row(x + d, dim - d, inv, codes + d);
}
#endif

#if defined(__x86_64__)
// Decode of an fp16 row, eight at a time: the codes' values (int8 widened, E4M3 through the table)
// times the scale, to fp16 by the hardware (round to nearest even, as float_to_fp16; the one NaN a
// code can stand for converts to the same 0x7e00).
SG_WQ_AVX2 uint32_t decode_f16_avx2(const uint8_t *c, uint32_t dim, float scale, kernels::QuantCode code,
                                    const float *e4m3, uint8_t *p) {
    const __m256 vs = _mm256_set1_ps(scale);
    uint32_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(c + d));
        __m256 v;
        if (code == kernels::QuantCode::int8) {
            const __m256i i = _mm256_cvtepi8_epi32(bytes);
            // -128 is a non-finite element: the quiet NaN dequantize_value gives, whatever the scale.
            const __m256 bad = _mm256_castsi256_ps(_mm256_cmpeq_epi32(i, _mm256_set1_epi32(-128)));
            v = _mm256_blendv_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i), vs),
                                 _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), bad);
        } else {
            v = _mm256_mul_ps(_mm256_i32gather_ps(e4m3, _mm256_cvtepu8_epi32(bytes), 4), vs);
        }
        _mm_storeu_si128(reinterpret_cast<__m128i *>(p + 2 * d), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    return d;
}
#endif

// AVX2 and F16C. F16C from CPUID itself: clang before 16 refuses __builtin_cpu_supports("f16c").
bool cpu_has_avx2_f16c() {
#if defined(__x86_64__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
#else
    return false;
#endif
}

// Which of the vector paths runs: the widest the CPU has, unless a test asked for another.
Simd &simd_choice() {
    static Simd choice = cpu_has_avx2_f16c() ? Simd::avx2 : Simd::sse2;
    return choice;
}

const float *e4m3_values() {
    static const auto table = [] {
        std::array<float, 256> t{};
        for (int q = 0; q < 256; ++q) t[size_t(q)] = kernels::e4m3_to_float(uint8_t(q));
        return t;
    }();
    return table.data();
}

// Scales travel little-endian, byte by byte, as every integer of the wire does.
void put_scale(uint8_t *out, float f) {
    const uint32_t v = std::bit_cast<uint32_t>(f);
    for (int i = 0; i < 4; ++i) out[i] = uint8_t(v >> (8 * i));
}

float get_scale(const uint8_t *in) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t(in[i]) << (8 * i);
    return std::bit_cast<float>(v);
}

}  // namespace

void use_simd(Simd s) {
#if defined(__x86_64__)
    if (s == Simd::avx2 && !cpu_has_avx2_f16c()) s = Simd::sse2;
#else
    s = Simd::sse2;
#endif
    simd_choice() = s;
}

Simd simd_in_use() { return simd_choice(); }

bool code_of(uint32_t wire_quant, kernels::QuantCode &code) {
    switch (wire_quant) {
    case SG_WIRE_QUANT_INT8: code = kernels::QuantCode::int8; return true;
    case SG_WIRE_QUANT_FP8_E4M3: code = kernels::QuantCode::fp8_e4m3; return true;
    default: return false;
    }
}

const char *name_of(uint32_t wire_quant) {
    switch (wire_quant) {
    case SG_WIRE_QUANT_NONE: return "none";
    case SG_WIRE_QUANT_INT8: return "int8";
    case SG_WIRE_QUANT_FP8_E4M3: return "fp8_e4m3";
    default: return "unknown";
    }
}

bool shape_of(const kv::Layout &dst, uint32_t region_in_layer, uint64_t offset, uint64_t length, Shape &out) {
    if (dst.dtype != SG_DTYPE_FP32 && dst.dtype != SG_DTYPE_FP16 && dst.dtype != SG_DTYPE_BF16) return false;
    if (region_in_layer >= dst.regions_per_layer() || length == 0 || dst.block_stride == 0) return false;
    const uint64_t row = dst.row_bytes();
    if (length % row != 0) return false;
    const Rows rows = rows_of(dst, offset);
    for (uint64_t at = offset; at < offset + length; at += row) {
        uint64_t g;
        if (!rows.group(at, g)) return false;
    }
    const uint64_t last_block = (offset + length - 1) / dst.block_stride;
    out.elements = length / dst.elem_bytes;
    out.groups = (last_block - rows.first_block + 1) * rows.planes_per_block * rows.heads;
    return true;
}

void encode(const kv::Layout &dst, uint32_t, uint64_t offset, uint64_t length, const Shape &shape,
            std::span<const std::pair<const uint8_t *, uint64_t>> pieces, kernels::QuantCode code, uint8_t *out) {
    // Rows are read twice (the maximum, then the codes): the first pass widens them to floats,
    // so the second reads those, and a segment of several pieces is gathered first.
    thread_local std::vector<uint8_t> gathered;
    thread_local std::vector<float> values, absmax;
    const uint8_t *raw = pieces.empty() ? nullptr : pieces[0].first;
    if (pieces.size() > 1) {
        gathered.resize(length);
        uint8_t *p = gathered.data();
        for (auto [src, len] : pieces) {
            std::memcpy(p, src, len);
            p += len;
        }
        raw = gathered.data();
    }
    values.resize(shape.elements);
    absmax.assign(shape.groups, 0.0f);
    const Rows rows = rows_of(dst, offset);
    const uint64_t row = dst.row_bytes();
    const uint32_t dim = dst.head_dim;
    const bool avx2 = simd_choice() == Simd::avx2;
#if defined(__x86_64__)
    if (avx2 && dst.dtype == SG_DTYPE_FP16)
        widen_f16_avx2(rows, offset, length, row, dim, raw, values.data(), absmax.data());
    else
#endif
        dispatch(dst.dtype, [&](auto t) {
            widen<decltype(t)>(rows, offset, length, row, dim, raw, values.data(), absmax.data());
        });
    for (uint64_t g = 0; g < shape.groups; ++g) {
        absmax[g] = kernels::quant_scale(absmax[g], code);  // now the scale
        put_scale(out + 4 * g, absmax[g]);
    }
    uint8_t *codes = out + 4 * shape.groups;
    const float *x = values.data();
    for (uint64_t at = 0; at < length; at += row, x += dim, codes += dim) {
        uint64_t g = 0;
        rows.group(offset + at, g);
        const float inv = kernels::quant_inv_scale(absmax[g]);
#if defined(__x86_64__)
        if (avx2) {
            if (code == kernels::QuantCode::int8)
                int8_row_avx2(x, dim, inv, codes);
            else
                fp8_row_avx2(x, dim, inv, codes);
            continue;
        }
#endif
        if (code == kernels::QuantCode::int8)
            int8_row(x, dim, inv, codes);
        else
            fp8_row(x, dim, inv, codes);
    }
}

void decode(const kv::Layout &dst, uint32_t, uint64_t offset, uint64_t length, const Shape &shape, const uint8_t *in,
            kernels::QuantCode code, uint8_t *pool_bytes) {
    const Rows rows = rows_of(dst, offset);
    const uint64_t row = dst.row_bytes();
    const uint32_t dim = dst.head_dim;
    const uint8_t *codes = in + 4 * shape.groups;
    const float *e4m3 = e4m3_values();
    dispatch(dst.dtype, [&](auto t) {
        using T = decltype(t);
        const uint8_t *c = codes;
        for (uint64_t at = 0; at < length; at += row, c += dim) {
            uint64_t g = 0;
            rows.group(offset + at, g);
            const float scale = get_scale(in + 4 * g);
            uint8_t *p = pool_bytes + at;
            // dequantize_value's arithmetic: the code's value times the scale.
            uint32_t d = 0;
#if defined(__x86_64__)
            if constexpr (std::is_same_v<T, F16>)
                if (simd_choice() == Simd::avx2) d = decode_f16_avx2(c, dim, scale, code, e4m3, p);
#endif
#if defined(__SSE2__)
            {
                const __m128 vs = _mm_set1_ps(scale);
                for (; d + 4 <= dim; d += 4) {
                    __m128 v;
                    if (code == kernels::QuantCode::int8) {
                        int32_t q;
                        std::memcpy(&q, c + d, 4);
                        __m128i w = _mm_cvtsi32_si128(q);
                        w = _mm_srai_epi32(_mm_unpacklo_epi16(_mm_unpacklo_epi8(w, w), _mm_unpacklo_epi8(w, w)), 24);
                        // -128 is a non-finite element: the quiet NaN dequantize_value gives.
                        const __m128 bad = _mm_castsi128_ps(_mm_cmpeq_epi32(w, _mm_set1_epi32(-128)));
                        v = _mm_or_ps(_mm_andnot_ps(bad, _mm_mul_ps(_mm_cvtepi32_ps(w), vs)),
                                      _mm_and_ps(bad, _mm_castsi128_ps(_mm_set1_epi32(0x7fc00000))));
                    } else {
                        v = _mm_mul_ps(_mm_setr_ps(e4m3[c[d]], e4m3[c[d + 1]], e4m3[c[d + 2]], e4m3[c[d + 3]]), vs);
                    }
                    T::store4(p + sizeof(uint16_t) * (std::is_same_v<T, F32> ? 2 : 1) * d, v);
                }
            }
#endif
            if (code == kernels::QuantCode::int8) {
                for (; d < dim; ++d) T::store(p, d, kernels::dequantize_value(c[d], scale, code));
            } else {
                for (; d < dim; ++d) T::store(p, d, e4m3[c[d]] * scale);
            }
        }
    });
}

}  // namespace sg::quant
