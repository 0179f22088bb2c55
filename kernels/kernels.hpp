// kernels/: the numeric work behind selection — page digests and Quest scores, window attention
// (SnapKV), heavy-hitter block sums (H2O), top-k, attention over a part of the keys with the exact
// merge of parts, and in-flight quantization of blocks (int8, fp8 E4M3) — as CPU kernels in cpu/
// (portable C++, plus AVX2/F16C and AVX-512 paths for the page digest and Quest scores, chosen at
// run time by a CPU check: cpu/variants.hpp), and as CUDA
// kernels in cuda/ (the plugin libsmartgen-cuda.so.0; their per-element code, cuda/elements.hpp,
// runs on the host too and is tested there against the CPU twins). Depends on
// the C++ standard library only, so it
// knows nothing of the runtime's error type: arguments are preconditions, listed on each function and
// checked by the caller (runtime/select), and asserted in debug builds. Kernels are pure functions of
// their arguments, safe to run concurrently, and do not allocate (the top_k overload that returns a
// vector aside): the ones that need working memory take it from the caller.
//
// Shapes: keys and queries are [token][head][element] tensors seen through a View, whose rows may sit
// anywhere (token-major or head-major blocks, padded strides); a paged pool is handled by calling a
// kernel once per block on a View of that block. Query heads map to KV heads as in grouped-query
// attention: kv_head = q_head / (q_heads / kv_heads). Everything computed is fp32.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "hd.hpp"

