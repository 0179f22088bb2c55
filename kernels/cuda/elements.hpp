// The per-element work of the CUDA kernels (kernels/cuda/kernels.cu), written once for the device and
// the host: a kernel thread calls these for its element, and the host harness
// (tests/unit/cuda_elements_test.cpp) calls them over the whole grid and compares what they produce
// with the CPU twins, in every CI run, on machines without a GPU. Only index arithmetic, loads and
// conversions live here; nothing allocates, nothing depends on the CUDA runtime.
#pragma once

#include <cstdint>

#include "hd.hpp"
#include "kernels.hpp"

namespace sg::kernels::cuda {

// A staging buffer holds the listed blocks' K and V planes back to back, [i][plane][plane_bytes],
// the layout the staged path sends (gather on the prefill side, scatter on the decode side).
struct PackGeometry {
    uint64_t plane_bytes = 0;   // one K (or V) plane of one block
    uint64_t block_stride = 0;  // bytes from one block to the next in a layer's region
    uint32_t planes = 2;        // K and V
    uint32_t fused = 0;         // 1: one region per layer, a block's V plane right after its K plane
};

// Where packed byte `at` of the staging buffer comes from (gather) or goes to (scatter): the plane
// (0 = K, 1 = V; with separate K and V regions it also picks the region) and the byte's offset in
// that plane's region. blocks[i] is the physical block of the i-th packed block.
struct PackSource {
    uint32_t plane;
    uint64_t region_offset;
};

SG_HD inline PackSource packed_source(const PackGeometry &g, const uint32_t *blocks, uint64_t at) {
    const uint64_t per_block = g.plane_bytes * g.planes;
    const uint64_t i = at / per_block;
    const uint64_t in_block = at - i * per_block;
    const uint32_t plane = uint32_t(in_block / g.plane_bytes);
    const uint64_t in_plane = in_block - uint64_t(plane) * g.plane_bytes;
    const uint64_t fused_shift = g.fused ? uint64_t(plane) * g.plane_bytes : 0;
    return {plane, uint64_t(blocks[i]) * g.block_stride + fused_shift + in_plane};
}

// The widest copy unit (16, 8, 4, 2 or 1 bytes) that divides a plane and keeps every unit aligned in
// the staging buffer and in both regions, so one thread moves one unit and never crosses a plane.
SG_HD inline uint32_t pack_unit(const PackGeometry &g, uint64_t base_alignment) {
    for (uint32_t unit = 16; unit > 1; unit /= 2)
        if (g.plane_bytes % unit == 0 && g.block_stride % unit == 0 && base_alignment % unit == 0) return unit;
    return 1;
}

// One key element of a block as fp32: row (token, head) of `keys` (a View of the block), element d.
SG_HD inline float key_element(const View &keys, uint64_t token, uint32_t head, uint32_t d) {
    const uint64_t index = token * keys.token_stride + uint64_t(head) * keys.head_stride + d;
    switch (keys.dtype) {
        case DType::fp32: return static_cast<const float *>(keys.data)[index];
        case DType::fp16: return fp16_to_float(static_cast<const uint16_t *>(keys.data)[index]);
        case DType::bf16: return bf16_to_float(static_cast<const uint16_t *>(keys.data)[index]);
    }
    return 0.0f;
}

// Page digest element (head, d) of one block: min and max of key element d of `head` over the
// block's first `tokens` tokens (page_digest's row, one element of it). Compared as page_digest
// compares, so finite keys give the CPU twin's bits exactly (NaN keys: unspecified, as there).
SG_HD inline void digest_element(const View &block, uint64_t tokens, uint32_t head, uint32_t d, float *min_out,
                                 float *max_out) {
    float lo = key_element(block, 0, head, d);
    float hi = lo;
    for (uint64_t t = 1; t < tokens; ++t) {
        const float v = key_element(block, t, head, d);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    *min_out = lo;
    *max_out = hi;
}

// The largest magnitude of one head's elements over a block's first `tokens` tokens (NaN ignored,
// as std::fmax ignores it in the CPU twin): the quantization scale's source, one thread per head.
SG_HD inline float head_absmax(const View &block, uint64_t tokens, uint32_t head) {
    float m = 0.0f;
    for (uint64_t t = 0; t < tokens; ++t)
        for (uint32_t d = 0; d < block.dim; ++d) {
            const float v = key_element(block, t, head, d);
            if (non_finite(v)) continue;  // travels as the code's NaN; the scale is the finite ones'
            const float a = v < 0.0f ? -v : v;
            m = a > m ? a : m;
        }
    return m;
}

// Quantization element (token, head, d) of a block, with the head's inverse scale; its code goes
// to the same element offset the View gives the value.
SG_HD inline uint8_t quantize_element(const View &block, uint64_t token, uint32_t head, uint32_t d, float inv_scale,
                                      QuantCode code) {
    return quantize_value(key_element(block, token, head, d), inv_scale, code);
}

// Quest's score of one (block, KV head): per query head of the group, the upper bound
// Σ_i max(q_i·min_i, q_i·max_i) over the block's digest rows, combined over the group (query row 0).
// Summed in element order; the CPU twin (quest_scores) sums in vector lanes, so the two agree within
// float rounding, not bit for bit.
SG_HD inline float quest_score_element(const float *digest, uint32_t kv_heads, const View &query, Combine combine,
                                       uint64_t block, uint32_t kv_head) {
    const uint32_t group = query.heads / kv_heads;
    const float *lo = digest + (block * kv_heads + kv_head) * 2 * query.dim;
    const float *hi = lo + query.dim;
    float acc = 0.0f;
    for (uint32_t j = 0; j < group; ++j) {
        float s = 0.0f;
        for (uint32_t d = 0; d < query.dim; ++d) {
            const float q = key_element(query, 0, kv_head * group + j, d);
            const float a = q * lo[d], b = q * hi[d];
            s += a > b ? a : b;
        }
        acc = j == 0 ? s : combine == Combine::max ? (s > acc ? s : acc) : acc + s;
    }
    return acc;
}

// Top-k's order as one integer, for a radix sort on the device: higher ranks first is the CPU twin's
// order (kernels::top_k: higher score wins, NaN counts as -inf, equal scores go to the lower index;
// -0 and +0 are equal scores). The score's bits made order-preserving in the high half, the index
// inverted in the low half.
SG_HD inline uint32_t topk_key(float s) {
    if (s != s) s = -__builtin_huge_valf();
    if (s == 0.0f) s = 0.0f;  // -0 ties with +0, as == says
    const uint32_t u = std::bit_cast<uint32_t>(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

SG_HD inline uint64_t topk_rank(float score, uint32_t index) {
    return (uint64_t(topk_key(score)) << 32) | uint32_t(~index);
}

SG_HD inline uint32_t topk_index(uint64_t rank) { return ~uint32_t(rank); }

}  // namespace sg::kernels::cuda