namespace sg::kernels {

enum class DType : uint8_t { fp32, fp16, bf16 };

constexpr size_t dtype_bytes(DType d) { return d == DType::fp32 ? 4 : 2; }

// ---- element conversions (IEEE binary16 and bfloat16, bit patterns in uint16_t) ----

// Exact, branch-free apart from a select, so loops over it vectorise. Subnormals, infinities and
// NaNs are kept.
SG_HD inline float fp16_to_float(uint16_t h) {
    // Shifting exponent and mantissa into place and multiplying by 2^112 rebiases normals and
    // normalises subnormals in one go; only Inf/NaN need their exponent forced to all ones.
    const float magic = std::bit_cast<float>(uint32_t(254 - 15) << 23);
    const float was_infnan = std::bit_cast<float>(uint32_t(127 + 16) << 23);
    const float f = std::bit_cast<float>(uint32_t(h & 0x7fffu) << 13) * magic;
    uint32_t u = std::bit_cast<uint32_t>(f);
    if (f >= was_infnan) u |= 255u << 23;
    u |= uint32_t(h & 0x8000u) << 16;
    return std::bit_cast<float>(u);
}

SG_HD inline float bf16_to_float(uint16_t b) { return std::bit_cast<float>(uint32_t(b) << 16); }

// Round to nearest, ties to even; overflow goes to infinity, NaN stays NaN (quiet).
SG_HD inline uint16_t float_to_fp16(float f) {
    uint32_t x = std::bit_cast<uint32_t>(f);
    const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);
    if (x >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds past the largest half
    if (x < 0x38800000u) {
        // Below 2^-14 the result is subnormal: adding 0.5 makes the FPU round at the half's ulp.
        const float denorm_magic = 0.5f;
        const float r = std::bit_cast<float>(x) + denorm_magic;
        return sign | uint16_t(std::bit_cast<uint32_t>(r) - std::bit_cast<uint32_t>(denorm_magic));
    }
    const uint32_t odd = (x >> 13) & 1u;
    x += 0xc8000fffu + odd;  // rebias the exponent by -112 and round to nearest even
    return sign | uint16_t(x >> 13);
}

SG_HD inline uint16_t float_to_bf16(float f) {
    const uint32_t x = std::bit_cast<uint32_t>(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
    return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// ---- views ----

// A [token][head][element] tensor: row (t, h) is `dim` contiguous elements starting at element
// t * token_stride + h * head_stride of `data`. Strides count elements, not bytes.
struct View {
    const void *data = nullptr;
    DType dtype = DType::fp16;
    uint64_t tokens = 0;
    uint32_t heads = 0;
    uint32_t dim = 0;
    uint64_t token_stride = 0;
    uint64_t head_stride = 0;
};

// [token][head][dim], rows packed.
SG_HD inline View token_major(const void *data, DType dtype, uint64_t tokens, uint32_t heads, uint32_t dim) {
    return {data, dtype, tokens, heads, dim, uint64_t(heads) * dim, dim};
}

// [head][row][dim] with `rows_per_head` rows per head (a head-major block holds tokens_per_block rows
// per head even when fewer tokens are valid); the first `tokens` rows of each head are seen.
SG_HD inline View head_major(const void *data, DType dtype, uint64_t tokens, uint32_t heads, uint32_t dim,
                       uint64_t rows_per_head) {
    return {data, dtype, tokens, heads, dim, dim, rows_per_head * dim};
}

// Tokens [first, first + count) of v. Precondition: first + count <= v.tokens.
inline View slice(const View &v, uint64_t first, uint64_t count) {
    View s = v;
    s.data = static_cast<const uint8_t *>(v.data) + first * v.token_stride * dtype_bytes(v.dtype);
    s.tokens = count;
    return s;
}

// How the query heads that share a KV head are combined into that KV head's score.
enum class Combine : uint8_t { max, sum };

// Largest head dimension the kernels accept (they keep one converted row on the stack).
inline constexpr uint32_t kMaxHeadDim = 1024;

// Blocks that hold `tokens` tokens: the ceiling of tokens / tokens_per_block, written so that it
// cannot wrap for any token count (tokens + tokens_per_block - 1 did, near 2^64).
constexpr uint64_t num_blocks(uint64_t tokens, uint32_t tokens_per_block) {
    return tokens / tokens_per_block + (tokens % tokens_per_block != 0);
}

// ---- page digest and Quest ----

// Floats in the digest of `blocks` blocks: [block][kv_head][2][dim], the min row then the max row.
constexpr uint64_t digest_floats(uint64_t blocks, uint32_t kv_heads, uint32_t dim) {
    return blocks * kv_heads * 2 * dim;
}

// Element-wise min and max of each KV head's keys over each block of `tokens_per_block` tokens; the
// last block may be partial and then covers only the valid tokens. (NaN keys give unspecified rows.)
// out: digest_floats(num_blocks(keys.tokens, tokens_per_block), keys.heads, keys.dim) floats.
// Preconditions: tokens_per_block >= 1, 1 <= keys.dim <= kMaxHeadDim.
void page_digest(const View &keys, uint32_t tokens_per_block, float *out);

// Quest upper bound of q·k over each block: score = Σ_i max(q_i·min_i, q_i·max_i), per query head,
// then the query heads of each KV head combined. Row 0 of `query` is used (heads = query heads).
// digest: as page_digest writes it, for `blocks` blocks and `kv_heads` heads of dimension query.dim.
// out: [block][kv_head], blocks * kv_heads floats.
// Preconditions: query.heads is a positive multiple of kv_heads; 1 <= query.dim <= kMaxHeadDim.
void quest_scores(const float *digest, uint64_t blocks, uint32_t kv_heads, const View &query, Combine combine,
                  float *out);

// ---- window attention (SnapKV) ----

// Working memory window_attention needs, in floats.
size_t window_scratch_floats(const View &keys, const View &queries);

// For each KV head and key token: Σ over the W = queries.tokens queries of softmax(q·k/√dim), where
// query w sits at position first_query_pos + w and sees keys 0..position (causal), summed per query
// head, then the query heads of the KV head combined. out: [kv_head][token], keys.heads * keys.tokens
// floats. Preconditions: queries.heads is a positive multiple of keys.heads; queries.dim == keys.dim
// <= kMaxHeadDim; scratch holds window_scratch_floats(keys, queries) floats.
void window_attention(const View &keys, const View &queries, uint64_t first_query_pos, Combine combine,
                      std::span<float> scratch, float *out);

// Per-token scores [head][token] (rows `tokens` apart) summed per block, after an optional max-pool
// over each token's neighbourhood of `pool` tokens (odd; 1 = none; clipped at the ends) as SnapKV
// smooths its votes. out: [block][head], num_blocks(tokens, tokens_per_block) * heads floats.
void block_scores(const float *token_scores, uint32_t heads, uint64_t tokens, uint32_t tokens_per_block, uint32_t pool,
                  float *out);

size_t snapkv_scratch_floats(const View &keys, const View &queries);

// window_attention then block_scores: SnapKV's per-block scores, out [block][kv_head].
void snapkv_scores(const View &keys, const View &queries, uint64_t first_query_pos, Combine combine,
                   uint32_t tokens_per_block, uint32_t pool, std::span<float> scratch, float *out);

// ---- heavy hitters (H2O) ----

// Accumulated attention supplied by the engine, acc[h * head_stride + t] for `heads` heads (KV heads,
// or query heads that are combined into their KV head) and `tokens` tokens, summed per block.
// out: [block][kv_head]. Preconditions: heads is a positive multiple of kv_heads; head_stride >= tokens.
void h2o_scores(const float *acc, uint32_t heads, uint64_t tokens, uint64_t head_stride, uint32_t kv_heads,
                Combine combine, uint32_t tokens_per_block, float *out);

// ---- in-flight quantization: one byte per element, a scale per block and KV head ----
//
// A block's plane is sent as codes plus, per KV head, one fp32 scale: scale = max |x| over the
// head's valid tokens and finite elements ÷ the code's largest magnitude, code = x ÷ scale rounded to
// the nearest code (ties to even); the decode side multiplies back. A head whose elements are all 0
// has scale 0 and codes 0. A non-finite element (±Inf, NaN) travels as the code's NaN (int8: -128,
// which no finite value uses; E4M3: S.1111.111) and arrives as NaN, while the rest of its head keep
// the scale of their own finite values: one bad element never spreads, for either code. Codes are laid out as the plane's elements are ([token][head][dim] or
// [head][token][dim]: the View's strides), scales as [head].

enum class QuantCode : uint8_t { int8, fp8_e4m3 };

// Largest magnitude a code holds: int8 127 (-128 unused, so the range is symmetric), E4M3 448.
SG_HD constexpr float quant_max(QuantCode c) { return c == QuantCode::int8 ? 127.0f : 448.0f; }

// Round to the nearest integer, ties to even, for |v| < 2^22: adding and taking away 1.5 * 2^23 makes
// the FPU round at the units place (the default rounding mode), the same on the host and the device.
SG_HD inline float round_half_even(float v) {
    const float magic = 12582912.0f;  // 1.5 * 2^23
    return (v + magic) - magic;
}

// OCP FP8 E4M3 (FN: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities; S.1111.111
// is NaN): round to nearest even, finite values saturating at ±448 (as CUDA's __NV_SATFINITE);
// infinities and NaN to NaN (0x7f with the sign), the code having no infinity.
SG_HD inline uint8_t float_to_e4m3(float f) {
    uint32_t x = std::bit_cast<uint32_t>(f);
    const uint8_t sign = uint8_t((x >> 24) & 0x80u);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) return uint8_t(sign | 0x7fu);
    if (x < 0x3c800000u) {  // below 2^-6, the smallest normal: multiples of 2^-9
        const float m = round_half_even(std::bit_cast<float>(x) * 512.0f);
        return uint8_t(sign | uint8_t(m));  // 8 is 2^-6 itself, encoded as exponent 1, mantissa 0
    }
    if (x >= 0x43e00000u) return uint8_t(sign | 0x7eu);  // >= 448 saturates
    const uint32_t exponent = (x >> 23) - 127 + 7;
    const uint32_t mantissa = x & 0x7fffffu;
    uint32_t q = (exponent << 3) | (mantissa >> 20);
    const uint32_t rest = mantissa & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (q & 1u))) ++q;  // a carry moves into the exponent
    return uint8_t(sign | (q > 0x7eu ? 0x7eu : q));
}

SG_HD inline float e4m3_to_float(uint8_t q) {
    const uint32_t sign = uint32_t(q & 0x80u) << 24;
    const uint32_t exponent = (q >> 3) & 0xfu, mantissa = q & 7u;
    if (exponent == 0xfu && mantissa == 7u) return std::bit_cast<float>(sign | 0x7fc00000u);
    if (exponent == 0) return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(float(mantissa) * 0.001953125f));
    return std::bit_cast<float>(sign | ((exponent - 7 + 127) << 23) | (mantissa << 20));
}

// The int8 code a non-finite element travels as: -128, outside the symmetric range of finite ones.
constexpr uint8_t kInt8NonFinite = 0x80;

// Whether x is ±Inf or NaN, by its bits (no libm on the device, and fast-math cannot fold it away).
SG_HD inline bool non_finite(float x) { return (std::bit_cast<uint32_t>(x) & 0x7fffffffu) >= 0x7f800000u; }

// One element: x scaled by inv_scale (quant_inv_scale of the head's scale), to a code.
SG_HD inline uint8_t quantize_value(float x, float inv_scale, QuantCode c) {
    if (non_finite(x)) return c == QuantCode::int8 ? kInt8NonFinite : uint8_t((std::bit_cast<uint32_t>(x) >> 24 & 0x80u) | 0x7fu);
    const float v = x * inv_scale;
    if (c == QuantCode::fp8_e4m3) return float_to_e4m3(v);
    const float r = round_half_even(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    return uint8_t(int8_t(r));
}

SG_HD inline float dequantize_value(uint8_t q, float scale, QuantCode c) {
    if (c == QuantCode::int8 && q == kInt8NonFinite) return std::bit_cast<float>(0x7fc00000u);
    return (c == QuantCode::fp8_e4m3 ? e4m3_to_float(q) : float(int8_t(q))) * scale;
}

// The scale of a head from its largest magnitude, and the factor quantize_value multiplies by,
// derived from the scale alone so that whoever holds the scale (a kernel thread, the CPU twin)
// computes the same codes.
SG_HD inline float quant_scale(float absmax, QuantCode c) { return absmax / quant_max(c); }
SG_HD inline float quant_inv_scale(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// Quantizes the `block.tokens` valid tokens of one block plane: codes at the View's element offsets
// (the same strides, one byte each), scales[head]. Preconditions: 1 <= block.dim <= kMaxHeadDim.
void quantize_block(const View &block, QuantCode code, uint8_t *codes, float *scales);

// The reverse into `out`, a plane of dtype `out.dtype` with `out`'s strides (out.data is written).
void dequantize_block(const uint8_t *codes, const float *scales, QuantCode code, const View &out);

// ---- top-k ----

// Reorders `candidates` (indices into scores) so that its first min(k, size) entries are the best,
// best first: higher score wins, equal scores go to the lower index, NaN ranks below everything.
// O(n) selection then a sort of the k chosen.
void top_k(std::span<const float> scores, std::span<uint32_t> candidates, size_t k);

// The best min(k, scores.size()) indices of scores, best first.
std::vector<uint32_t> top_k(std::span<const float> scores, size_t k);

// ---- attention over a part of the keys, and the exact merge of parts ----
//
// Parallel on-demand attention: a decode step attends to the blocks it holds while the missing ones
// are fetched, then to the fetched ones as they land, and merges. A part is kept as the three
// quantities softmax attention decomposes into over any set of keys S with scores s_j:
//   max = max_j s_j,   sum = sum_j exp(s_j - max),   acc = sum_j exp(s_j - max) * v_j   (dim floats)
// so that parts over disjoint sets merge exactly (the log-sum-exp merge) into the part of their
// union, whatever the split, and attention over S is acc / sum. An empty part is {-inf, 0, zeros}.
// The part's storage is the caller's.
struct AttentionPart {
    float *max;
    float *sum;
    float *acc;  // dim floats
};

// Folds the keys and values of one KV head (rows of `keys` and `values`: same tokens and dim) into
// `part` for one query row of dim floats, scores scaled by `scale` (1/sqrt(dim) for standard
// attention). Calling it block after block covers all of them. Precondition: keys.dim <= kMaxHeadDim.
void attend_part(const float *query, const View &keys, const View &values, uint32_t kv_head, float scale,
                 AttentionPart part);
// Folds part b (max_b, sum_b, acc_b) into `into`; either may be empty.
void merge_parts(AttentionPart into, float max_b, float sum_b, const float *acc_b, uint32_t dim);
// out = acc / sum: the attention output of the part (zeros for an empty part).
void finish_part(float sum, const float *acc, uint32_t dim, float *out);

}  // namespace sg::kernels
